"""vLLM 0.34's GPU suffix speculator restated in plain Python from the research note
(``vllm_delta_0.34.md`` §4): Python ints for the int64 hash and packed entries, lists for
the corpus and the table. The oracle for ``specjax.proposers.suffix_gpu``."""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

MULT = 0x9E3779B97F4A7C15
SLOTS = 8


def wrap64(x: int) -> int:
    """``x`` as a signed int64 (two's complement wrap)."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


def bucket(hv: int, nb: int) -> int:
    return ((hv >> 29) ^ hv) & (nb - 1)          # Python's >> on ints is the signed shift


def keys(newest_first: list[int], nb: int) -> dict[int, int]:
    """key length (2, 4) -> bucket, for as many of the 4 newest tokens as are given."""
    hv, out = 0, {}
    for d, tok in enumerate(newest_first[:4]):
        hv = wrap64((hv ^ tok) * MULT)
        if d in (1, 3):
            out[d + 1] = bucket(hv, nb)
    return out


def num_buckets(corpus_len: int) -> int:
    n = max(16, corpus_len // 4)
    p = 1
    while p < n:
        p *= 2
    return p


class Corpus:
    """The ring corpus and its ``[2][NB][8]`` table of packed entries (-1 empty)."""

    def __init__(self, corpus_len: int):
        self.size = corpus_len
        self.nb = num_buckets(corpus_len)
        self.corpus = [-1] * corpus_len
        self.table = [[[-1] * SLOTS for _ in range(self.nb)] for _ in range(2)]
        self.head = 0
        self.doc_seq = 0

    def ingest(self, docs: list[list[int]]) -> None:
        """Documents in order: each trimmed to its newest ``size - 1`` tokens, written with a
        separator at the head (at 0 if it would pass the end), later ones over earlier; every
        position not overwritten by a later document of the batch is indexed."""
        keep = self.size - 1
        docs = [list(d)[len(d) - keep:] if len(d) > keep else list(d) for d in docs]
        docs = [d for d in docs if d]
        if self.doc_seq + len(docs) > 2**31 - 1:
            self.table = [[[-1] * SLOTS for _ in range(self.nb)] for _ in range(2)]
            self.doc_seq = 0
        starts = []
        for d in docs:
            if self.head + len(d) + 1 > self.size:
                self.head = 0
            starts.append(self.head)
            self.head += len(d) + 1
        for d, s in zip(docs, starts):
            self.corpus[s : s + len(d)] = d
            self.corpus[s + len(d)] = -1
        for i, (d, s) in enumerate(zip(docs, starts)):
            seq = self.doc_seq + i
            later = [(starts[j], starts[j] + len(docs[j])) for j in range(i + 1, len(docs))]
            for j in range(len(d)):
                p = s + j
                if any(lo <= p <= hi for lo, hi in later):
                    continue
                ks = keys(d[j - 1 :: -1] if j else [], self.nb)
                for plane, key_len in ((0, 4), (1, 2)):
                    if j >= key_len:
                        row = self.table[plane][ks[key_len]]
                        row[seq % SLOTS] = max(row[seq % SLOTS], (seq << 32) | p)
        self.doc_seq += len(docs)

    def candidates(self, tok: list[int], max_depth: int, k: int) -> list[dict]:
        """The verified candidates of a request's context ``tok`` (duplicates once)."""
        n = len(tok)
        ks = keys(tok[::-1], self.nb)
        found: dict[int, dict] = {}
        for plane, key_len in ((0, 4), (1, 2)):
            if n < key_len:
                continue
            for entry in self.table[plane][ks[key_len]]:
                if entry < 0:
                    continue
                cpos = entry & 0xFFFFFFFF
                if self.corpus[cpos] == -1:
                    continue
                c_len = 0
                while (c_len < max_depth and c_len < n and cpos - 1 - c_len >= 0
                       and self.corpus[cpos - 1 - c_len] != -1
                       and self.corpus[cpos - 1 - c_len] == tok[n - 1 - c_len]):
                    c_len += 1
                if c_len < key_len:
                    continue
                cont = []
                while len(cont) < k and cpos + len(cont) < self.size \
                        and self.corpus[cpos + len(cont)] != -1:
                    cont.append(self.corpus[cpos + len(cont)])
                old = found.get(cpos)
                if old is None or entry > old["entry"]:
                    found[cpos] = {"entry": entry, "c_len": c_len, "cont": cont}
        return list(found.values())


def best_chain(cands: list[dict], k: int):
    """``(L, chain)`` by the frequency rule, or None without candidates."""
    best = None
    for L in sorted({c["c_len"] for c in cands}):
        alive = [c for c in cands if c["c_len"] >= L]
        den, num, chain = len(alive), 0, []
        for d in range(k):
            emit = [c for c in alive if len(c["cont"]) > d]
            if not emit:
                break
            counts = Counter(c["cont"][d] for c in emit)
            top = max(counts.values())
            newest = max((c for c in emit if counts[c["cont"][d]] == top), key=lambda c: c["entry"])
            t = newest["cont"][d]
            num += top
            chain.append(t)
            alive = [c for c in emit if c["cont"][d] == t]
        score = (Fraction(num, den), L)
        if best is None or score > best[0]:
            best = (score, L, chain)
    return None if best is None else best[1:]


def own_match(tok: list[int], max_depth: int):
    """``(m, pos)`` of the longest match ending before ``pos`` (ties: latest), or (0, 0)."""
    n = len(tok)
    best = (0, 0)
    for pos in range(1, n):
        m = 0
        while m < max_depth and pos - 1 - m >= 0 and tok[pos - 1 - m] == tok[n - 1 - m]:
            m += 1
        if m > 0 and (m, pos) > best:
            best = (m, pos)
    return best


def propose(tok: list[int], *, k: int, max_depth: int, max_model_len: int,
            corpus: Corpus | None, valid: bool = True, cands: list[dict] | None = None):
    """``(drafts (num_drafts long), num_valid, source, match_len)`` for one request."""
    n = len(tok)
    if not valid or n < 1:
        return [], 0, -1, 0
    m, pos = own_match(tok, max_depth)
    real, source, match = (tok[pos : pos + k], 0, m) if m else ([], -1, 0)
    if corpus is not None and max_depth >= 2:
        if cands is None:
            cands = corpus.candidates(tok, max_depth, k)
        chosen = best_chain(cands, k)
        if chosen is not None and chosen[0] > m:
            real, source, match = chosen[1], 1, chosen[0]
    num_drafts = max(0, min(k, max_model_len - n))
    real = real[:num_drafts]
    if not real:
        source, match = -1, 0
    return real + [tok[-1]] * (num_drafts - len(real)), len(real), source, match
