"""EAGLE / EAGLE-3 parallel drafting (vLLM's P-EAGLE) against a naive reference.

The reference is written from the semantics, not from the kernels: per request, one dense
forward of the same Flax head (a fresh one-block cache, a Python loop over requests, no
paging, no slot-mapping kernels, no padded batch) over

    ids     = [accepted tokens 1..L-1 (shifted left by one), bonus token, k-1 mask tokens]
    hidden  = [target hidden of tokens 0..L-1 (EAGLE-3: after combine_hidden_states),
               the mask hidden state for each mask slot]
    positions 0 .. L+k-2, full causal attention,

and the greedy drafts at the bonus and mask slots (rows L-1 .. L+k-2). The mask hidden
state is ``mask_hidden`` (EAGLE-1) or ``fc(mask_hidden)`` (EAGLE-3, computed here in
NumPy), zeros without one. Earlier context (a chunked first call) is recomputed from
scratch, as in test_proposers_eagle.py.

``max_model_len`` (vLLM's ``compute_new_slot_mapping``): a slot at position
``>= max_model_len`` gets slot -1, so its K/V is never stored, and the block table (its
width is ``max_model_len / block_size`` blocks here) cannot address it: the reference's
dense cache is one block of ``max_model_len`` positions and drops the K/V of those
positions the same way (every query still sees every stored key at or before its own
position).
"""

import dataclasses
import functools
import json
import logging
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import make_proposer
from specjax.attention_metadata import CommonAttentionMetadata
from specjax.config import SpeculativeConfig
from specjax.converters import CheckpointError, convert, load_pretrained, normalize, read_checkpoint
from specjax.converters.formats import parallel_drafting_token_id
from specjax.models import registry
from specjax.proposers.common import ProposeBucket
from specjax.proposers.eagle import EagleProposer

try:
    from compile_check import assert_no_recompile
except ImportError:  # tests/ made a package
    from tests.compile_check import assert_no_recompile

from converter_cases import CASES, H as CK_H, write_layout
from test_proposers_draft_model import paged_kv  # its BS is this module's BS (4)
from test_proposers_eagle import _inputs as _eagle_inputs
from test_proposers_eagle import head  # the same tiny EAGLE / EAGLE-3 heads (HT = 24)

GEO = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
           rms_norm_eps=1e-5)
V = 80
HT = 24               # EAGLE-3 target hidden size (3 aux states -> fc input 72)
BS = 4
MAX_BLOCKS = 8
MML = BS * MAX_BLOCKS  # 32: the block table covers exactly max_model_len
NUM_BLOCKS = 40
B_PAD = 4
T_PAD = 64
DENSE_T = 40          # the reference's token padding (>= L + k - 1)
PARD = 7              # the parallel-drafting (mask) token id


def _with_mask(method, params, mask):
    """``params`` plus a random ``mask_hidden`` (flat, or shaped like the checkpoints)."""
    if mask is None:
        return params
    width = 3 * HT if method == "eagle3" else GEO["hidden_size"]
    rng = np.random.default_rng(99)
    m = rng.standard_normal(width).astype(np.float32)
    shape = {"flat": (width,), "ckpt": (1, 1, width)}[mask]
    return dict(params, mask_hidden=jnp.asarray(m.reshape(shape)))


def mask_state(method, model, params):
    """The mask slots' hidden input, from the semantics (NumPy)."""
    if "mask_hidden" not in params:
        return np.zeros(model.config.hidden_size, np.float32)
    m = np.asarray(params["mask_hidden"], np.float32).reshape(-1)
    if method == "eagle3":   # fc has no bias: g = m @ W ([in, out] kernel)
        return m @ np.asarray(params["fc"]["kernel"], np.float32)
    return m


# -- the reference --------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _dense_forward(model):
    return jax.jit(model.forward)


