"""The device suffix speculator (vLLM 0.34's GPU suffix decoding) against the plain-Python
oracle ``suffix_oracle`` (written from the research note, §4), a brute-force matcher that
uses no hash table, and hand-worked cases; then its config and host-engine adapter."""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np
import pytest
import suffix_oracle as O

from specjax.config import SpeculativeConfig
from specjax.proposers.interface import TokenHistory
from specjax.proposers.suffix_gpu import (
    SOURCE_CORPUS,
    SOURCE_NONE,
    SOURCE_OWN,
    SuffixGPUProposer,
    SuffixGPUProposerAdapter,
    suffix_search,
)
from specjax.proposers.suffix_gpu_corpus import (
    DOC_SEQ_MAX,
    SuffixGPUState,
    bucket_keys,
    build_documents,
    init_corpus,
    num_buckets,
)

MML = 64
#: (k, max_depth, corpus_tokens) of the random cases: few, so that few programs compile.
CONFIGS = ((1, 1, 23), (3, 2, 8), (6, 5, 64), (4, 8, 300), (2, 24, 23), (5, 3, 300),
           (3, 7, 8), (6, 2, 64))


def pad(rows, width=None, fill=-1):
    width = width or max(1, max((len(r) for r in rows), default=1))
    out = np.full((len(rows), width), fill, np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return jnp.asarray(out), jnp.asarray(np.array([len(r) for r in rows], np.int32))


def ingest_both(prop, state, oracle, docs):
    rows = -(-max(len(docs), 1) // 8) * 8                   # fixed shapes: few compilations
    arr, lens = pad(docs + [[]] * (rows - len(docs)), max(64, max(map(len, docs), default=1)))
    state = prop.ingest(state, arr, lens)
    oracle.ingest(docs)
    return state


def packed_table(state: SuffixGPUState) -> list:
    seq = np.asarray(state.table_seq).astype(np.int64)
    pos = np.asarray(state.table_pos).astype(np.int64)
    return np.where(seq < 0, -1, (seq << 32) | pos).tolist()


def assert_corpus_equal(state, oracle):
    assert np.asarray(state.corpus).tolist() == oracle.corpus
    assert packed_table(state) == oracle.table
    assert int(state.corpus_head) == oracle.head and int(state.doc_seq) == oracle.doc_seq


def run_search(prop, state, contexts, valid=None, width=40):
    tok, n = pad(contexts, width, fill=0)
    valid = jnp.ones(n.shape, jnp.bool_) if valid is None else jnp.asarray(valid)
    drafts, match = prop.propose_arrays(state, tok, n, valid)
    return (np.asarray(drafts.token_ids), np.asarray(drafts.num_drafts),
            np.asarray(match.num_valid), np.asarray(match.source), np.asarray(match.match_len))


def check_row(out, i, expected):
    drafts, num_drafts, num_valid, source, match_len = out
    want, want_valid, want_source, want_match = expected
    assert drafts[i, : len(want)].tolist() == want and (drafts[i, len(want):] == -1).all()
    assert (num_drafts[i], num_valid[i], source[i], match_len[i]) == \
        (len(want), want_valid, want_source, want_match)


def random_setup(seed):
    rng = np.random.default_rng(seed)
    k, depth, corpus = CONFIGS[seed % len(CONFIGS)]
    prop = SuffixGPUProposer(num_speculative_tokens=k, max_model_len=MML, max_depth=depth,
                             corpus_tokens=corpus)
    vocab = int(rng.integers(2, 5))
    state = prop.init_state()
    oracle = O.Corpus(prop.corpus_tokens if prop.use_corpus else 1)
    for _ in range(int(rng.integers(1, 5))):
        docs = [rng.integers(0, vocab, int(rng.integers(0, 40))).tolist()
                for _ in range(int(rng.integers(1, 7)))]
        state = ingest_both(prop, state, oracle, docs) if prop.use_corpus else state
    return rng, prop, state, oracle, vocab


# ---------------------------------------------------------------------- hash


def test_hash_equals_python_int64():
    """Bucket numbers from the uint32-pair restatement equal the int64 formula on Python ints,
    for small, large and negative token values and every bucket-count size."""
    rng = np.random.default_rng(0)
    tail = rng.integers(-2**31, 2**31, size=(3000, 4), dtype=np.int64).astype(np.int32)
    tail[:1000] = rng.integers(0, 8, size=(1000, 4))
    tail[1000:1010] = [[2**31 - 1] * 4, [-1] * 4, [0] * 4, [-2**31] * 4, *[[0, 1, 2, 3]] * 6]
    for nb in (16, 1024, 1 << 18, 1 << 29):
        key4, key2 = (np.asarray(x) for x in bucket_keys(jnp.asarray(tail), nb))
        for i in range(tail.shape[0]):
            want = O.keys([int(t) for t in tail[i]], nb)
            assert (key4[i], key2[i]) == (want[4], want[2]), (i, nb)
    assert num_buckets(1 << 20) == 262144 and num_buckets(8) == 16 and num_buckets(100) == 32


# ---------------------------------------------------------------------- ingestion


@pytest.mark.parametrize("seed", range(30))
def test_ingest_equals_oracle(seed):
    """Corpus, table, head and doc_seq after batches of documents (small rings, so documents
    wrap, overwrite earlier ones of the same batch and get trimmed; empty rows skipped)."""
    rng = np.random.default_rng(seed)
    corpus_len = int(rng.choice([2, 5, 16, 40, 129]))
    prop = SuffixGPUProposer(num_speculative_tokens=3, max_model_len=MML, corpus_tokens=corpus_len)
    state, oracle = prop.init_state(), O.Corpus(corpus_len)
    for _ in range(int(rng.integers(1, 6))):
        docs = [rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(0, 50))).tolist()
                for _ in range(int(rng.integers(1, 9)))]
        state = ingest_both(prop, state, oracle, docs)
        assert_corpus_equal(state, oracle)


