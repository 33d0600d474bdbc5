"""DFlash proposer against a naive reference.

The reference runs the same Flax head one request at a time with a fresh dense cache (one
block holding the whole sequence): the context K/V of the request's whole accepted
context (positions 0..L-1, from its combined aux hidden states), then the query block
``[bonus, mask * k]`` at positions L..L+k, drafts from the mask slots. No paging, no
input-expansion kernel, no padded batch, no cache carried over from an earlier call.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.attention_metadata import CommonAttentionMetadata
from specjax.config import SpeculativeConfig
from specjax.models import registry, share_target_weights
from specjax.proposers.types import ProposerInputs
from specjax.proposers.dflash import DFlashProposer

GEO = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
           rms_norm_eps=1e-5)
V = 80
HT = 24               # target hidden size
BS = 4
MAX_BLOCKS = 10       # 40-token context bucket
MML = BS * MAX_BLOCKS - 2   # max_model_len two positions short of the table
NUM_BLOCKS = 48
B_PAD = 4
T_PAD = 96
DENSE = 64            # the reference's one-block cache (>= MML + 1 + k)


def _target(h, seed=0):
    rng = np.random.default_rng(seed)
    # small embeddings: the block's own tokens must not drown out the context, or the
    # drafts would hardly depend on the cache this test is about
    emb = (0.1 * rng.standard_normal((V, h))).astype(np.float32)
    head = (rng.standard_normal((V, h)) / np.sqrt(h)).astype(np.float32)
    return {"embed_tokens": {"embedding": jnp.asarray(emb)}, "lm_head": {"kernel": jnp.asarray(head.T)}}


HEADS = {
    # full vocabulary: the target's embedding and lm_head, mask token at the end
    "full": dict(GEO, num_hidden_layers=2, vocab_size=V, target_hidden_size=HT,
                 aux_hidden_state_layer_ids=[1, 3, 5], mask_token_id=V - 1, block_size=4),
    # reduced vocabulary: own lm_head over 40 ids mapped through d2t (z-lab dflash_config form)
    "reduced": dict(GEO, num_hidden_layers=1, vocab_size=V, draft_vocab_size=40, has_d2t=True,
                    has_lm_head=True, target_hidden_size=HT,
                    dflash_config=dict(target_layer_ids=[0, 2], mask_token_id=3)),
}


@functools.lru_cache(maxsize=None)
def head(name):
    cfg = registry.config_from_hf("dflash", HEADS[name])
    own = registry.init_params("dflash", cfg, 3)
    params = share_target_weights(own, _target(cfg.hidden_size), kind="dflash")
    return cfg, registry.make_model("dflash", cfg), params


@functools.lru_cache(maxsize=None)
def _reference(model, k, limit):
    """Per-request drafts with a fresh dense cache; ``aux [DENSE, n_aux, Ht]`` holds the
    request's context in its first ``L`` rows. Block positions ``>= limit`` (max_model_len,
    or a narrower block table's capacity) are neither stored nor attended to."""
    q = 1 + k
    mask = model.config.mask_token_id

    @jax.jit
    def run(params, aux, L, bonus):
        caches = model.init_kv_caches(1, DENSE)
        pos = jnp.arange(DENSE, dtype=jnp.int32)
        caches = model.precompute_and_store_context_kv(
            params, model.combine_hidden_states(params, aux), pos, jnp.where(pos < L, pos, -1), caches)
        bpos = L + jnp.arange(q, dtype=jnp.int32)
        ids = jnp.full((q,), mask, jnp.int32).at[0].set(bonus)
        i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
        md = CommonAttentionMetadata(
            query_start_loc=i32([0, q]), seq_lens=jnp.minimum(L + q, limit)[None].astype(jnp.int32),
            block_table=i32([[0]]), slot_mapping=jnp.where(bpos < limit, bpos, -1),
            num_reqs=i32(1), num_actual_tokens=i32(q), max_seq_len=jnp.minimum(L + q, limit).astype(jnp.int32),
            max_query_len=q, causal=False)
        hidden, _ = model.forward(params, ids, bpos, caches, md)
        return jnp.argmax(model.compute_logits(params, hidden[1:]), axis=-1)

    return run


def naive_drafts(model, params, aux, bonus, k, limit=MML):
    """Draft k tokens for one request whose accepted context (positions 0..L-1) has aux
    hidden states ``aux [L, n_aux, Ht]``."""
    L = aux.shape[0]
    dense = np.zeros((DENSE,) + aux.shape[1:], np.float32)
    dense[:L] = aux
    out = _reference(model, k, limit)(params, jnp.asarray(dense), jnp.int32(L), jnp.int32(bonus))
    return [int(t) for t in np.asarray(out)]