def naive_parallel(method, model, params, ctx_ids, ctx_hidden, next_tok, k, pard=PARD):
    """k drafts of one request whose accepted context (positions 0..L-1) is ``ctx_ids``,
    and per layer the K/V of the positions the drafter stored (< max_model_len)."""
    L = len(ctx_ids)
    n = L + k - 1
    ids = [int(t) for t in ctx_ids[1:]] + [int(next_tok)] + [pard] * (k - 1)
    if method == "eagle3":
        hid = np.asarray(model.combine_hidden_states(params, jnp.asarray(ctx_hidden)))
    else:
        hid = np.asarray(ctx_hidden)
    hid = np.concatenate([hid, np.tile(mask_state(method, model, params), (k - 1, 1))]).astype(np.float32)
    pos = np.arange(n)
    pad = lambda a: np.concatenate([np.asarray(a), np.zeros((DENSE_T - n,) + np.shape(a)[1:], np.asarray(a).dtype)])  # noqa: E731
    slots = np.full(DENSE_T, -1, np.int32)
    slots[:n] = np.where(pos < MML, pos, -1)        # K/V past max_model_len is never stored
    i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    md = CommonAttentionMetadata(
        query_start_loc=i32([0, n]), seq_lens=i32([n]), block_table=i32([[0]]),
        slot_mapping=i32(slots), num_reqs=i32(1), num_actual_tokens=i32(n), max_seq_len=i32(n),
        max_query_len=DENSE_T, causal=True)
    h_log, _, caches = _dense_forward(model)(
        params, i32(pad(np.array(ids, np.int32))), i32(pad(pos.astype(np.int32))),
        jnp.asarray(pad(hid)), model.init_kv_caches(1, MML), md)
    rows = h_log[L - 1 : n]
    if method == "eagle3":
        d = jnp.argmax(model.compute_draft_logits(params, rows), -1).astype(jnp.int32)
        drafts = np.asarray(model.draft_to_target_ids(params, d))
    else:
        drafts = np.asarray(jnp.argmax(model.compute_logits(params, rows), -1))
    m = min(n, MML)
    return [int(t) for t in drafts], [(np.asarray(c.k)[0, :m], np.asarray(c.v)[0, :m]) for c in caches]


# -- batches --------------------------------------------------------------------------------

def _batch(method, cfg, rng, n_reqs, *, chunked, padded, lengths=None):
    width = 3 * HT if method == "eagle3" else cfg.hidden_size
    reqs = []
    for i in range(n_reqs):
        L = int(rng.integers(2, 20)) if lengths is None else lengths[i]
        reqs.append(dict(
            L=L, ids=rng.integers(0, V, L), hid=rng.standard_normal((L, width)).astype(np.float32),
            next=int(rng.integers(0, V)), rej=int(rng.integers(0, 3)) if padded else 0,
            split=int(rng.integers(1, L)) if chunked else 0))
    table = rng.permutation(NUM_BLOCKS)[: n_reqs * MAX_BLOCKS].reshape(n_reqs, MAX_BLOCKS)
    return reqs, table


#: ProposerInputs for each request's tokens [lo, hi) (+ rejected junk in padded mode).
_inputs = functools.partial(_eagle_inputs, b_pad=B_PAD, t_pad=T_PAD)


def _proposer(method, k, model, **kw):
    cfg = SpeculativeConfig(method=method, num_speculative_tokens=k, parallel_drafting=True)
    return EagleProposer(cfg, model, block_size=BS, max_model_len=MML,
                         parallel_drafting_token_id=PARD, kernel_backend="xla", **kw)


def _run(prop, params, method, reqs, table, *, chunked, padded, rng, t_pad=T_PAD):
    state = prop.init_state(NUM_BLOCKS)
    if chunked:   # first call on a prefix; its drafts are thrown away, its cache kept
        first = _inputs(method, [dict(r, next=int(r["ids"][r["split"]]), rej=0) for r in reqs],
                        table, [(0, r["split"]) for r in reqs], padded, rng, t_pad=t_pad)
        _, state = prop.propose(params, state, first)
    inp = _inputs(method, reqs, table, [(r["split"], r["L"]) for r in reqs], padded, rng,
                  t_pad=t_pad)
    return prop.propose(params, state, inp)


