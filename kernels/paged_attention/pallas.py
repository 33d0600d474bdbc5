"""Paged attention as a Pallas kernel lowered through Triton (interpret mode off the GPU).

The function of :func:`specjax.kernels.paged_attention.paged_attention`, reading only each
request's live pages: grid ``(B, num_kv_heads, num_splits)``, program ``(r, h, s)`` owns
request ``r``'s query rows of kv head ``h`` (one ``ROWS x head_dim`` tile) and split ``s``
of its keys, online softmax in float32; :func:`_merge` combines the splits. Not
bit-identical to the reference (summation order). :func:`paged_attention_write` folds the
step's cache write in; :func:`write_kv` is the unfused write as one kernel. A sliding
window masks keys ``<= qpos - window`` and skips the tiles before every row's window; sink
logits join the final normalization (the kernel's own with one split, else the merge's).
Interpret mode does not check Triton's shape rules: :func:`unsupported_reason` does, up
front.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from specjax import _compat
from specjax.kernels.paged_attention.kv_cache import scatter_slots
from specjax.kernels.paged_attention.limits import (  # noqa: F401  (re-exported)
    DEFAULT_BLOCK_K, DEFAULT_NUM_SMS, MAX_ROWS, MAX_SPLITS, MAX_TREE, NEG, cdiv, default_num_splits,
    fused_write_pays, kernel_config, num_rows, pow2_at_least, tree_bits, unsupported_reason)

#: ``jax.experimental.pallas.triton`` (None, with the reason, on a JAX without the Pallas
#: Triton backend: then :func:`paged_attention` raises and ``"auto"`` never picks it).
pltr, PLTR_MISSING = _compat.pallas_triton()

def _load_new(qkv_ref, tok, nh: int, nkv: int, h, col):
    """Kv head ``h`` of tokens ``tok [W]`` from ``qkv [T, nh + 2 nkv, hd]``: ``(k, v)``."""
    return (pltr.load(qkv_ref.at[tok[:, None], nh + h, col]),
            pltr.load(qkv_ref.at[tok[:, None], nh + nkv + h, col]))


def _store_rows(ok, idx, store):
    """``store(*idx)`` for the rows where ``ok`` (``idx``: ``[W]`` int arrays, e.g. token
    and slot); nothing is loaded or stored when no row is ``ok``.

    Rows not ``ok`` are pointed at the first ``ok`` row (same slot, same value), so the
    stores need no mask: interpret mode implements a masked store as a read-select-scatter,
    where a masked row aimed at a slot that another row writes would race with it."""
    w = ok.shape[0]
    i = jnp.arange(w, dtype=jnp.int32)
    first = jnp.min(jnp.where(ok, i, w))

    def go():
        store(*(jnp.where(ok, x, jnp.sum(jnp.where(i == first, x, 0))) for x in idx))

    lax.cond(first < w, go, lambda: None)


def _write_new(qkv_ref, ko_ref, vo_ref, tok, slot, ok, nh: int, h, col, block_size: int):
    """Store kv head ``h`` of tokens ``tok [W]`` (from ``qkv``) at ``slot`` of the output
    caches where ``ok`` (:func:`_store_rows`)."""

    def write(t, sl):
        kn, vn = _load_new(qkv_ref, t, nh, ko_ref.shape[2], h, col)
        page = lax.div(sl, jnp.int32(block_size))[:, None]
        off = lax.rem(sl, jnp.int32(block_size))[:, None]
        pltr.store(ko_ref.at[page, off, h, col], kn.astype(ko_ref.dtype))
        pltr.store(vo_ref.at[page, off, h, col], vn.astype(vo_ref.dtype))

    _store_rows(ok, (tok, slot), write)


def _fold_sink(acc, m, l, sink):
    """A softmax's sink logit (no value) folded into its partial result: ``acc [R, hd]``,
    ``m``, ``l``, ``sink [R]`` float32 -> ``(acc, l)`` rescaled to ``max(m, sink)``, the sink's
    ``exp`` added to ``l``."""
    m_f = jnp.maximum(m, sink)
    c = jnp.exp(m - m_f)
    return acc * c[:, None], l * c + jnp.exp(sink - m_f)


def _kernel(qsl_ref, seq_ref, bt_ref, *refs, scale: float, group: int, rows: int,
            block_k: int, block_size: int, max_blocks: int, num_blocks: int, num_splits: int,
            num_tokens: int, causal: bool, tree_bits: tuple[int, ...] | None, precision,
            write_rows: int = 0, direct: bool = False, window: int | None = None,
            has_sinks: bool = False):
    """``refs``: ``q, k_cache, v_cache`` (inputs, whole arrays), then ``o, m, l`` (this
    program's tile). With ``write_rows`` (the fused cache write, see
    :func:`paged_attention_write`): ``slot_mapping, qkv, k_cache, v_cache`` in, then ``o, m,
    l, k_cache_out, v_cache_out`` (aliased to the caches in), and ``q_ref`` is ``qkv``.
    ``direct`` (one split): the single output ``out [T, num_heads, head_dim]`` (the whole
    array) replaces ``o, m, l``: rows normalized and stored in token order, no merge kernel.
    ``window``: keys ``<= qpos - window`` masked, tiles before every row's window skipped;
    ``has_sinks``: a ``sinks [num_heads]`` input after the caches, folded in when ``direct``
    (else by :func:`_merge`)."""
    n_out = 1 if direct else 3
    n_in = (4 if write_rows else 3) + has_sinks
    if write_rows:
        sm_ref, q_ref, k_ref, v_ref = refs[:4]
        outs, (ko_ref, vo_ref) = refs[n_in:n_in + n_out], refs[n_in + n_out:]
    else:
        q_ref, k_ref, v_ref = refs[:3]
        outs = refs[n_in:]
    r = pl.program_id(0)
    h = pl.program_id(1)
    s = pl.program_id(2)
    start = qsl_ref[r]
    qlen = qsl_ref[r + 1] - start
    seq = seq_ref[r]

    m_idx = jnp.arange(rows, dtype=jnp.int32)
    # query index in the request; the rows past the request's queries repeat its last query
    # (same values, same stores: no store needs a mask, so none races in interpret mode)
    qi = jnp.minimum(lax.div(m_idx, jnp.int32(group)), jnp.maximum(qlen - 1, 0))
    row_ok = qi < qlen
    tok = jnp.minimum(start + qi, num_tokens - 1)
    head = h * group + lax.rem(m_idx, jnp.int32(group))
    # every dimension indexed by an int array (interpret mode cannot mix gathers and slices;
    # the Triton lowering builds the same pointer tensor either way)
    hd = q_ref.shape[-1]
    col = jnp.arange(hd, dtype=jnp.int32)[None, :]
    q = pltr.load(q_ref.at[tok[:, None], head[:, None], col], mask=row_ok[:, None],
                  other=0)                                     # [ROWS, hd]
    if write_rows:
        nh, nkv = k_ref.shape[2] * group, k_ref.shape[2]
        # this request's new keys / values (heads nh + h and nh + nkv + h of qkv) and slots
        ni = jnp.arange(write_rows, dtype=jnp.int32)
        ntok = jnp.minimum(start + ni, num_tokens - 1)
        nslot = pltr.load(sm_ref.at[ntok], mask=ni < qlen, other=-1)
        n_ok = (ni < qlen) & (nslot >= 0) & (nslot < num_blocks * block_size)
        _write_new(q_ref, ko_ref, vo_ref, ntok, nslot, n_ok & (s == 0), nh, h, col, block_size)
        # rows past every request (query_start_loc[-1] .. num_tokens) with a slot are
        # written too (as the unfused scatter does), by the programs of request 0
        tail = qsl_ref[qsl_ref.shape[0] - 1]
        n_tail = jnp.where((r == 0) & (s == 0), cdiv(num_tokens - tail, write_rows), 0)

        def write_tail(c, carry):
            ttok = jnp.minimum(tail + c * write_rows + ni, num_tokens - 1)
            t_ok = tail + c * write_rows + ni < num_tokens
            tslot = pltr.load(sm_ref.at[ttok], mask=t_ok, other=-1)
            t_ok = t_ok & (tslot >= 0) & (tslot < num_blocks * block_size)
            _write_new(q_ref, ko_ref, vo_ref, ttok, tslot, t_ok, nh, h, col, block_size)
            return carry

        lax.fori_loop(0, n_tail, write_tail, 0)
        # vLLM's metadata: token i's slot is that of its position seq - qlen + i in the
        # request's table, so only the tiles from seq - qlen on can hold a written key;
        # any other slot (a bug upstream, or a test) makes every tile check
        npos = seq - qlen + ni
        npage = pltr.load(bt_ref.at[r, jnp.clip(lax.div(npos, jnp.int32(block_size)), 0,
                                                 max_blocks - 1)])
        nexp = (jnp.clip(npage, 0, num_blocks - 1) * block_size
                + lax.rem(jnp.maximum(npos, 0), jnp.int32(block_size)))
        irregular = jnp.max(jnp.where(n_ok & ((nslot != nexp) | (npos < 0)), 1, 0)) > 0

    if tree_bits is not None:
        qt = len(tree_bits)
        # the reference clamps the query index to the mask's last row
        bits = jnp.full((rows,), tree_bits[-1], jnp.int32)
        for i, b in enumerate(tree_bits[:-1]):
            bits = jnp.where(qi == i, jnp.int32(b), bits)
        block_start = seq - qlen                               # first key of the query block
    elif causal:
        qpos = seq - qlen + qi                                 # [ROWS] position of each row

    n_tiles = jnp.where(qlen > 0, cdiv(seq, block_k), 0)
    if window is None:
        per = cdiv(n_tiles, num_splits)
        lo = jnp.minimum(s * per, n_tiles)
    else:       # the splits share the tiles from the first row's window on
        wpos = seq - qlen + qi
        t0 = jnp.minimum(lax.div(jnp.maximum(seq - qlen - window + 1, 0), jnp.int32(block_k)),
                         n_tiles)
        per = cdiv(n_tiles - t0, num_splits)
        lo = jnp.minimum(t0 + s * per, n_tiles)
    hi = jnp.minimum(lo + per, n_tiles)
    kk0 = jnp.arange(block_k, dtype=jnp.int32)

    def body(t, carry, overlay_new: bool = False):
        acc, m_prev, l_prev = carry
        kk = t * block_k + kk0                                 # [BK] key positions
        kv_ok = kk < seq
        page = bt_ref[r, jnp.minimum(lax.div(kk, jnp.int32(block_size)), max_blocks - 1)]
        page = jnp.clip(page, 0, num_blocks - 1)
        off = lax.rem(kk, jnp.int32(block_size))
        k = pltr.load(k_ref.at[page[:, None], off[:, None], h, col], mask=kv_ok[:, None],
                      other=0)                                 # [BK, hd]
        v = pltr.load(v_ref.at[page[:, None], off[:, None], h, col], mask=kv_ok[:, None],
                      other=0)
        if overlay_new:
            # keys this call writes (this request's slots) read the new values, whether or
            # not the write above has landed: a one-hot [BK, W] x [W, hd] product (exact)
            hit = ((page * block_size + off)[:, None] == nslot[None, :]) & n_ok[None, :]
            any_hit = jnp.max(hit.astype(jnp.int32), axis=1) > 0
            kn, vn = _load_new(q_ref, ntok, nh, nkv, h, col)
            onehot = hit.astype(k.dtype)
            dims = (((1,), (0,)), ((), ()))
            new_k = lax.dot_general(onehot, kn, dims, precision=precision,
                                    preferred_element_type=jnp.float32)
            new_v = lax.dot_general(onehot, vn, dims, precision=precision,
                                    preferred_element_type=jnp.float32)
            k = jnp.where(any_hit[:, None], new_k.astype(k.dtype), k)
            v = jnp.where(any_hit[:, None], new_v.astype(v.dtype), v)

        sc = lax.dot_general(q, k.astype(q.dtype), (((1,), (1,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32) * scale    # [ROWS, BK]
        mask = row_ok[:, None] & kv_ok[None, :]
        if tree_bits is not None:
            rel = kk - block_start                             # index in the query block
            relc = jnp.clip(rel, 0, qt - 1)
            seen = lax.shift_right_logical(bits[:, None], relc[None, :]) & 1
            mask = mask & ((rel < 0)[None, :] | ((rel < qt)[None, :] & (seen != 0)))
        elif causal:
            mask = mask & (kk[None, :] <= qpos[:, None])
        if window is not None:
            mask = mask & (kk[None, :] > wpos[:, None] - window)
        sc = jnp.where(mask, sc, NEG)
        m_new = jnp.maximum(m_prev, jnp.max(sc, axis=1))
        corr = jnp.exp(m_prev - m_new)
        p = jnp.where(mask, jnp.exp(sc - m_new[:, None]), 0.0)
        l_new = corr * l_prev + jnp.sum(p, axis=1)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)            # [ROWS, hd]
        return corr[:, None] * acc + pv, m_new, l_new

    init = (jnp.zeros((rows, hd), jnp.float32), jnp.full((rows,), NEG, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    if write_rows:
        # two loops without a branch inside (Triton pipelines their loads): the tiles
        # before the first new position, then those that can hold a written key (every
        # tile when the slots are irregular)
        first_new = jnp.where(irregular, 0, lax.div(jnp.maximum(seq - qlen, 0),
                                                    jnp.int32(block_k)))
        mid = jnp.clip(first_new, lo, hi)
        init = lax.fori_loop(lo, mid, body, init)
        acc, m, l = lax.fori_loop(mid, hi, functools.partial(body, overlay_new=True), init)
    else:
        acc, m, l = lax.fori_loop(lo, hi, body, init)
    if not direct:
        o_ref, m_ref, l_ref = outs
        o_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l
        return
    (out_ref,) = outs
    if has_sinks:
        acc, l = _fold_sink(acc, m, l, pltr.load(refs[n_in - 1].at[head]))
    out = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(out_ref.dtype)

    def store():
        pltr.store(out_ref.at[tok[:, None], head[:, None], col], out)

    lax.cond(qlen > 0, store, lambda: None)
    # zeros for the tokens past every request (query_start_loc[-1] .. num_tokens), from the
    # programs of request 0: ``rows // group`` tokens a chunk, the rows past them repeating
    # its last token (the same zeros)
    per_chunk = max(rows // group, 1)
    tail = qsl_ref[qsl_ref.shape[0] - 1]
    n_tail = jnp.where(r == 0, cdiv(num_tokens - tail, per_chunk), 0)
    zeros = jnp.zeros((rows, hd), out_ref.dtype)
    zi = jnp.minimum(lax.div(m_idx, jnp.int32(group)), per_chunk - 1)

    def zero_tail(c, carry):
        ztok = jnp.minimum(tail + c * per_chunk + zi, num_tokens - 1)
        pltr.store(out_ref.at[ztok[:, None], head[:, None], col], zeros)
        return carry

    lax.fori_loop(0, n_tail, zero_tail, 0)


_STATIC = ("scale", "max_query_len", "causal", "tree_mask", "sliding_window", "block_k",
           "num_splits", "num_warps", "num_stages", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                    query_start_loc: jax.Array, seq_lens: jax.Array, block_table: jax.Array,
                    sinks: jax.Array | None = None, *,
                    scale: float, max_query_len: int, causal: bool = True,
                    tree_mask: tuple[tuple[bool, ...], ...] | None = None,
                    sliding_window: int | None = None,
                    block_k: int | None = None, num_splits: int | None = None,
                    num_warps: int | None = None, num_stages: int = 2,
                    interpret: bool | None = None) -> jax.Array:
    """Attention of ``q [T, num_heads, head_dim]`` over the paged cache -> ``[T, num_heads,
    head_dim]`` in ``q.dtype`` (:func:`specjax.kernels.paged_attention.paged_attention`).
    Static: ``max_query_len`` bounds every query length; ``tree_mask`` (``Q x Q`` bools)
    replaces the causal mask; ``sliding_window`` keeps keys ``> qpos - window`` (and skips
    the tiles before them); ``block_k`` keys per step (64; a power of two >= 16),
    ``num_splits`` (:func:`default_num_splits`), ``num_warps`` (4, 8 above 32 rows),
    ``num_stages``; ``interpret`` (default: off the GPU) runs Pallas interpret mode.
    ``sinks [num_heads]`` (float): one extra logit per head in each softmax, no value.
    """
    out, _ = _attention(q, None, k_cache, v_cache, None, query_start_loc, seq_lens, block_table,
                        scale=scale, max_query_len=max_query_len, causal=causal,
                        tree_mask=tree_mask, block_k=block_k, num_splits=num_splits,
                        num_warps=num_warps, num_stages=num_stages, interpret=interpret,
                        **_extras(sliding_window, sinks))
    return out


def _extras(sliding_window, sinks) -> dict:
    """The window / sinks keywords of :func:`_attention`, none when neither is set (so the
    plain call is the one it always was)."""
    if sliding_window is None and sinks is None:
        return {}
    return dict(window=None if sliding_window is None else int(sliding_window), sinks=sinks)


@functools.partial(jax.jit, static_argnames=_STATIC)
def paged_attention_write(qkv: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                          slot_mapping: jax.Array, query_start_loc: jax.Array,
                          seq_lens: jax.Array, block_table: jax.Array,
                          sinks: jax.Array | None = None, *, scale: float,
                          max_query_len: int, causal: bool = True,
                          tree_mask: tuple[tuple[bool, ...], ...] | None = None,
                          sliding_window: int | None = None, block_k: int | None = None,
                          num_splits: int | None = None,
                          num_warps: int | None = None, num_stages: int = 2,
                          interpret: bool | None = None
                          ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """This step's K/V written into the paged cache and the attention over it, in one kernel:
    ``qkv [T, num_heads + 2 * num_kv_heads, head_dim]`` (queries, new keys, new values, in
    the caches' dtype) -> ``(out [T, num_heads, head_dim], (k_cache, v_cache))``, the caches
    aliased in and out. Slots ``< 0`` or past the cache are dropped. Bit-identical to
    ``write_kv`` then :func:`paged_attention` when no request reads a slot that another
    request's (or a padding) token writes in the call, true of vLLM's metadata.
    ``sliding_window``, ``sinks``: :func:`paged_attention`'s. ValueError for mismatched
    shapes or dtypes.
    """
    t_pad, width, hd = qkv.shape
    nb, bs, nkv, hd_k = k_cache.shape
    nh = width - 2 * nkv
    if nh <= 0 or hd_k != hd or v_cache.shape != k_cache.shape:
        raise ValueError(f"qkv {qkv.shape} does not fit caches {k_cache.shape}, {v_cache.shape}: "
                         "want [T, num_heads + 2 * num_kv_heads, head_dim]")
    if qkv.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"qkv ({qkv.dtype}) and the caches ({k_cache.dtype}, {v_cache.dtype}) "
                         "must share one dtype")
    if slot_mapping.shape != (t_pad,):
        raise ValueError(f"slot_mapping {slot_mapping.shape} must be [T] = [{t_pad}]")
    return _attention(qkv, nh, k_cache, v_cache, slot_mapping, query_start_loc, seq_lens,
                      block_table, scale=scale, max_query_len=max_query_len, causal=causal,
                      tree_mask=tree_mask, block_k=block_k, num_splits=num_splits,
                      num_warps=num_warps, num_stages=num_stages, interpret=interpret,
                      **_extras(sliding_window, sinks))


def _attention(q, num_heads, k_cache, v_cache, slot_mapping, query_start_loc, seq_lens,
               block_table, *, scale, max_query_len, causal, tree_mask, block_k, num_splits,
               num_warps, num_stages, interpret, window=None, sinks=None):
    """Both entry points: ``slot_mapping is None`` -> attention only (``q [T, nh, hd]``),
    else ``q`` is ``qkv`` with ``num_heads`` query heads and the write is fused."""
    if pltr is None:
        raise ValueError(f"the Pallas paged-attention kernel is unavailable: {PLTR_MISSING}")
    write = slot_mapping is not None
    t_pad, width, hd = q.shape
    nh = num_heads if write else width
    nb, bs, nkv, hd_k = k_cache.shape
    if v_cache.shape != k_cache.shape or hd_k != hd:
        raise ValueError(f"cache shapes {k_cache.shape}, {v_cache.shape} do not fit q {q.shape}")
    b_pad = query_start_loc.shape[0] - 1
    max_blocks = block_table.shape[1]
    group, rows, block_k, num_splits, num_warps = kernel_config(
        "pallas", num_heads=nh, num_kv_heads=nkv, head_dim=hd, block_size=bs,
        max_blocks=max_blocks, batch=b_pad, max_query_len=max_query_len, tree_mask=tree_mask,
        dtype=q.dtype, block_k=block_k, num_splits=num_splits, num_warps=num_warps,
        fused_write=write)
    if window is not None and window < 1:
        raise ValueError(f"sliding_window={window} must be None or >= 1")
    if sinks is not None and sinks.shape != (nh,):
        raise ValueError(f"sinks {sinks.shape} must be [num_heads] = [{nh}]")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if b_pad == 0 or t_pad == 0:
        out = jnp.zeros((t_pad, nh, hd), q.dtype)
        if write:       # no request: every token is past query_start_loc[-1]
            k_cache = _scatter(k_cache, q[:, nh:nh + nkv], slot_mapping)
            v_cache = _scatter(v_cache, q[:, nh + nkv:], slot_mapping)
        return out, (k_cache, v_cache)
    # the first dot in the promoted dtype (as the reference's einsum), the second in the
    # cache dtype (the reference casts the probabilities to it)
    q_in = q if write else q.astype(jnp.promote_types(q.dtype, k_cache.dtype))

    # one split: the kernel normalizes and stores rows in token order itself (no merge)
    direct = num_splits == 1
    kernel = functools.partial(
        _kernel, scale=float(scale), group=group, rows=rows, block_k=block_k, block_size=bs,
        max_blocks=max_blocks, num_blocks=nb, num_splits=num_splits, num_tokens=t_pad,
        causal=bool(causal), tree_bits=None if tree_mask is None else tree_bits(tree_mask),
        precision=lax.Precision.HIGHEST,
        write_rows=pow2_at_least(max(int(max_query_len), 1), 16) if write else 0,
        direct=direct, **({} if window is None and sinks is None else
                          dict(window=window, has_sinks=sinks is not None)))
    grid = (b_pad, nkv, num_splits)
    if direct:
        out_specs = [pl.no_block_spec]
        out_shape = [jax.ShapeDtypeStruct((t_pad, nh, hd), q.dtype)]
    else:
        out_specs = [
            pl.BlockSpec((None, None, None, rows, hd), lambda r, h, s: (r, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda r, h, s: (r, h, s, 0)),
            pl.BlockSpec((None, None, None, rows), lambda r, h, s: (r, h, s, 0)),
        ]
        out_shape = [
            jax.ShapeDtypeStruct((b_pad, nkv, num_splits, rows, hd), jnp.float32),
            jax.ShapeDtypeStruct((b_pad, nkv, num_splits, rows), jnp.float32),
            jax.ShapeDtypeStruct((b_pad, nkv, num_splits, rows), jnp.float32),
        ]
    n_out = len(out_shape)
    ints = [query_start_loc.astype(jnp.int32), seq_lens.astype(jnp.int32),
            block_table.astype(jnp.int32)]
    if write:
        args = ints + [slot_mapping.astype(jnp.int32), q_in, k_cache, v_cache]
        out_specs += [pl.no_block_spec, pl.no_block_spec]
        out_shape += [jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                      jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)]
        aliases = {5: n_out, 6: n_out + 1}
    else:
        args, aliases = ints + [q_in, k_cache, v_cache], {}
    if sinks is not None:           # after the caches: the aliases above stay
        args.append(sinks.astype(jnp.float32))
    extra = ("" if window is None else f"_w{window}") + ("" if sinks is None else "_sinks")
    outs = pl.pallas_call(
        kernel,
        grid=grid,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"paged_attention{'_write' if write else ''}_r{rows}_k{block_k}_s{num_splits}{extra}",
    )(*args)
    caches = (outs[n_out], outs[n_out + 1]) if write else (k_cache, v_cache)
    if direct:
        return outs[0], caches
    o, m, l = outs[:3]
    # merge the splits (flash-decoding), normalize, rows -> token order: one small kernel
    out = _merge(query_start_loc.astype(jnp.int32), o, m, l, t_pad=t_pad, num_heads=nh,
                 max_query_len=max(int(max_query_len), 1), out_dtype=q.dtype,
                 interpret=interpret, **({} if sinks is None else dict(sinks=args[-1])))
    return out, caches


def _scatter(cache: jax.Array, values: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """The unfused cache write (no request, hence no kernel to fold it into)."""
    return scatter_slots(cache, values, slot_mapping)


def _merge_kernel(qsl_ref, o_ref, m_ref, l_ref, *refs, b_pad: int, group: int,
                  num_splits: int, rows: int, qmax: int, has_sinks: bool = False):
    """Program ``(t, h)``: token ``t``'s ``group`` query heads of kv head ``h``. Finds the
    token's request ``r`` (``qsl[r] <= t < qsl[r + 1]``) and query index ``i``, merges the
    ``num_splits`` partial results of rows ``i * group + g`` (flash-decoding), normalizes,
    writes ``out[t, h, g]`` (``g`` padded to a power of two); zeros for tokens past
    ``qsl[b_pad]``. ``has_sinks``: ``refs`` starts with ``sinks [num_heads]``, each head's
    sink joining the merged denominator once."""
    out_ref = refs[-1]
    t = pl.program_id(0)
    h = pl.program_id(1)
    bi = jnp.arange(pow2_at_least(b_pad), dtype=jnp.int32)
    ends = pltr.load(qsl_ref.at[jnp.minimum(bi + 1, b_pad)], mask=bi < b_pad,
                     other=np.iinfo(np.int32).max)             # qsl[1 : b_pad + 1]
    r = jnp.minimum(jnp.sum((ends <= t).astype(jnp.int32)), b_pad - 1)
    i = jnp.clip(t - qsl_ref[r], 0, qmax - 1)
    valid = t < qsl_ref[b_pad]

    g = jnp.arange(pow2_at_least(group), dtype=jnp.int32)
    g_ok = g < group
    row = jnp.minimum(i * group + g, rows - 1)
    s = jnp.arange(pow2_at_least(num_splits), dtype=jnp.int32)
    sc = jnp.minimum(s, num_splits - 1)
    ok = (s < num_splits)[:, None] & g_ok[None, :]                # [S2, G2]
    hd = o_ref.shape[-1]
    col = jnp.arange(hd, dtype=jnp.int32)
    m = pltr.load(m_ref.at[r, h, sc[:, None], row[None, :]], mask=ok, other=NEG)
    l = pltr.load(l_ref.at[r, h, sc[:, None], row[None, :]], mask=ok, other=0.0)
    o = pltr.load(o_ref.at[r, h, sc[:, None, None], row[None, :, None], col[None, None, :]],
                  mask=ok[:, :, None], other=0.0)              # [S2, G2, hd]
    if has_sinks:
        sink = pltr.load(refs[0].at[h * group + jnp.minimum(g, group - 1)])     # [G2]
        top = jnp.maximum(jnp.max(m, axis=0), sink)
        w = jnp.exp(m - top[None, :])
        acc = jnp.sum(o * w[:, :, None], axis=0)
        den = jnp.sum(l * w, axis=0) + jnp.exp(sink - top)
    else:
        w = jnp.exp(m - jnp.max(m, axis=0)[None, :])
        acc = jnp.sum(o * w[:, :, None], axis=0)                  # [G2, hd]
        den = jnp.sum(l * w, axis=0)
    out = acc / jnp.where(den > 0, den, 1.0)[:, None]
    out_ref[...] = jnp.where(valid, out, 0.0).astype(out_ref.dtype)


def _merge(qsl: jax.Array, o: jax.Array, m: jax.Array, l: jax.Array, *, t_pad: int,
           num_heads: int, max_query_len: int, out_dtype, interpret: bool,
           sinks: jax.Array | None = None) -> jax.Array:
    """The split-K epilogue as one kernel: ``o [B, nkv, S, ROWS, hd]``, ``m``, ``l [B, nkv,
    S, ROWS]`` -> ``[t_pad, num_heads, hd]`` in ``out_dtype`` (replaces four XLA fusions:
    max, exp, two sums, the normalization and the gather back to token order); ``sinks
    [num_heads]`` float32 join the denominators."""
    b_pad, nkv, splits, rows, hd = o.shape
    group = num_heads // nkv
    g2 = pow2_at_least(group)
    kernel = functools.partial(_merge_kernel, b_pad=b_pad, group=group,
                               num_splits=splits, rows=rows, qmax=max_query_len,
                               **({} if sinks is None else dict(has_sinks=True)))
    out = pl.pallas_call(
        kernel,
        grid=(t_pad, nkv),
        out_specs=pl.BlockSpec((None, None, g2, hd), lambda t, h: (t, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((t_pad, nkv, g2, hd), out_dtype),
        compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name=f"paged_attention_merge_s{splits}{'' if sinks is None else '_sinks'}",
    )(qsl, o, m, l, *([] if sinks is None else [sinks]))
    # a power-of-two group (every usual model): the slice is a no-op and the reshape free
    return out[:, :, :group].reshape(t_pad, num_heads, hd)


def _write_kv_kernel(slot_ref, k_ref, v_ref, kc_in, vc_in, kc_ref, vc_ref, *, tokens: int,
                     num_tokens: int, num_slots: int):
    """Program ``i``: tokens ``i * tokens ..`` of ``k``, ``v [T, W]`` stored whole (every kv
    head, ``W = num_kv_heads * head_dim`` contiguous elements) at their slots of the caches
    ``[num_slots, W]``; slots ``< 0`` or ``>= num_slots`` dropped (:func:`_store_rows`)."""
    del kc_in, vc_in                                           # aliased to kc_ref, vc_ref
    ti = pl.program_id(0) * tokens + jnp.arange(tokens, dtype=jnp.int32)
    t_ok = ti < num_tokens
    tok = jnp.minimum(ti, num_tokens - 1)
    slot = pltr.load(slot_ref.at[tok], mask=t_ok, other=-1)
    col = jnp.arange(k_ref.shape[-1], dtype=jnp.int32)[None, :]

    def write(t, sl):
        pltr.store(kc_ref.at[sl[:, None], col], pltr.load(k_ref.at[t[:, None], col]))
        pltr.store(vc_ref.at[sl[:, None], col], pltr.load(v_ref.at[t[:, None], col]))

    _store_rows(t_ok & (slot >= 0) & (slot < num_slots), (tok, slot), write)


#: Tokens per program of :func:`write_kv` (docs/performance.md).
WRITE_TOKENS_PER_PROGRAM = 8


def write_kv_supported(cache_shape, dtype, k_dtype=None, v_dtype=None) -> bool:
    """Whether :func:`write_kv` takes a cache of this shape and dtype: a power-of-two row
    (``num_kv_heads * head_dim``) and the new values already in the cache's dtype."""
    w = int(np.prod(cache_shape[2:]))
    return (pltr is not None and w >= 16 and not (w & (w - 1))
            and all(d is None or jnp.dtype(d) == jnp.dtype(dtype) for d in (k_dtype, v_dtype)))


@functools.partial(jax.jit, static_argnames=("tokens_per_program", "interpret"))
def write_kv(k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array, *, tokens_per_program: int | None = None,
             interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """The step's ``k``, ``v [T, num_kv_heads, head_dim]`` stored into ``k_cache``, ``v_cache
    [num_blocks, block_size, num_kv_heads, head_dim]`` at ``slot_mapping [T]`` in one kernel
    (the caches aliased in and out): the same caches as two
    :func:`~specjax.kernels.paged_attention.kv_cache.scatter_slots` calls (slots ``< 0`` or
    past the cache dropped) when no two tokens share a slot."""
    if pltr is None:
        raise ValueError(f"the Pallas cache-write kernel is unavailable: {PLTR_MISSING}")
    nb, bs = k_cache.shape[:2]
    if v_cache.shape != k_cache.shape or k.shape[1:] != k_cache.shape[2:] or v.shape != k.shape:
        raise ValueError(f"k {k.shape}, v {v.shape} do not fit caches {k_cache.shape}, "
                         f"{v_cache.shape}")
    if not write_kv_supported(k_cache.shape, k_cache.dtype, k.dtype, v.dtype):
        raise ValueError(f"write_kv takes caches whose rows (num_kv_heads * head_dim = "
                         f"{int(np.prod(k_cache.shape[2:]))}) are a power of two >= 16 and "
                         f"k, v in their dtype ({k_cache.dtype}); got {k.dtype}, {v.dtype}")
    t = k.shape[0]
    if slot_mapping.shape != (t,):
        raise ValueError(f"slot_mapping {slot_mapping.shape} must be [T] = [{t}]")
    if t == 0:
        return k_cache, v_cache
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    w = int(np.prod(k_cache.shape[2:]))
    tb = pow2_at_least(min(tokens_per_program or WRITE_TOKENS_PER_PROGRAM, t))
    kc, vc = pl.pallas_call(
        functools.partial(_write_kv_kernel, tokens=tb, num_tokens=t, num_slots=nb * bs),
        grid=(cdiv(t, tb),),
        out_specs=[pl.no_block_spec, pl.no_block_spec],
        out_shape=[jax.ShapeDtypeStruct((nb * bs, w), k_cache.dtype)] * 2,
        input_output_aliases={3: 0, 4: 1},
        compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name=f"paged_kv_write_t{tb}",
    )(slot_mapping.astype(jnp.int32), k.reshape(t, w), v.reshape(t, w),
      k_cache.reshape(nb * bs, w), v_cache.reshape(nb * bs, w))
    return kc.reshape(k_cache.shape), vc.reshape(v_cache.shape)