def _requests(cfg, rng, n_reqs, k, *, chunked, padded, lengths=None):
    """Requests with contexts; the proposer's target batch holds either the whole context
    (+ up to k rejected junk tokens in padded mode) or, when ``chunked``, a first call on a
    prefix and a second call on the rest."""
    reqs = []
    for i in range(n_reqs):
        L = int(rng.integers(2, 20)) if lengths is None else lengths[i]
        rej = int(rng.integers(0, min(k, MML - L) + 1)) if padded else 0
        reqs.append(dict(L=L, aux=rng.standard_normal((L, cfg.num_aux, HT)).astype(np.float32),
                         next=int(rng.integers(0, V)), rej=rej,
                         split=int(rng.integers(1, L)) if chunked else 0))
    table = rng.permutation(NUM_BLOCKS)[: n_reqs * MAX_BLOCKS].reshape(n_reqs, MAX_BLOCKS)
    return reqs, table


def _inputs(cfg, reqs, table, lo_hi, with_rejected, rng):
    """ProposerInputs for each request's tokens [lo, hi) (+ rejected junk)."""
    pos, aux, qlens, seqlens, rej = [], [], [], [], []
    for r, (lo, hi) in zip(reqs, lo_hi):
        j = r["rej"] if with_rejected else 0
        pos += list(range(lo, hi + j))
        aux += list(r["aux"][lo:hi]) + list(rng.standard_normal((j, cfg.num_aux, HT)).astype(np.float32))
        qlens.append(hi - lo + j)
        seqlens.append(hi + j)
        rej.append(j)
    n = len(reqs)
    t = sum(qlens)
    md = CommonAttentionMetadata.from_query_lens(qlens, seqlens, table[:n], block_size=BS,
                                                 num_reqs_pad=B_PAD, num_tokens_pad=T_PAD,
                                                 max_query_len=MML)
    padt = lambda a: np.concatenate([np.asarray(a), np.zeros((T_PAD - t,) + np.shape(a)[1:], np.asarray(a).dtype)])  # noqa: E731
    padb = lambda a: np.concatenate([np.asarray(a, np.int32), np.zeros(B_PAD - n, np.int32)])  # noqa: E731
    return ProposerInputs(
        target_token_ids=jnp.asarray(padt(rng.integers(0, V, t).astype(np.int32))),
        target_positions=jnp.asarray(padt(np.array(pos, np.int32))),
        target_hidden_states=None,
        aux_hidden_states=jnp.asarray(padt(np.stack(aux))),
        next_token_ids=jnp.asarray(padb([r["next"] for r in reqs])),
        token_indices_to_sample=None,
        num_rejected_tokens=jnp.asarray(padb(rej)) if with_rejected else None,
        attn_metadata=md)


def _proposer(model, k):
    return DFlashProposer(SpeculativeConfig(method="dflash", num_speculative_tokens=k), model,
                          block_size=BS, max_model_len=MML, kernel_backend="xla")


def _stale_state(prop, seed=0):
    """A state whose cache holds junk, as recycled blocks do: reading anything the step did
    not write changes the drafts."""
    state = prop.init_state(NUM_BLOCKS)
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(3 * rng.standard_normal(x.shape), x.dtype), state)


def _check(out, model, params, reqs, k, n, limit=MML):
    got = np.asarray(out.token_ids)
    assert got.shape == (B_PAD, k) and got.dtype == np.int32
    np.testing.assert_array_equal(out.num_drafts, [k] * n + [0] * (B_PAD - n))
    np.testing.assert_array_equal(got[n:], -1)
    for i, r in enumerate(reqs):
        want = naive_drafts(model, params, r["aux"][: r["L"]], r["next"], k, limit)
        np.testing.assert_array_equal(got[i], want, err_msg=f"request {i} (L={r['L']}, rej={r['rej']})")


@pytest.mark.smoke
@pytest.mark.parametrize("name", ["full", "reduced"])
@pytest.mark.parametrize("k, chunked, padded", [(3, False, True), (3, True, True), (1, False, False),
                                                (1, True, True), (3, True, False)])
def test_propose_matches_naive_reference(name, k, chunked, padded):
    rng = np.random.default_rng(hash((name, k, chunked, padded)) % 2**32)
    cfg, model, params = head(name)
    prop = _proposer(model, k)
    n = 3
    reqs, table = _requests(cfg, rng, n, k, chunked=chunked, padded=padded)
    state = _stale_state(prop)
    if chunked:   # first call on a prefix; its drafts are thrown away, its cache kept
        first = _inputs(cfg, reqs, table, [(0, r["split"]) for r in reqs], False, rng)
        _, state = prop.propose(params, state, first)
    inp = _inputs(cfg, reqs, table, [(r["split"], r["L"]) for r in reqs], padded, rng)
    out, state = prop.propose(params, state, inp)
    _check(out, model, params, reqs, k, n)