def _check(method, model, params, reqs, table, out, state, k):
    got = np.asarray(out.token_ids)
    n = len(reqs)
    assert got.shape == (B_PAD, k) and got.dtype == np.int32
    np.testing.assert_array_equal(out.num_drafts, [k] * n + [0] * (B_PAD - n))
    np.testing.assert_array_equal(got[n:], -1)
    for i, r in enumerate(reqs):
        want, want_kv = naive_parallel(method, model, params, r["ids"], r["hid"], r["next"], k)
        np.testing.assert_array_equal(got[i], want, err_msg=f"request {i}")
        m = min(r["L"] + k - 1, MML)
        for layer, ((pk, pv), (dk, dv)) in enumerate(zip(paged_kv(state, table[i], m), want_kv)):
            np.testing.assert_allclose(pk, dk, rtol=2e-5, atol=2e-5, err_msg=f"request {i} layer {layer} K")
            np.testing.assert_allclose(pv, dv, rtol=2e-5, atol=2e-5, err_msg=f"request {i} layer {layer} V")


# -- tests ----------------------------------------------------------------------------------

@pytest.mark.parametrize("method, k, padded, chunked, mask", [
    ("eagle", 1, True, False, "flat"),
    ("eagle", 2, True, False, "flat"),
    ("eagle", 4, True, True, None),
    ("eagle", 4, False, False, "ckpt"),
    ("eagle", 2, False, True, None),
    ("eagle3", 1, False, False, None),
    ("eagle3", 2, True, True, "flat"),
    ("eagle3", 4, True, False, "ckpt"),
    ("eagle3", 4, False, True, None),
])
def test_parallel_matches_naive_reference(method, k, padded, chunked, mask):
    rng = np.random.default_rng(zlib.crc32(repr((method, k, padded, chunked, mask)).encode()))
    cfg, model, params = head(method)
    params = _with_mask(method, params, mask)
    prop = _proposer(method, k, model)
    assert prop.num_new_slots_per_request == k - 1
    reqs, table = _batch(method, cfg, rng, 3, chunked=chunked, padded=padded)
    out, state = _run(prop, params, method, reqs, table, chunked=chunked, padded=padded, rng=rng)
    _check(method, model, params, reqs, table, out, state, k)


@pytest.mark.parametrize("method, L0, mask", [("eagle", MML, None), ("eagle3", MML - 2, "ckpt")])
def test_requests_reaching_max_model_len(method, L0, mask):
    """A request whose bonus / mask slots reach max_model_len (L0 = MML: the bonus at
    MML - 1, every mask past it; L0 = MML - 2: the last two masks past it): those slots
    are not stored (slot -1) and attend over the stored keys only; the full batch (no
    padding row) and the other requests are unaffected."""
    rng = np.random.default_rng(7 + (method == "eagle3"))
    k = 4
    cfg, model, params = head(method)
    params = _with_mask(method, params, mask)
    prop = _proposer(method, k, model)
    reqs, table = _batch(method, cfg, rng, 4, chunked=False, padded=True,
                         lengths=[L0, 20, 6, 3])
    for r, rej in zip(reqs, [0, 2, 0, 1]):   # the target's tokens fit the block table / T_PAD
        r["rej"] = rej if r["L"] + rej <= MML else 0
    out, state = _run(prop, params, method, reqs, table, chunked=False, padded=True, rng=rng)
    _check(method, model, params, reqs, table, out, state, k)


def test_k1_parallel_equals_chain():
    """k = 1: no new slots (vLLM's default path), so exactly chain drafting."""
    rng = np.random.default_rng(4)
    cfg, model, params = head("eagle")
    params = _with_mask("eagle", params, "flat")   # unused at k = 1
    par = _proposer("eagle", 1, model)
    chain = EagleProposer(SpeculativeConfig(method="eagle", num_speculative_tokens=1), model,
                          block_size=BS, max_model_len=MML, kernel_backend="xla")
    reqs, table = _batch("eagle", cfg, rng, 3, chunked=False, padded=True)
    inp = _inputs("eagle", reqs, table, [(0, r["L"]) for r in reqs], True, rng)
    a, _ = par.propose(params, par.init_state(NUM_BLOCKS), inp)
    b, _ = chain.propose(params, chain.init_state(NUM_BLOCKS), inp)
    np.testing.assert_array_equal(a.token_ids, b.token_ids)


