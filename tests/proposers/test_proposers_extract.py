"""Extract-hidden-states proposer against a naive reference.

The reference runs the same cache-only model one request at a time on a fresh dense cache
(one block holding the request's whole sequence), feeding every token the request sent
through the proposer, at its own position: no block table, no slot mapping from the
batch, no padded rows.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.attention_metadata import CommonAttentionMetadata
from specjax.config import SpeculativeConfig
from specjax.models.extract_hidden_states import ExtractHiddenStates
from specjax.proposers.types import ProposerInputs
from specjax.proposers.extract_hidden_states import ExtractHiddenStatesProposer

try:
    from compile_check import assert_no_recompile
except ImportError:  # tests/ made a package
    from tests.compile_check import assert_no_recompile

H = 32
N_AUX = 3
V = 64
BS = 4
MAX_BLOCKS = 8
NUM_BLOCKS = 40
B_PAD = 4
T_PAD = 64
DENSE = 32

MODEL = ExtractHiddenStates(num_hidden_states=N_AUX, hidden_size=H)
CFG = SpeculativeConfig(method="extract_hidden_states", num_speculative_tokens=1)


@functools.lru_cache(maxsize=None)
def _dense_forward():
    return jax.jit(MODEL.forward)


def naive_cache(positions, aux):
    """One request's dense cache ``[DENSE, n_aux, H]`` after writing ``aux [n, n_aux, H]`` at
    ``positions`` (in order, so a later write of a position wins)."""
    n = len(positions)
    md = CommonAttentionMetadata.from_query_lens([n], [n], [[0]], block_size=DENSE,
                                                 num_tokens_pad=DENSE, max_query_len=DENSE)
    md = md.replace(slot_mapping=jnp.asarray(np.concatenate(
        [np.asarray(positions, np.int32), np.full(DENSE - n, -1, np.int32)])))
    rows = np.zeros((DENSE, N_AUX, H), np.float32)
    rows[:n] = aux
    (cache,) = _dense_forward()({}, jnp.asarray(rows), MODEL.init_kv_caches(1, DENSE), md)
    return np.asarray(cache)[0]


def _requests(rng, n, *, padded, chunked):
    reqs = []
    for _ in range(n):
        L = int(rng.integers(2, 20))
        reqs.append(dict(L=L, next=int(rng.integers(0, V)),
                         aux=rng.standard_normal((L, N_AUX, H)).astype(np.float32),
                         rej=int(rng.integers(0, 3)) if padded else 0,
                         split=int(rng.integers(1, L)) if chunked else 0, sent=[]))
    table = rng.permutation(NUM_BLOCKS)[: n * MAX_BLOCKS].reshape(n, MAX_BLOCKS)
    return reqs, table


def _inputs(reqs, table, lo_hi, with_rejected, rng):
    """ProposerInputs for each request's tokens [lo, hi) (+ rejected junk); records in
    ``req["sent"]`` the (position, aux row) pairs the proposer was given."""
    aux, qlens, seqlens, rej = [], [], [], []
    for r, (lo, hi) in zip(reqs, lo_hi):
        j = r["rej"] if with_rejected else 0
        rows = list(r["aux"][lo:hi]) + list(rng.standard_normal((j, N_AUX, H)).astype(np.float32))
        r["sent"] += list(zip(range(lo, hi + j), rows))
        aux += rows
        qlens.append(hi - lo + j)
        seqlens.append(hi + j)
        rej.append(j)
    n = len(reqs)
    md = CommonAttentionMetadata.from_query_lens(qlens, seqlens, table[:n], block_size=BS,
                                                 num_reqs_pad=B_PAD, num_tokens_pad=T_PAD,
                                                 max_query_len=32)
    # padding rows hold junk: slot -1 must keep it out of the cache
    a = rng.standard_normal((T_PAD, N_AUX, H)).astype(np.float32)
    a[: len(aux)] = np.stack(aux)
    padb = lambda x: jnp.asarray(np.concatenate([np.asarray(x, np.int32), np.zeros(B_PAD - n, np.int32)]))  # noqa: E731
    return ProposerInputs(
        target_token_ids=jnp.zeros(T_PAD, jnp.int32), target_positions=jnp.zeros(T_PAD, jnp.int32),
        target_hidden_states=None, aux_hidden_states=jnp.asarray(a),
        next_token_ids=padb([r["next"] for r in reqs]),
        token_indices_to_sample=None, num_rejected_tokens=padb(rej) if with_rejected else None,
        attn_metadata=md)


def _paged(state, table_row, n):
    pos = np.arange(n)
    slots = np.asarray(table_row)[pos // BS] * BS + pos % BS
    cache = np.asarray(state.kv_caches[0])
    return cache.reshape((-1, N_AUX, H))[slots]


@pytest.mark.smoke
@pytest.mark.parametrize("chunked, padded", [(False, True), (True, True), (True, False), (False, False)])
def test_propose_matches_naive_reference(chunked, padded):
    rng = np.random.default_rng([chunked, padded])
    prop = ExtractHiddenStatesProposer(CFG, MODEL, block_size=BS, kernel_backend="xla")
    n = 3
    reqs, table = _requests(rng, n, padded=padded, chunked=chunked)
    state = prop.init_state(NUM_BLOCKS)
    if chunked:
        _, state = prop.propose({}, state, _inputs(reqs, table, [(0, r["split"]) for r in reqs],
                                                   False, rng))
    out, state = prop.propose({}, state, _inputs(reqs, table, [(r["split"], r["L"]) for r in reqs],
                                                 padded, rng))
    got = np.asarray(out.token_ids)
    assert got.shape == (B_PAD, 1) and got.dtype == np.int32
    np.testing.assert_array_equal(got[:, 0], [r["next"] for r in reqs] + [-1] * (B_PAD - n))
    np.testing.assert_array_equal(out.num_drafts, [1] * n + [0] * (B_PAD - n))
    written = 0
    for i, r in enumerate(reqs):
        pos, rows = zip(*r["sent"])
        seq = max(pos) + 1
        want = naive_cache(pos, np.stack(rows))[:seq]
        np.testing.assert_array_equal(_paged(state, table[i], seq), want, err_msg=f"request {i}")
        written += seq
    # nothing else was written (padding tokens have slot -1)
    cache = np.asarray(state.kv_caches[0]).reshape(-1, N_AUX * H)
    assert int((np.abs(cache).sum(axis=1) > 0).sum()) == written


def test_prepare_next_token_ids_padded_variant():
    prop = ExtractHiddenStatesProposer(CFG, MODEL, block_size=BS, kernel_backend="xla")
    sampled = jnp.asarray([[5, -1], [-1, -1], [V, 3], [7, 8], [9, 9]], jnp.int32)
    discard = jnp.asarray([False, False, False, True, False])
    backup = jnp.asarray([1, 2, 3, 4, 6], jnp.int32)
    nxt, valid = prop.prepare_next_token_ids_padded(sampled, discard, backup, vocab_size=V,
                                                    num_reqs=jnp.asarray(4, jnp.int32))
    # only column 0 counts; a discarded row keeps count 1 but takes the backup token
    np.testing.assert_array_equal(nxt, [5, 2, 3, 4, 0])
    np.testing.assert_array_equal(valid, [1, 0, 0, 1, 0])
    nxt, valid = prop.prepare_next_token_ids_padded(sampled, discard, backup, vocab_size=V)
    np.testing.assert_array_equal(nxt, [5, 2, 3, 4, 9])
    np.testing.assert_array_equal(valid, [1, 0, 0, 1, 1])


def test_no_recompile_inside_a_bucket(caplog):
    rng = np.random.default_rng(5)
    prop = ExtractHiddenStatesProposer(CFG, MODEL, block_size=BS, kernel_backend="xla")
    state = prop.init_state(NUM_BLOCKS)

    def run(n):
        nonlocal state
        reqs, table = _requests(rng, n, padded=True, chunked=False)
        out, state = prop.propose({}, state, _inputs(reqs, table, [(0, r["L"]) for r in reqs], True, rng))
        return np.asarray(out.token_ids)

    assert_no_recompile(prop.propose, run, (2, 1, 4, 3), caplog)


@pytest.mark.parametrize("kwargs, match", [
    (dict(config=SpeculativeConfig(method="eagle", num_speculative_tokens=1)),
     "method 'extract_hidden_states'"),
    (dict(config=SpeculativeConfig(method="extract_hidden_states", num_speculative_tokens=1,
                                   disable_padded_drafter_batch=True)), "disable_padded_drafter_batch"),
    (dict(model=ExtractHiddenStates(0, H)), "eagle_aux_hidden_state_layer_ids"),
    (dict(model="cache"), "ExtractHiddenStates"),
    (dict(block_size=0), "block_size"),
    (dict(kernel_backend="cuda"), "backend"),
])
def test_construction_errors(kwargs, match):
    args = dict(config=CFG, model=MODEL, block_size=BS)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        ExtractHiddenStatesProposer(**args)


def test_k_must_be_one():
    with pytest.raises(ValueError, match="num_speculative_tokens must be 1"):
        SpeculativeConfig(method="extract_hidden_states", num_speculative_tokens=3)


def test_bad_aux_inputs():
    rng = np.random.default_rng(0)
    prop = ExtractHiddenStatesProposer(CFG, MODEL, block_size=BS)
    reqs, table = _requests(rng, 2, padded=False, chunked=False)
    inp = _inputs(reqs, table, [(0, r["L"]) for r in reqs], False, rng)
    with pytest.raises(ValueError, match="aux_hidden_states"):
        prop.propose({}, prop.init_state(NUM_BLOCKS), inp._replace(aux_hidden_states=None))
    with pytest.raises(ValueError, match=r"must be \[T, 3, 32\]"):
        prop.propose({}, prop.init_state(NUM_BLOCKS),
                     inp._replace(aux_hidden_states=inp.aux_hidden_states[:, :2]))
