"""Tree verification in the decoding loop (``specjax.engine``).

A stub tree proposer drafts around the target's true greedy continuation (looked up among
the plain greedy outputs from the context the loop's inputs give it): along one branch of
the tree, chosen per step, the first ``a`` levels hold the true tokens, every other node a
wrong one, with ``a`` a function of the root's position. So every tree-verification step
must accept exactly what a host-side oracle predicts, and the output must equal plain
greedy decoding (lossless) whatever is accepted, whoever joins or leaves the batch, and
near ``max_tokens`` / ``max_model_len``. A chain tree through the tree path gives exactly
chain verification's tokens and metrics. The EAGLE tree proposer in the loop is lossless.

Random sampling (temperature > 0): a table stub drafts, from the root token, the target's
likeliest tokens of the first verification (its children) and of the level below; the
first two verified tokens are distributed as the target's (chi-square against a dense
forward), seeded runs are reproducible and greedy requests in the batch stay greedy.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.config import SpeculativeConfig
from specjax.engine import Engine, LoopOptions, SamplingParams
from specjax.proposers import DraftOutput, ModelProposer
from specjax.proposers.common import PaddedBatchHelpers
from specjax.runtime.tree import compact_tree_kv, tree_chain_inputs
from specjax.token_tree import TokenTree

from scipy import stats

try:
    from test_engine import (BS, METHODS, MML, N_SAMPLES, PARAMS_A, PARAMS_B, PROMPTS_A,
                             PROMPTS_B, SAMPLE_PROMPT, V, _chi2_first_verified, _target_probs,
                             baseline, build, eos_b, fixed,  # noqa: F401 (autouse)
                             target)
except ImportError:  # tests/ made a package
    from tests.test_engine import (BS, METHODS, MML, N_SAMPLES, PARAMS_A, PARAMS_B,
                                   PROMPTS_A, PROMPTS_B, SAMPLE_PROMPT, V, _chi2_first_verified,
                                   _target_probs, baseline, build, eos_b,  # noqa: F401
                                   fixed, target)


# --- the stub tree proposer -----------------------------------------------------------


def accept_depth(root_pos, depth):
    """Levels the stub drafts right for the verification whose root is at ``root_pos``."""
    return (root_pos * 7 + 3) % (depth + 1)


def branch(root_pos, level, tree: TokenTree):
    """Child rank of the true branch at ``level`` (1-based)."""
    return (root_pos + level) % tree.children_per_level[level - 1]


@dataclasses.dataclass(frozen=True)
class TreeStub(PaddedBatchHelpers):
    """Device tree proposer that knows the answers: ``params`` holds the plain greedy
    sequences (prompt + output) of every workload; the state keeps each running request's
    tokens, written from the chain-shaped inputs the loop hands over (the prompt at
    prefill, then the root and accepted tokens of each verification, and the new token),
    so that the request's context is looked up among the sequences and its true
    continuation ``c_1..c_D`` read off. (Wrong tokens or positions in the inputs find no
    sequence and draft garbage.) Node ``j`` at level ``l`` with child rank ``r`` drafts
    ``c_l`` if it is on the true branch and ``l <= a``, else ``(c_l + 1 + r) % V`` (never
    the target's token there; siblings distinct)."""

    token_tree: TokenTree
    vocab: int
    block_size: int = BS
    max_model_len: int = MML

    needs_hidden_states = False
    needs_aux_hidden_states = False
    kernel_backend = "xla"        # PaddedBatchHelpers (every in-step proposer has them)

    def init_state(self, num_blocks, dtype=jnp.float32):
        """``[num_blocks, max_model_len]`` token rows, keyed by a request's first block."""
        return jnp.full((num_blocks, self.max_model_len), -1, jnp.int32)

    def propose(self, seqs, hist, inputs):
        tree, w = self.token_tree, self.max_model_len
        cad = inputs.attn_metadata
        qsl = cad.query_start_loc
        b, t_pad = qsl.shape[0] - 1, inputs.target_token_ids.shape[0]
        real = jnp.arange(b) < cad.num_reqs
        nrej = 0 if inputs.num_rejected_tokens is None else inputs.num_rejected_tokens
        end = qsl[1:] - nrej                                   # past the last kept token
        first_block = cad.block_table[:, 0]
        t = jnp.arange(t_pad)
        r_t = jnp.minimum(jnp.sum(qsl[None, 1:] <= t[:, None], axis=1), b - 1)
        keep = (t < end[r_t]) & real[r_t]
        hist = hist.at[jnp.where(keep, first_block[r_t], hist.shape[0]),
                       inputs.target_positions].set(inputs.target_token_ids, mode="drop")
        root = inputs.target_positions[jnp.clip(end - 1, 0, t_pad - 1)] + 1   # next root
        hist = hist.at[jnp.where(real, first_block, hist.shape[0]), root].set(
            inputs.next_token_ids, mode="drop")
        ctx = hist[first_block]                                # [B, W]
        cols = jnp.arange(w)
        same = (seqs[None] == ctx[:, None]) | (cols[None, None, :] > root[:, None, None])
        hit = same.all(-1)                                     # [B, R]
        row = jnp.argmax(hit, axis=1)
        lvl = jnp.arange(1, tree.depth + 1)
        c = seqs[row[:, None], jnp.clip(root[:, None] + lvl[None, :], 0, w - 1)]
        c = jnp.where(hit.any(1)[:, None], jnp.maximum(c, 0), 0)   # [B, depth]
        a = accept_depth(root, tree.depth)
        on_path, toks = [], []
        for j, node in enumerate(tree.choices):
            lv, rank, par = len(node), node[-1], tree.parents[j]
            on = (rank == branch(root, lv, tree)) & (True if par < 0 else on_path[par])
            on_path.append(on)
            toks.append(jnp.where(on & (lv <= a), c[:, lv - 1], (c[:, lv - 1] + 1 + rank) % self.vocab))
        tok = jnp.where(real[:, None], jnp.stack(toks, 1), -1).astype(jnp.int32)
        return DraftOutput(tok, jnp.where(real, tree.num_nodes, 0).astype(jnp.int32)), hist


@functools.lru_cache(maxsize=None)
def known_sequences():
    """``[R, MML]``: prompt + plain greedy output of every request of workloads A and B."""
    rows = []
    for which, prompts in (("A", PROMPTS_A), ("B", PROMPTS_B)):
        for p, o in zip(prompts, baseline(which).token_ids):
            rows.append((list(p) + o + [-1] * MML)[:MML])
    return jnp.asarray(np.array(rows, np.int32))


class TreeStubProposer(ModelProposer):
    def __init__(self, choices):
        tree = TokenTree.from_choices(choices)
        cfg = SpeculativeConfig(method="eagle", num_speculative_tokens=tree.num_nodes,
                                speculative_token_tree=str(list(tree.choices)))
        super().__init__(cfg, TreeStub(tree, V), known_sequences(), vocab_size=V)

    def init_state(self, num_blocks, dtype=None):
        return self.impl.init_state(num_blocks)


def full_tree(children):
    levels, prev = [], [()]
    for c in children:
        prev = [p + (i,) for p in prev for i in range(c)]
        levels += prev
    return levels


@functools.lru_cache(maxsize=None)
def stub(children):
    return TreeStubProposer(full_tree(children))


# --- the metrics oracle ---------------------------------------------------------------


def oracle_stats(tree: TokenTree, prompts, params, base_tokens):
    """Replay the loop for requests that all start together (one prefill step, then
    tree-verification steps): per request (drafts counted, accepted) and per-position
    acceptance counts."""
    index = {c: i for i, c in enumerate(tree.choices)}
    per_req, per_pos = [], [0] * tree.depth
    for prompt, sp, toks in zip(prompts, params, base_tokens):
        n_out, drafted, accepted = 1, 0, 0          # the prefill step emits one token
        while n_out < len(toks):
            num_tokens = len(prompt) + n_out
            room = min(MML - num_tokens, sp.max_tokens - n_out) - 1
            lv = min(max(room, 0), tree.depth)
            n = min(tree.cu_level_sizes[lv - 1] if lv else 0, MML - num_tokens)
            p = num_tokens - 1
            acc, node = 0, ()
            for lvl in range(1, accept_depth(p, tree.depth) + 1):
                node = node + (branch(p, lvl, tree),)
                if index[node] >= n:
                    break
                acc += 1
            if n:
                drafted += tree.depths[n - 1]
                accepted += acc
                for q in range(acc):
                    per_pos[q] += 1
            n_out += acc + 1
        per_req.append((drafted, accepted))
    return per_req, per_pos


def engine(prop, max_num_seqs=4, **loop):
    """An engine on ``FIXED`` with these ``LoopOptions`` fields changed."""
    return Engine(target(), prop, max_num_seqs=max_num_seqs, **fixed(**loop))


# --- tests ----------------------------------------------------------------------------

# wide (15 nodes: levels and partial levels cut near the end) and deep
TREES = [(3, 2, 1), (2, 1, 1, 1, 1, 1)]


@pytest.mark.parametrize("children", TREES)
def test_tree_decoding_is_lossless_and_accepts_what_the_oracle_says(children):
    prop = stub(children)
    tree = prop.impl.token_tree
    assert not tree.is_chain and tree.num_nodes + 1 <= 16
    eng = engine(prop)
    assert eng.tree == tree and eng.k == tree.num_nodes
    base = baseline("A")
    out = eng.generate(PROMPTS_A, PARAMS_A)
    assert out.token_ids == base.token_ids
    assert [o.finish_reason for o in out.outputs] == [o.finish_reason for o in base.outputs]
    per_req, per_pos = oracle_stats(tree, PROMPTS_A, PARAMS_A, base.token_ids)
    assert [(o.num_draft_tokens, o.num_accepted_tokens) for o in out.outputs] == per_req
    s = out.spec_stats
    assert s.num_spec_tokens == tree.depth and s.num_accepted_tokens_per_pos == per_pos
    assert s.num_draft_tokens == sum(d for d, _ in per_req)
    assert s.num_accepted_tokens == sum(a for _, a in per_req) > 0
    assert out.num_steps < base.num_steps
    # requests join and leave (3 rows for 7 prompts), EOS ends some early
    eng_b = engine(prop, max_num_seqs=3)
    out_b = eng_b.generate(PROMPTS_B, PARAMS_B, eos_token_id=eos_b())
    base_b = baseline("B")
    assert out_b.token_ids == base_b.token_ids
    assert [o.finish_reason for o in out_b.outputs] == [o.finish_reason for o in base_b.outputs]
    assert sum(o.num_accepted_tokens for o in out_b.outputs) == out_b.spec_stats.num_accepted_tokens > 0
    assert len(eng_b.scheduler.free_blocks) == eng_b.num_blocks - 1     # blocks came back


@pytest.mark.parametrize("method", [m for m in ("eagle3",) if m in METHODS])
def test_chain_tree_through_the_tree_path_equals_chain_verification(method):
    """EAGLE-3 (hidden and aux hidden states gathered for the drafter) with its chain
    tree forced through tree verification: same tokens and same metrics as chain mode."""
    prop = build(method, 3)
    chain = engine(prop)
    assert chain.tree is None
    forced = engine(prop, tree_verification=True)
    assert forced.tree == TokenTree.chain(3)
    a, b = chain.generate(PROMPTS_A, PARAMS_A), forced.generate(PROMPTS_A, PARAMS_A)
    assert a.token_ids == b.token_ids == baseline("A").token_ids
    assert a.spec_stats == b.spec_stats and a.num_steps == b.num_steps
    assert [o[3:] for o in a.outputs] == [o[3:] for o in b.outputs]


def test_bad_configurations():
    prop = stub(TREES[0])
    tree = prop.impl.token_tree
    synth = ModelProposer(dataclasses.replace(
        prop.config, rejection_sample_method="synthetic",
        synthetic_acceptance_rates=tuple(0.5 ** i for i in range(1, tree.num_nodes + 1))),
        prop.impl, prop.params, vocab_size=V)
    with pytest.raises(ValueError, match="synthetic.*not supported with tree"):
        engine(synth)
    for p in (None, build("ngram", 2)):
        with pytest.raises(ValueError, match="needs a proposer with a token tree"):
            engine(p, tree_verification=True)
    tree = prop.impl.token_tree
    bad = ModelProposer(SpeculativeConfig(method="eagle", num_speculative_tokens=tree.num_nodes + 1),
                        prop.impl, prop.params, vocab_size=V)
    wide = dict(query_buckets=(32,))          # k + 1 = 17 tokens per request must fit
    with pytest.raises(ValueError, match="must match"):
        engine(bad, **wide)
    assert engine(bad, tree_verification=False, **wide).tree is None   # chain verification asked


# --- the device pieces against NumPy ----------------------------------------------------


def test_tree_chain_inputs_and_kv_compaction_match_numpy():
    tree = TokenTree.from_choices(full_tree((3, 2)))          # 9 nodes, depth 2
    n, depth, bs = tree.num_nodes, tree.depth, 4
    rng = np.random.default_rng(0)
    b_pad, q_pad, c = 4, 12, 6
    nodes = [n, 0, 5]                                         # full, root only, a prefix
    q = np.array([1 + x for x in nodes])
    p = np.array([5, 9, 14])
    seq = p + q
    table = np.zeros((b_pad, c), np.int32)
    table[:3] = rng.permutation(np.arange(1, 40))[: 3 * c].reshape(3, c)
    qsl = np.zeros(b_pad + 1, np.int32)
    qsl[1:4] = np.cumsum(q)
    qsl[4:] = qsl[3]
    from specjax.attention_metadata import CommonAttentionMetadata

    cad = CommonAttentionMetadata(
        jnp.asarray(qsl), jnp.asarray(np.append(seq, 0), jnp.int32), jnp.asarray(table),
        jnp.full((b_pad * q_pad,), -1, jnp.int32), jnp.int32(3), jnp.int32(int(q.sum())),
        jnp.int32(int(seq.max())), max_query_len=q_pad)
    ids = jnp.asarray(rng.integers(0, 50, b_pad * q_pad), jnp.int32)
    acc = np.full((b_pad, depth), -1, np.int32)
    m = np.zeros(b_pad, np.int32)
    # (1,), (1,0): p+2 -> p+1 and p+6 -> p+2, a destination that is also a source
    acc[0], m[0] = [1, tree.choices.index((1, 0))], 2
    acc[2], m[2] = [0, 3], 2                                    # (0,) stays; (0,0) p+4 -> p+2
    slot = lambda r, pos: table[r, pos // bs] * bs + pos % bs  # noqa: E731
    for padded in (True, False):
        tok, pos, src, md, tis, nrej = jax.jit(functools.partial(
            tree_chain_inputs, tree=tree, block_size=bs, padded=padded))(ids, cad, acc, m)
        d = [depth, 0, 2]                                     # deepest level present
        length = [1 + (d[r] if padded else m[r]) for r in range(3)]
        want_qsl = np.concatenate([[0], np.cumsum(length), [sum(length)]])
        np.testing.assert_array_equal(md.query_start_loc, want_qsl)
        np.testing.assert_array_equal(md.seq_lens, np.append(p + length, 0))
        assert int(md.num_actual_tokens) == sum(length) and md.tree_mask is None and md.causal
        for r in range(3):
            for i in range(length[r]):
                t = want_qsl[r] + i
                off = 0 if i == 0 else (1 + acc[r, i - 1] if i <= m[r] else i)
                assert src[t] == qsl[r] + off and tok[t] == ids[qsl[r] + off]
                assert pos[t] == p[r] + i and md.slot_mapping[t] == slot(r, p[r] + i)
        assert (np.asarray(md.slot_mapping)[sum(length):] == -1).all()
        if padded:
            np.testing.assert_array_equal(tis, list(want_qsl[:3] + m[:3]) + [0])
            np.testing.assert_array_equal(nrej, [d[r] - m[r] for r in range(3)] + [0])
        else:
            assert tis is None and nrej is None

    # KV: node a_i's entry (logical p + 1 + a_i) lands at p + i, all leaves; nothing else moves
    cache = jnp.asarray(rng.normal(size=(40, bs, 2, 3)), jnp.float32)
    kv = [(cache, cache + 100.0)]
    real = jnp.arange(b_pad) < 3
    got = jax.jit(functools.partial(compact_tree_kv, block_size=bs))(
        kv, jnp.asarray(table), jnp.asarray(np.append(p, 0), jnp.int32), acc, m, real)
    for leaf_in, leaf_out in zip(jax.tree.leaves(kv), jax.tree.leaves(got)):
        want = np.asarray(leaf_in).reshape(40 * bs, 2, 3).copy()
        src_vals = want.copy()
        for r in range(3):
            for i in range(1, m[r] + 1):
                want[slot(r, p[r] + i)] = src_vals[slot(r, p[r] + 1 + acc[r, i - 1])]
        np.testing.assert_array_equal(np.asarray(leaf_out).reshape(40 * bs, 2, 3), want)


def _tree_eagle(method, tree):
    """``build`` with a branching tree, or a skip while EAGLE refuses trees."""
    try:
        return build(method, TokenTree.from_choices(tree).num_nodes, speculative_token_tree=tree)
    except ValueError as e:
        if "not implemented" in str(e):
            pytest.skip(f"EAGLE tree drafting not available yet: {e}")
        raise


@pytest.mark.parametrize("method", [m for m in ("eagle3",) if m in METHODS])
def test_real_tree_eagle_proposer_is_lossless(method):
    """The EAGLE-3 tree proposer (random head) in the loop: plain greedy's tokens, whoever
    joins or leaves. (Skipped where EAGLE refuses branching trees.)"""
    prop = _tree_eagle(method, "[(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (1, 0, 0)]")
    eng = engine(prop)
    assert eng.tree is not None and eng.tree.num_nodes == 6
    out = eng.generate(PROMPTS_A, PARAMS_A)
    assert out.token_ids == baseline("A").token_ids
    s = out.spec_stats
    assert s.num_spec_tokens == 3 and s.num_drafts > 0 and s.num_draft_tokens <= 3 * s.num_drafts
    out_b = engine(prop, max_num_seqs=3).generate(PROMPTS_B, PARAMS_B, eos_token_id=eos_b())
    assert out_b.token_ids == baseline("B").token_ids


# --- random sampling (temperature > 0) ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TableStub(PaddedBatchHelpers):
    """Device tree proposer drafting ``params[root token]`` (``[V, N]``, a lookup table
    of the token the tree will be verified on)."""

    token_tree: TokenTree
    needs_hidden_states = False
    needs_aux_hidden_states = False
    kernel_backend = "xla"        # PaddedBatchHelpers (every in-step proposer has them)

    def init_state(self, num_blocks, dtype=jnp.float32):
        return jnp.zeros((1,), jnp.int32)

    def propose(self, table, state, inputs):
        b = inputs.next_token_ids.shape[0]
        real = jnp.arange(b) < inputs.attn_metadata.num_reqs
        tok = table[jnp.clip(inputs.next_token_ids, 0, table.shape[0] - 1)]
        tok = jnp.where(real[:, None], tok, -1).astype(jnp.int32)
        n = self.token_tree.num_nodes
        return DraftOutput(tok, jnp.where(real, n, 0).astype(jnp.int32)), state


SAMPLE_TREE = TokenTree.from_choices(full_tree((3, 2)))     # (0,) (1,) (2,) (0,0) ... (2,1)


@functools.lru_cache(maxsize=None)
def table_stub():
    """Root token ``t``: the root's children draft the 3 likeliest tokens after
    ``SAMPLE_PROMPT + [t]``, child ``(i, r)`` the ``r``-th likeliest after that plus
    child ``i``'s token (so the first verification accepts often, at both levels)."""
    tgt, tree = target(4.0), SAMPLE_TREE
    p1 = _target_probs(tgt, [SAMPLE_PROMPT + [t] for t in range(V)])       # [V, V]
    top1 = np.argsort(-p1, axis=1)[:, :3]
    p2 = _target_probs(tgt, [SAMPLE_PROMPT + [t, int(d)] for t in range(V) for d in top1[t]])
    top2 = np.argsort(-p2, axis=1)[:, :2].reshape(V, 3, 2)
    table = np.zeros((V, tree.num_nodes), np.int32)
    for j, node in enumerate(tree.choices):
        table[:, j] = top1[:, node[0]] if len(node) == 1 else top2[:, node[0], node[1]]
    cfg = SpeculativeConfig(method="eagle", num_speculative_tokens=tree.num_nodes,
                            speculative_token_tree=str(list(tree.choices)))
    return ModelProposer(cfg, TableStub(tree), jnp.asarray(table), vocab_size=V)


SAMPLE_KW = dict(max_model_len=16, block_size=BS,
                 options=LoopOptions(query_buckets=(16,), context_buckets=(2,)))


def _chi2_second_verified(result, tgt):
    """Tokens 1 and 2 of each request (both from the first tree verification when token 1
    is accepted) jointly against ``sum_r p(t1 | prompt, t0_r) p(t2 | prompt, t0_r, t1)``."""
    t0, t1, t2 = (np.array([o.token_ids[i] for o in result.outputs]) for i in range(3))
    uniq = np.unique(t0)
    p1 = _target_probs(tgt, [SAMPLE_PROMPT + [int(t)] for t in uniq])                  # [U, V]
    p2 = _target_probs(tgt, [SAMPLE_PROMPT + [int(t), a] for t in uniq for a in range(V)])
    joint = p1[:, :, None] * p2.reshape(len(uniq), V, V)                               # [U, V, V]
    expected = joint[np.searchsorted(uniq, t0)].sum(0).ravel()
    observed = np.bincount(t1 * V + t2, minlength=V * V).astype(np.float64)
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    return stats.chisquare(obs, exp * (obs.sum() / exp.sum())).pvalue


def test_random_tree_sampling_matches_target_distribution():
    """1000 seeded requests at temperature 1 (max_tokens=4: the prefill emits token 0, one
    tree verification of both levels emits token 1 and, when it is accepted, token 2):
    tokens 1 and (1, 2) are distributed as the target's (chi-square, alpha 1e-3), and the
    drafts (the target's likeliest tokens) are accepted often, at both levels."""
    tgt, prop = target(4.0), table_stub()
    # every request in one batch: one prefill step, then tree-verification steps only
    eng = Engine(tgt, prop, **dict(SAMPLE_KW, max_num_seqs=N_SAMPLES, options=dataclasses.replace(
        SAMPLE_KW["options"], batch_buckets=(N_SAMPLES,), max_num_batched_tokens=16 * N_SAMPLES)))
    assert eng.tree == SAMPLE_TREE
    sps = [SamplingParams(max_tokens=4, temperature=1.0, seed=i) for i in range(N_SAMPLES)]
    out = eng.generate([SAMPLE_PROMPT] * N_SAMPLES, sps)
    assert all(len(o.token_ids) == 4 for o in out.outputs)
    s = out.spec_stats
    assert s.num_spec_tokens == 2 and s.num_drafts >= N_SAMPLES
    assert s.num_draft_tokens >= 2 * N_SAMPLES       # the first verification: both levels
    first = s.num_accepted_tokens_per_pos[0] / s.num_drafts
    assert 0.3 < first < 1.0 and s.num_accepted_tokens_per_pos[1] > 0.1 * s.num_drafts
    assert _chi2_first_verified(out, tgt) > 1e-3
    assert _chi2_second_verified(out, tgt) > 1e-3


def test_random_tree_sampling_is_reproducible_and_greedy_rows_stay_greedy():
    tgt, prop = target(4.0), table_stub()
    prompts = [SAMPLE_PROMPT, [3, 2], [9, 9, 1], SAMPLE_PROMPT]
    sps = [SamplingParams(max_tokens=8, temperature=0.8, seed=5), SamplingParams(max_tokens=8),
           SamplingParams(max_tokens=8, temperature=1.0, top_k=5, top_p=0.9, seed=7),
           SamplingParams(max_tokens=8, temperature=1.2, seed=9)]
    a = Engine(tgt, prop, **SAMPLE_KW).generate(prompts, sps)
    b = Engine(tgt, prop, **SAMPLE_KW).generate(prompts, sps)
    assert a.token_ids == b.token_ids and a.spec_stats == b.spec_stats
    assert all(len(t) == 8 and all(0 <= x < V for x in t) for t in a.token_ids)
    assert a.spec_stats.num_accepted_tokens > 0
    plain = Engine(tgt, None, **SAMPLE_KW).generate([prompts[1]], [sps[1]])
    assert a.token_ids[1] == plain.token_ids[0]
    other = Engine(tgt, prop, **SAMPLE_KW).generate(
        prompts, [dataclasses.replace(sp, seed=sp.seed + 1) if sp.seed is not None else sp
                  for sp in sps])
    assert other.token_ids != a.token_ids and other.token_ids[1] == a.token_ids[1]