def test_wrong_mask_hidden_size_raises():
    _, model, params = head("eagle3")
    prop = _proposer("eagle3", 2, model)
    bad = dict(params, mask_hidden=jnp.zeros((1, 1, 3 * HT + 1)))
    rng = np.random.default_rng(0)
    reqs, table = _batch("eagle3", head("eagle3")[0], rng, 1, chunked=False, padded=True)
    inp = _inputs("eagle3", reqs, table, [(0, r["L"]) for r in reqs], True, rng)
    with pytest.raises(ValueError, match=r"mask_hidden.*73.*72 values"):
        prop.propose(bad, prop.init_state(NUM_BLOCKS), inp)


def test_no_recompile_inside_a_bucket(caplog):
    rng = np.random.default_rng(5)
    cfg, model, params = head("eagle3")
    params = _with_mask("eagle3", params, "ckpt")
    prop = _proposer("eagle3", 4, model)
    state = prop.init_state(NUM_BLOCKS)
    inputs = {}
    for n in (2, 1, 4, 3):
        reqs, table = _batch("eagle3", cfg, rng, n, chunked=False, padded=True)
        inputs[n] = _inputs("eagle3", reqs, table, [(0, r["L"]) for r in reqs], True, rng)

    def run(n):
        nonlocal state
        out, state = prop.propose(params, state, inputs[n])
        return np.asarray(out.token_ids)

    assert_no_recompile(prop.propose, run, (2, 1, 4, 3), caplog)