def test_bucket_keeps_the_newest_occurrence_of_the_last_eight_documents():
    """Ten documents hold the key (5, 6): the bucket keeps one entry per doc_seq % 8, the
    newest document of each residue and its newest occurrence."""
    prop = SuffixGPUProposer(num_speculative_tokens=2, max_model_len=MML, corpus_tokens=4096)
    state, oracle = prop.init_state(), O.Corpus(4096)
    docs = [[5, 6, 10 + i, 5, 6, 20 + i] for i in range(10)]
    state = ingest_both(prop, state, oracle, docs[:3])
    state = ingest_both(prop, state, oracle, docs[3:])
    assert_corpus_equal(state, oracle)
    b2 = O.keys([6, 5], num_buckets(4096))[2]
    entries = [e for e in packed_table(state)[1][b2] if e >= 0]
    want = {(seq << 32) | (7 * seq + 5) for seq in range(2, 10)}   # position of 20 + seq
    assert set(entries) == want
    # the draft after "5 6" follows the newest document (doc 9's 29), all eight agreeing
    # on nothing else: counts tie at 1, so the newest candidate wins
    out = run_search(prop, state, [[1, 5, 6]])
    check_row(out, 0, ([29, 6], 1, SOURCE_CORPUS, 2))


def test_doc_seq_restart_clears_the_table():
    """A batch that would take doc_seq past 2**31 - 1 clears the table and restarts at 0."""
    prop = SuffixGPUProposer(num_speculative_tokens=2, max_model_len=MML, corpus_tokens=64)
    state, oracle = prop.init_state(), O.Corpus(64)
    state = ingest_both(prop, state, oracle, [[1, 2, 3, 4, 5]])
    state = state._replace(doc_seq=jnp.asarray(DOC_SEQ_MAX - 1, jnp.int32))
    oracle.doc_seq = DOC_SEQ_MAX - 1
    state = ingest_both(prop, state, oracle, [[7, 8, 9]])          # seq 2**31 - 2: fits
    assert int(state.doc_seq) == DOC_SEQ_MAX
    state = ingest_both(prop, state, oracle, [[7, 8, 9, 1], [3, 3, 3]])   # would pass: restart
    assert_corpus_equal(state, oracle)
    assert int(state.doc_seq) == 2 and int(np.asarray(state.table_seq).max()) == 1