def test_requests_reaching_max_model_len():
    """Query blocks running past max_model_len (38: two positions short of the 40-token
    table): those positions are neither stored (40 and up would alias the table's last
    block) nor attended to (38 and 39 hold nothing valid), in this call and the next."""
    rng = np.random.default_rng(11)
    cfg, model, params = head("full")
    k = 3
    prop = _proposer(model, k)
    reqs, table = _requests(cfg, rng, 3, k, chunked=False, padded=False,
                            lengths=[MML - 1, MML - 2, 7])
    state = _stale_state(prop)
    # step 1: every request on its context but the last two tokens; step 2: those two
    # (+ a rejected token for request 1), blocks at 37..40, 36..39 and 7..10
    step1 = [dict(r, L=r["L"] - 2) for r in reqs]
    out, state = prop.propose(params, state, _inputs(cfg, step1, table, [(0, r["L"]) for r in step1],
                                                     False, rng))
    _check(out, model, params, step1, k, 3)
    step2 = [dict(r, rej=i % 2) for i, r in enumerate(reqs)]
    out, state = prop.propose(params, state, _inputs(cfg, step2, table,
                                                     [(r["L"] - 2, r["L"]) for r in step2], True, rng))
    _check(out, model, params, step2, k, 3)


def test_block_table_narrower_than_the_block():
    """A block table (context bucket) of 9 blocks, 36 positions: block positions 36 and up
    are dropped as if past max_model_len instead of aliasing onto the last block."""
    rng = np.random.default_rng(12)
    cfg, model, params = head("full")
    k = 3
    prop = _proposer(model, k)
    reqs, table = _requests(cfg, rng, 2, k, chunked=False, padded=False, lengths=[34, 9])
    reqs = [dict(r, rej=j) for r, j in zip(reqs, (1, 2))]   # request 0: block at 34..37
    table = table[:, :9]
    out, _ = prop.propose(params, _stale_state(prop),
                          _inputs(cfg, reqs, table, [(0, r["L"]) for r in reqs], True, rng))
    _check(out, model, params, reqs, k, 2, limit=36)


def test_no_recompile_inside_a_bucket():
    rng = np.random.default_rng(5)
    cfg, model, params = head("full")
    prop = _proposer(model, 3)
    state = _stale_state(prop)
    sizes = []
    for n in (1, 3, 2, 4, 1):
        reqs, table = _requests(cfg, rng, n, 3, chunked=False, padded=True)
        _, state = prop.propose(params, state, _inputs(cfg, reqs, table,
                                                       [(0, r["L"]) for r in reqs], True, rng))
        sizes.append(prop.propose._cache_size())
    assert sizes == sizes[:1] * len(sizes), sizes


def test_needs_aux_hidden_states():
    rng = np.random.default_rng(2)
    cfg, model, params = head("full")
    prop = _proposer(model, 1)
    reqs, table = _requests(cfg, rng, 1, 1, chunked=False, padded=False)
    inp = _inputs(cfg, reqs, table, [(0, r["L"]) for r in reqs], False, rng)
    with pytest.raises(ValueError, match="aux_hidden_states"):
        prop.propose(params, prop.init_state(NUM_BLOCKS), inp._replace(aux_hidden_states=None))
    assert prop.needs_aux_hidden_states and not prop.needs_hidden_states
    assert prop.mask_token_id == V - 1 and prop.num_speculative_tokens == 1
    assert hash(prop) == hash(_proposer(model, 1))


def test_padded_prep_helpers():
    """vLLM's base-proposer padded-mode helpers are available on the DFlash proposer."""
    _, model, _ = head("full")
    prop = _proposer(model, 2)
    sampled = jnp.asarray([[1, 9, -1], [3, 4, 7], [0, 0, 0], [0, 0, 0]], jnp.int32)
    nxt, valid = prop.prepare_next_token_ids_padded(sampled, jnp.zeros(B_PAD, bool),
                                                    jnp.asarray([5, 6, 0, 0]), vocab_size=V,
                                                    num_reqs=jnp.int32(2))
    np.testing.assert_array_equal(nxt[:2], [9, 7])
    np.testing.assert_array_equal(valid[:2], [2, 3])


def _dflash_model(**changes):
    cfg = registry.config_from_hf("dflash", HEADS["full"]).replace(**changes)
    return registry.make_model("dflash", cfg)


@pytest.mark.parametrize("kwargs, match", [
    (dict(config=SpeculativeConfig(method="eagle", num_speculative_tokens=2)), "method 'dflash'"),
    (dict(config="dflash"), "SpeculativeConfig"),
    (dict(model="not a head"), "DFlashHead"),
    (dict(model=_dflash_model(mask_token_id=-1)), "mask_token_id"),
    (dict(model=_dflash_model(mask_token_id=V)), "mask_token_id"),
    (dict(block_size=0), "block_size"),
    (dict(max_model_len=-1), "max_model_len"),
    (dict(max_model_len=2**31), "max_model_len"),
    (dict(kernel_backend="cuda"), "backend"),
])
def test_construction_errors(kwargs, match):
    _, model, _ = head("full")
    args = dict(config=SpeculativeConfig(method="dflash", num_speculative_tokens=2), model=model,
                block_size=BS, max_model_len=MML)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        DFlashProposer(**args)


def test_config_forces_parallel_drafting():
    assert SpeculativeConfig(method="dflash", num_speculative_tokens=2).parallel_drafting