def test_warmup_then_no_compile(caplog):
    """warmup compiles the parallel first pass (T + B (k-1) tokens inside) for each bucket
    ahead of time; calls inside the buckets compile nothing."""
    cfg, model, params = head("eagle")
    params = _with_mask("eagle", params, "flat")
    prop = _proposer("eagle", 2, model)
    state = prop.init_state(NUM_BLOCKS)
    bucket = ProposeBucket(B_PAD, T_PAD, MAX_BLOCKS, 32)
    assert prop.warmup([bucket], params, state) == (dataclasses.replace(bucket, padded_batch=True),)
    rng = np.random.default_rng(6)
    plan = [(B_PAD, T_PAD, 3), (B_PAD, T_PAD, 1), (B_PAD, T_PAD, 4)]
    inputs = []
    for b_pad, t_pad, n in plan:
        reqs, table = _batch("eagle", cfg, rng, n, chunked=False, padded=True,
                             lengths=[int(x) for x in rng.integers(2, 8, n)])
        inputs.append(_inputs("eagle", reqs, table, [(0, r["L"]) for r in reqs], True, rng,
                              b_pad=b_pad, t_pad=t_pad))
    with jax.log_compiles(), caplog.at_level(logging.DEBUG, logger="jax"):
        for inp in inputs:
            out, state = prop.propose(params, state, inp)
            assert out.token_ids.shape[1] == 2
    assert not [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling")]


def _spec(method="eagle", k=2, **kw):
    return SpeculativeConfig(method=method, num_speculative_tokens=k, parallel_drafting=True, **kw)


@pytest.mark.parametrize("kwargs, match", [
    (dict(parallel_drafting_token_id=None), "needs parallel_drafting_token_id"),
    (dict(parallel_drafting_token_id=V), r"parallel_drafting_token_id must be an int in \[0, 80\)"),
    (dict(parallel_drafting_token_id=-1), "parallel_drafting_token_id must be an int"),
    (dict(parallel_drafting_token_id=True), "parallel_drafting_token_id must be an int"),
    (dict(parallel_drafting_token_id="7"), "parallel_drafting_token_id must be an int"),
    (dict(config=_spec(speculative_token_tree="[(0,), (0, 0)]"), parallel_drafting_token_id=PARD),
     None),
])
def test_construction_errors(kwargs, match):
    _, model, _ = head("eagle")
    args = dict(config=_spec(), model=model, block_size=BS, max_model_len=MML)
    args.update(kwargs)
    if match is None:             # a chain tree is chain drafting: accepted
        EagleProposer(**args)
        return
    with pytest.raises(ValueError, match=match):
        EagleProposer(**args)


def test_token_id_is_checked_against_the_input_vocabulary():
    """EAGLE-3: the mask token is embedded, so it is an id of the target vocabulary (80),
    not of the draft vocabulary (40)."""
    _, model, _ = head("eagle3")
    prop = EagleProposer(_spec("eagle3"), model, block_size=BS, max_model_len=MML,
                         parallel_drafting_token_id=np.int64(60))
    assert prop.parallel_drafting_token_id == 60 and type(prop.parallel_drafting_token_id) is int
    hash(prop)


def test_padded_drafter_batch_required():
    with pytest.raises(ValueError, match="disable_padded_drafter_batch"):
        _spec(disable_padded_drafter_batch=True)
    with pytest.raises(ValueError, match="parallel_drafting"):
        _spec(speculative_token_tree="[(0,), (1,)]")
    # a config that escaped its own check is refused by the proposer too
    cfg = _spec()
    object.__setattr__(cfg, "disable_padded_drafter_batch", True)
    _, model, _ = head("eagle")
    with pytest.raises(ValueError, match="disable_padded_drafter_batch=False"):
        EagleProposer(cfg, model, block_size=BS, max_model_len=MML, parallel_drafting_token_id=PARD)


# -- converters and make_proposer ----------------------------------------------------------

def _ckpt(tmp_path, name, *, mask_shape=None, config_extra=None, seed=0):
    """A tiny checkpoint of converter case ``name`` with an optional ``mask_hidden``."""
    case = CASES[name]
    src = tmp_path / name
    src.mkdir()
    cfg = dict(case.config, **(config_extra or {}))
    (src / "config.json").write_text(json.dumps(cfg))
    arrays = case.arrays(seed)
    mask = None
    if mask_shape is not None:
        mask = np.random.default_rng(seed + 1).standard_normal(mask_shape).astype(np.float32)
        arrays["mask_hidden"] = mask.astype(case.dtype)
    write_layout(src, arrays, "safetensors")
    return src, mask, case


@pytest.mark.parametrize("name, shape", [
    ("eagle", (1, CK_H)), ("eagle3", (1, 1, 3 * CK_H)), ("eagle3_spec", (1, 3 * CK_H))])
def test_converter_loads_mask_hidden(tmp_path, name, shape):
    src, mask, case = _ckpt(tmp_path, name, mask_shape=shape, config_extra={"pard_token": 11})
    ckpt = read_checkpoint(src)
    norm = normalize(case.fmt, ckpt.config, ckpt.tensors)
    assert "mask_hidden" not in norm.tensors and norm.extra_params["mask_hidden"].shape == (mask.size,)
    want = mask.astype(case.dtype).reshape(-1)
    kind, config, params = load_pretrained(src)
    assert kind == case.kind and config.mask_token_id == 11
    np.testing.assert_array_equal(np.asarray(params["mask_hidden"]), want)
    # specjax-convert output: mask_hidden restored, the token id kept
    convert(src, tmp_path / "out")
    meta = json.loads((tmp_path / "out" / "specjax.json").read_text())
    assert meta["extra_params"] == {"mask_hidden": [mask.size]}
    kind2, config2, params2 = load_pretrained(tmp_path / "out", dtype="fp32")
    assert (kind2, config2) == (kind, config)
    np.testing.assert_array_equal(np.asarray(params2["mask_hidden"]), want.astype(np.float32))
    assert params2["mask_hidden"].dtype == np.float32


def test_converter_without_mask_hidden_is_unchanged(tmp_path):
    src, _, _ = _ckpt(tmp_path, "eagle3")
    _, config, params = load_pretrained(src)
    assert "mask_hidden" not in params and config.mask_token_id == -1
    convert(src, tmp_path / "out")
    assert "extra_params" not in json.loads((tmp_path / "out" / "specjax.json").read_text())
    _, config2, params2 = load_pretrained(tmp_path / "out")
    assert "mask_hidden" not in params2 and config2 == config


@pytest.mark.parametrize("name, shape, match", [
    ("eagle3", (1, 1, 2 * CK_H), r"mask_hidden has shape \[1, 1, 32\].*48 values"),
    ("eagle", (1, 2 * CK_H), r"mask_hidden has shape \[1, 32\].*16 values \(hidden_size\)"),
])
def test_converter_rejects_a_wrong_mask_hidden(tmp_path, name, shape, match):
    src, _, _ = _ckpt(tmp_path, name, mask_shape=shape)
    with pytest.raises(CheckpointError, match=match):
        load_pretrained(src)


def test_parallel_drafting_token_id_lookup_order():
    assert parallel_drafting_token_id({}) is None
    assert parallel_drafting_token_id({"ptd_token_id": 5}) == 5
    assert parallel_drafting_token_id({"ptd_token_id": "128256"}) == 128256
    assert parallel_drafting_token_id({"pard_token": 3, "ptd_token_id": 5}) == 3
    assert parallel_drafting_token_id({"dflash_config": {"mask_token_id": 9}, "pard_token": 3}) == 9
    with pytest.raises(CheckpointError, match="pard_token"):
        parallel_drafting_token_id({"pard_token": "mask"})


def test_make_proposer_end_to_end(tmp_path):
    """A P-EAGLE checkpoint (mask_hidden, ptd_token_id) -> load_pretrained -> make_proposer:
    the token id comes from the draft config, the drafts match the reference."""
    k = 3
    src, _, _ = _ckpt(tmp_path, "eagle3_spec", mask_shape=(1, 3 * CK_H),
                      config_extra={"ptd_token_id": 13})
    _, dcfg, dparams = load_pretrained(src, dtype="fp32")
    assert "mask_hidden" in dparams
    # six layers: the head reads aux layers (1, 3, 5), checked against the target up front
    tcfg = registry.config_from_hf("llama", dict(GEO, num_hidden_layers=6, vocab_size=dcfg.vocab_size,
                                                 hidden_size=CK_H))
    p = make_proposer(_spec("eagle3", k), target=registry.make_model("llama", tcfg),
                      target_params={"embed_tokens": {"embedding": jnp.asarray(
                          np.random.default_rng(2).standard_normal((dcfg.vocab_size, CK_H)), jnp.float32)}},
                      draft=dcfg, draft_params=dparams, block_size=BS, max_model_len=MML,
                      kernel_backend="xla")
    assert p.impl.parallel_drafting_token_id == 13 and p.max_new_slots == k - 1
    assert p.feed.aux_layer_ids == p.aux_layer_ids == (1, 3, 5)
    # an explicit option wins over the draft config
    q = make_proposer(_spec("eagle3", k), draft=dcfg, draft_params=p.params, block_size=BS,
                      max_model_len=MML, kernel_backend="xla", parallel_drafting_token_id=2)
    assert q.impl.parallel_drafting_token_id == 2
    # a draft config without a token: the option is required
    with pytest.raises(ValueError, match="parallel_drafting_token_id"):
        make_proposer(_spec("eagle3", k), draft=dcfg.replace(mask_token_id=-1), draft_params=p.params,
                      block_size=BS, max_model_len=MML)

    # drafts against the reference, with the loaded head and its mask_hidden
    model, params = p.impl.model, p.params
    rng = np.random.default_rng(9)
    reqs = []
    for _ in range(2):
        L = int(rng.integers(2, 12))
        reqs.append(dict(L=L, ids=rng.integers(0, dcfg.vocab_size, L),
                         hid=rng.standard_normal((L, 3 * CK_H)).astype(np.float32),
                         next=int(rng.integers(0, dcfg.vocab_size)), rej=int(rng.integers(0, 3)), split=0))
    table = rng.permutation(NUM_BLOCKS)[: 2 * MAX_BLOCKS].reshape(2, MAX_BLOCKS)
    state = p.init_state(NUM_BLOCKS)
    out, state = p.impl.propose(params, state, _inputs("eagle3", reqs, table,
                                                       [(0, r["L"]) for r in reqs], True, rng))
    for i, r in enumerate(reqs):
        want, _ = naive_parallel("eagle3", model, params, r["ids"], r["hid"], r["next"], k, pard=13)
        np.testing.assert_array_equal(np.asarray(out.token_ids)[i], want, err_msg=f"request {i}")