@pytest.mark.parametrize("corpus_tokens,mml", [(300, 40), (23, 64)])
def test_ingest_documents_is_one_program_and_equals_the_oracle(corpus_tokens, mml):
    """Any length of documents goes in at one width (rows a power of two): the corpus equals
    the oracle's after each batch (documents by ``build_documents``' rule); the programs
    compiled are those of the row counts, all made by ``warmup_finish``."""
    from specjax.proposers import suffix_gpu_corpus as co

    prop = SuffixGPUProposer(num_speculative_tokens=3, max_model_len=mml, max_depth=4,
                             corpus_tokens=corpus_tokens)
    adapter = SuffixGPUProposerAdapter(SpeculativeConfig(
        method="suffix", num_speculative_tokens=3, suffix_decoding_max_tree_depth=4,
        suffix_decoding_corpus_tokens=corpus_tokens), max_model_len=mml)
    before = co.ingest._cache_size()
    adapter.warmup_finish(19)                       # rows 32, 16, 8, 4, 2, 1
    assert co.ingest._cache_size() - before <= 6 and int(adapter.state.doc_seq) == 0
    warmed = co.ingest._cache_size()
    state, oracle = adapter.state, O.Corpus(corpus_tokens)
    rng = np.random.default_rng(corpus_tokens)
    for count in (1, 8, 19, 3):
        toks = [rng.integers(0, 6, int(rng.integers(1, mml + 1))).tolist() for _ in range(count)]
        prompts = [int(rng.integers(0, len(t) + 1)) for t in toks]
        state = prop.ingest_documents(state, prompts, toks)
        oracle.ingest([t[max(p - 3, 0):][-(corpus_tokens - 1):] for p, t in zip(prompts, toks)])
        assert_corpus_equal(state, oracle)
    assert co.ingest._cache_size() == warmed
    if corpus_tokens - 1 > prop.ingest_width:        # (a smaller corpus trims documents)
        with pytest.raises(ValueError, match="token_lists: a document of"):
            prop.ingest_documents(state, [0], [[1] * (prop.ingest_width + 1)])


def test_build_documents():
    docs, lens = build_documents([5, 2, 0], [list(range(10)), [7, 8, 9], [1, 2]], corpus_len=6)
    assert docs.shape == (4, 8) and lens.tolist() == [5, 3, 2, 0]
    assert docs[0, :5].tolist() == [5, 6, 7, 8, 9]      # [2, 10) trimmed to the newest 5
    assert docs[1, :3].tolist() == [7, 8, 9] and docs[2, :2].tolist() == [1, 2]
    with pytest.raises(ValueError, match=r"prompt_lens\[0\]"):
        build_documents([4], [[1, 2, 3]], corpus_len=8)
    with pytest.raises(ValueError, match="prompt_lens has 2 entries"):
        build_documents([1, 2], [[1, 2, 3]], corpus_len=8)


# ---------------------------------------------------------------------- search


@pytest.mark.parametrize("seed", range(40))
def test_search_equals_oracle(seed):
    """Drafts, counts, source and match length equal the oracle's on random histories and
    corpora (small vocabularies force matches; small rings force wraps and stale entries)."""
    rng, prop, state, oracle, vocab = random_setup(seed)
    contexts = [rng.integers(0, vocab, int(rng.integers(0, 41))).tolist() for _ in range(8)]
    valid = rng.random(8) < 0.85
    out = run_search(prop, state, contexts, valid)
    for i, ctx in enumerate(contexts):
        want = O.propose(ctx, k=prop.k, max_depth=prop.max_depth, max_model_len=MML,
                         corpus=oracle if prop.use_corpus else None, valid=bool(valid[i]))
        check_row(out, i, want)


def test_search_sources_are_all_exercised():
    """The random cases above reach own-history drafts, corpus drafts and no-match rows."""
    seen = set()
    for seed in range(40):
        rng, prop, state, _oracle, vocab = random_setup(seed)
        contexts = [rng.integers(0, vocab, int(rng.integers(0, 41))).tolist() for _ in range(8)]
        seen |= set(run_search(prop, state, contexts)[3].tolist())
    assert seen == {SOURCE_NONE, SOURCE_OWN, SOURCE_CORPUS}


def brute_candidates(docs, corpus_base, tok, max_depth, k):
    """Candidates by scanning the documents (no hash table): per document and key length,
    the newest position preceded by the context's last 2 / 4 tokens."""
    n, found = len(tok), {}
    for seq, (doc, start) in enumerate(zip(docs, corpus_base)):
        for key_len in (4, 2):
            if n < key_len:
                continue
            hits = [j for j in range(key_len, len(doc)) if doc[j - key_len:j] == tok[n - key_len:]]
            if not hits:
                continue
            j = hits[-1]
            c_len = 0
            while c_len < min(max_depth, n, j) and doc[j - 1 - c_len] == tok[n - 1 - c_len]:
                c_len += 1
            entry = (seq << 32) | (start + j)
            if c_len >= key_len and entry > found.get(start + j, {"entry": -1})["entry"]:
                found[start + j] = {"entry": entry, "c_len": c_len, "cont": doc[j:j + k]}
    return list(found.values())


@pytest.mark.parametrize("seed", range(25))
def test_search_equals_brute_force_without_overflow(seed):
    """With at most 8 documents, no wrap and no other key in the context's buckets, the
    drafts equal those of a matcher that scans the documents instead of the table; own
    history alone equals a brute-force longest-suffix scan."""
    rng = np.random.default_rng(1000 + seed)
    k, depth, _ = CONFIGS[seed % len(CONFIGS)]
    depth, vocab = max(depth, 2), int(rng.integers(2, 5))
    prop = SuffixGPUProposer(num_speculative_tokens=k, max_model_len=MML, max_depth=depth,
                             corpus_tokens=1 << 14)
    docs = [rng.integers(0, vocab, int(rng.integers(1, 30))).tolist()
            for _ in range(int(rng.integers(1, 9)))]
    state, oracle = prop.init_state(), O.Corpus(1 << 14)
    state = ingest_both(prop, state, oracle, docs)
    starts = np.cumsum([0] + [len(d) + 1 for d in docs])[:-1].tolist()
    nb = num_buckets(1 << 14)
    keys_in_docs = {(kl, tuple(d[j - kl:j])) for d in docs for kl in (2, 4)
                    for j in range(kl, len(d))}
    own_only = SuffixGPUProposer(num_speculative_tokens=k, max_model_len=MML, max_depth=depth,
                                 corpus_tokens=0)
    used = 0
    for _ in range(12):
        ctx = rng.integers(0, vocab, int(rng.integers(1, 30))).tolist()
        m, pos = O.own_match(ctx, depth)
        brute_own = max(((mm, p) for p in range(1, len(ctx)) for mm in range(1, depth + 1)
                         if p >= mm and ctx[p - mm:p] == ctx[len(ctx) - mm:]), default=(0, 0))
        assert (m, pos) == brute_own
        check_row(run_search(own_only, own_only.init_state(), [ctx]), 0,
                  O.propose(ctx, k=k, max_depth=depth, max_model_len=MML, corpus=None))
        mine = {kl: O.keys(ctx[::-1], nb).get(kl) for kl in (2, 4)}
        clash = any(kl2 == kl and key != tuple(ctx[-kl:]) and O.keys(list(key[::-1]), nb)[kl]
                    == mine[kl] for kl2, key in keys_in_docs for kl in (2, 4) if len(ctx) >= kl)
        if clash:
            continue
        used += 1
        cands = brute_candidates(docs, starts, ctx, depth, k)
        want = O.propose(ctx, k=k, max_depth=depth, max_model_len=MML, corpus=oracle, cands=cands)
        check_row(run_search(prop, state, [ctx]), 0, want)
    assert used >= 6


def test_frequency_chain_hand_cases():
    """Hand-worked: three documents continue "1 2" as 7 8 / 7 9 / 5; the chain is 7 (2 of 3)
    then the newest of the tied 8 / 9 (9), score (2 + 1) / 3; a longer match of the own
    history wins, an equally long one keeps the own history."""
    prop = SuffixGPUProposer(num_speculative_tokens=3, max_model_len=MML, corpus_tokens=256)
    state, oracle = prop.init_state(), O.Corpus(256)
    state = ingest_both(prop, state, oracle, [[1, 2, 7, 8], [1, 2, 7, 9], [1, 2, 5]])
    out = run_search(prop, state, [[4, 1, 2], [1, 2, 3, 1, 2], [1, 2, 3, 0, 1, 2], [9]])
    check_row(out, 0, ([7, 9, 2], 2, SOURCE_CORPUS, 2))
    check_row(out, 1, ([3, 1, 2], 3, SOURCE_OWN, 2))          # own match of length 2 ties: own
    check_row(out, 2, ([3, 0, 1], 3, SOURCE_OWN, 2))
    check_row(out, 3, ([9, 9, 9], 0, SOURCE_NONE, 0))          # no match: k fillers
    # a longer corpus match (4 tokens) beats a more frequent short one
    state = ingest_both(prop, state, oracle, [[3, 3, 1, 2, 6]])
    out = run_search(prop, state, [[3, 3, 1, 2]])
    check_row(out, 0, ([6, 2, 2], 1, SOURCE_CORPUS, 4))


def test_draft_count_limits():
    """Rows at max_model_len - 1 get one draft; invalid and empty rows none."""
    prop = SuffixGPUProposer(num_speculative_tokens=4, max_model_len=6, corpus_tokens=0)
    out = run_search(prop, prop.init_state(), [[1, 2, 1, 2, 1], [1, 2, 1], [1, 1], []],
                     valid=[True, True, False, True], width=6)
    check_row(out, 0, ([2], 1, SOURCE_OWN, 3))
    check_row(out, 1, ([2, 1, 1], 2, SOURCE_OWN, 1))
    check_row(out, 2, ([], 0, SOURCE_NONE, 0))
    check_row(out, 3, ([], 0, SOURCE_NONE, 0))


def test_search_is_traceable():
    """suffix_search composes under jit with the state as an argument (the device hook)."""
    import jax

    prop = SuffixGPUProposer(num_speculative_tokens=2, max_model_len=MML, corpus_tokens=64)
    state = prop.ingest(prop.init_state(), *pad([[1, 2, 3, 4]]))
    tok, n = pad([[0, 1, 2]], 8, fill=0)
    fn = jax.jit(lambda s, t, m, v: suffix_search(s, t, m, v, k=2, max_depth=24,
                                                  max_model_len=MML, use_corpus=True))
    drafts, match = fn(state, tok, n, jnp.ones((1,), jnp.bool_))
    assert np.asarray(drafts.token_ids).tolist() == [[3, 4]] and int(match.source[0]) == 1


# ---------------------------------------------------------------------- errors


def test_bad_arguments_are_named():
    for kw, name in (({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                     ({"max_model_len": 0}, "max_model_len"), ({"max_depth": 0}, "max_depth"),
                     ({"corpus_tokens": 2**31}, "corpus_tokens"),
                     ({"max_depth": 2**20, "max_model_len": 2**12}, "max_depth")):
        with pytest.raises(ValueError, match=name):
            SuffixGPUProposer(**{"num_speculative_tokens": 2, "max_model_len": MML, **kw})
    prop = SuffixGPUProposer(num_speculative_tokens=2, max_model_len=MML, corpus_tokens=64)
    state = prop.init_state()
    tok, n = pad([[1, 2]])
    with pytest.raises(TypeError, match="token_ids must be an integer array"):
        prop.propose_arrays(state, tok.astype(jnp.float32), n)
    with pytest.raises(ValueError, match="valid must be"):
        prop.propose_arrays(state, tok, n, jnp.ones((2,), jnp.bool_))
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        prop.propose_arrays(state, jnp.zeros((1, MML + 1), jnp.int32), n)
    with pytest.raises(TypeError, match="state must be a SuffixGPUState"):
        prop.propose_arrays(None, tok, n)
    with pytest.raises(TypeError, match="docs must be an integer array"):
        prop.ingest(state, tok.astype(jnp.float32), n)
    with pytest.raises(ValueError, match="docs must be"):
        prop.ingest(state, tok, jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="corpus_len"):
        init_corpus(0)
    with pytest.raises(ValueError, match="max_depth"):
        suffix_search(state, tok, n, jnp.ones((1,), jnp.bool_), k=1, max_depth=0,
                      max_model_len=MML, use_corpus=True)


# ---------------------------------------------------------------------- config and adapter


def test_config_suffix_backend():
    """None resolves to the device speculator unless a key only Arctic Inference reads is set
    off its default (then 'arctic', warning naming the key); bad values are named."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert SpeculativeConfig(method="suffix", num_speculative_tokens=8
                                 ).suffix_backend == "device"
        c = SpeculativeConfig(method="suffix", num_speculative_tokens=8,
                              suffix_decoding_max_cached_requests=0)
        assert c.suffix_backend == "device"
        assert SpeculativeConfig(method="ngram", num_speculative_tokens=2).suffix_backend is None
    for key, value in (("suffix_decoding_min_token_prob", 0.0),
                       ("suffix_decoding_max_spec_factor", 2.0),
                       ("suffix_decoding_max_cached_requests", 5)):
        with pytest.warns(UserWarning, match=f"resolves to 'arctic'.*{key}={value}"):
            assert SpeculativeConfig(method="suffix", **{key: value}).suffix_backend == "arctic"
        with pytest.warns(UserWarning, match=f"'device' does not read {key}"):
            SpeculativeConfig(method="suffix", suffix_backend="device", **{key: value})
    with pytest.warns(UserWarning, match="suffix_decoding_corpus_tokens=4096 has no effect"):
        SpeculativeConfig(method="suffix", suffix_backend="arctic", suffix_decoding_corpus_tokens=4096)
    c = SpeculativeConfig(method="suffix", suffix_decoding_corpus_tokens=0)
    assert c.suffix_decoding_max_cached_requests == 0
    with pytest.raises(ValueError, match=r"suffix_backend='gpu' is not allowed; allowed values: "
                                         r"\(None, 'device', 'arctic'\)"):
        SpeculativeConfig(method="suffix", suffix_backend="gpu")
    for bad in (-1, 2**31, 1.5):
        with pytest.raises(ValueError, match="suffix_decoding_corpus_tokens"):
            SpeculativeConfig(method="suffix", suffix_decoding_corpus_tokens=bad)


def test_make_proposer_builds_the_backend():
    from specjax import make_proposer

    p = make_proposer(SpeculativeConfig(method="suffix", num_speculative_tokens=3), max_model_len=MML)
    assert isinstance(p, SuffixGPUProposerAdapter) and p.feed.drafts_in == "history"
    assert p.device_drafter is p.impl and p.device_drafter.stateful     # the device loop's hook
    assert p.device_drafter_state is p.state
    off = make_proposer(SpeculativeConfig(method="suffix", num_speculative_tokens=3,
                                          suffix_decoding_max_cached_requests=0), max_model_len=MML)
    assert not off.impl.use_corpus


class Engine:
    """A host persistent batch driving an adapter: req id -> (prompt length, tokens)."""

    def __init__(self, adapter):
        self.adapter, self.reqs = adapter, {}

    def step(self, new: dict):
        ids = list(new)
        for r in ids:
            self.reqs[r][1].extend(new[r])
        ctx = [self.reqs[r][1] for r in ids]
        tok, n = pad(ctx, MML, fill=0)
        hist = TokenHistory(ids, np.asarray(tok), np.asarray(n),
                            np.array([self.reqs[r][0] for r in ids], np.int32),
                            [new[r] for r in ids])
        out = self.adapter.propose_from_history(hist)
        return {r: np.asarray(out.token_ids)[i, : int(out.num_drafts[i])].tolist()
                for i, r in enumerate(ids)}


def test_adapter_lifecycle_equals_oracle():
    """Steps of a persistent batch: drafts equal the oracle's; finished requests' documents
    (response + last 3 prompt tokens) join the corpus in sorted request-id order, including
    one that left the batch earlier; a later request then drafts from them."""
    cfg = SpeculativeConfig(method="suffix", num_speculative_tokens=3,
                            suffix_decoding_corpus_tokens=64)
    ad = SuffixGPUProposerAdapter(cfg, max_model_len=MML)
    eng, oracle = Engine(ad), O.Corpus(64)
    eng.reqs = {"b": [4, [9, 9, 1, 2, 3]], "a": [2, [5, 6]], "c": [3, [7, 7, 7]]}
    rng = np.random.default_rng(3)
    for step in range(6):
        batch = {r: rng.integers(0, 4, int(rng.integers(1, 3))).tolist()
                 for r in (("a", "b", "c") if step < 3 else ("a", "b"))}
        got = eng.step(batch)
        for r, drafts in got.items():
            want = O.propose(eng.reqs[r][1], k=3, max_depth=24, max_model_len=MML, corpus=oracle)
            assert drafts == want[0], (step, r)
        assert ad.last_match.source.shape == (len(batch),)
    ad.finish_requests(["c", "b", "a"])
    oracle.ingest([eng.reqs[r][1][max(eng.reqs[r][0] - 3, 0):] for r in ("a", "b", "c")])
    assert_corpus_equal(ad.state, oracle)
    assert ad._host == {} and ad._slots == {}
    eng.reqs["d"] = [1, [0]]
    tail = eng.reqs["b"][1][-4:]
    got = eng.step({"d": tail})
    want = O.propose(eng.reqs["d"][1], k=3, max_depth=24, max_model_len=MML, corpus=oracle)
    assert got["d"] == want[0] and want[2] == SOURCE_CORPUS
    # documents= overrides the host copy (tokens the proposer did not see)
    ad.finish_requests(["d"], documents={"d": (1, [0, 1, 2, 3, 4, 5])})
    oracle.ingest([[0, 1, 2, 3, 4, 5]])
    assert_corpus_equal(ad.state, oracle)
