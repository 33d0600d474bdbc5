"""The pure jax.numpy reference of paged attention (the ``"xla"`` backend): the
specification the kernels are tested against, and the CPU path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.attention_metadata import CommonAttentionMetadata
from specjax.kernels.paged_attention.kv_cache import KVCache


def paged_attention_xla(q: jax.Array, cache: KVCache, md: CommonAttentionMetadata, *,
                        scale: float) -> jax.Array:
    """The pure jax.numpy reference of :func:`paged_attention` (the ``"xla"`` backend)."""
    t_pad, nh, hd = q.shape
    nb, bs, nkv, _ = cache.k.shape
    group = nh // nkv
    b_pad = md.query_start_loc.shape[0] - 1
    qmax = max(int(md.max_query_len), 1)
    max_blocks = md.block_table.shape[1]
    ctx = max_blocks * bs

    qsl = md.query_start_loc
    qlen = qsl[1:] - qsl[:-1]                                   # [B]
    seq = md.seq_lens                                           # [B]

    # queries laid out per request: [B, Q, nkv, G, hd]
    qi = jnp.arange(qmax, dtype=jnp.int32)
    tok = jnp.clip(qsl[:-1, None] + qi[None, :], 0, t_pad - 1)
    q_valid = qi[None, :] < qlen[:, None]                       # [B, Q]
    qr = q[tok].reshape(b_pad, qmax, nkv, group, hd)

    # K/V of each request, kv-head major: [B, nkv, C, hd], so both dots below are plain
    # batched GEMMs over (request, kv head) with the head dim minor in q and K (gathered as
    # [B, C, nkv, hd], XLA:CPU would copy K transposed element by element in every layer).
    table = jnp.clip(md.block_table, 0, nb - 1)
    kr = jnp.swapaxes(cache.k[table].reshape(b_pad, ctx, nkv, hd), 1, 2)
    vr = jnp.swapaxes(cache.v[table].reshape(b_pad, ctx, nkv, hd), 1, 2)
    # the queries of each (request, kv head): its G heads x Q tokens as rows, [B, nkv, G*Q, hd]
    qh = jnp.transpose(qr, (0, 2, 3, 1, 4)).reshape(b_pad, nkv, group * qmax, hd)

    kj = jnp.arange(ctx, dtype=jnp.int32)
    mask = q_valid[:, :, None] & (kj[None, None, :] < seq[:, None, None])
    if md.tree_mask is not None:
        tm = jnp.asarray(np.asarray(md.tree_mask, dtype=bool))   # [Qt, Qt]
        qt = tm.shape[0]
        rel = kj[None, :] - (seq - qlen)[:, None]                # [B, C]: index in the block
        allowed = tm[jnp.clip(qi, 0, qt - 1)[None, :, None],
                     jnp.clip(rel, 0, qt - 1)[:, None, :]]           # [B, Q, C]
        mask = mask & ((rel < 0)[:, None, :] | ((rel < qt)[:, None, :] & allowed))
    elif md.causal:
        qpos = seq[:, None] - qlen[:, None] + qi[None, :]       # [B, Q]
        mask = mask & (kj[None, None, :] <= qpos[:, :, None])

    s = _product("bkxd,bkcd->bkxc", qh, kr) * scale             # [B, nkv, G*Q, C]
    s = s.reshape(b_pad, nkv, group, qmax, ctx)                 # [B, nkv, G, Q, C]
    s = jnp.where(mask[:, None, None], s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1).reshape(b_pad, nkv, group * qmax, ctx)
    o = _product("bkxc,bkcd->bkxd", p.astype(vr.dtype), vr)  # [B, nkv, G*Q, hd]
    o = jnp.transpose(o.reshape(b_pad, nkv, group, qmax, hd), (0, 3, 1, 2, 4))
    o = o.reshape(b_pad, qmax, nh, hd)

    # back to token order
    t = jnp.arange(t_pad, dtype=jnp.int32)
    # request of token t = number of request ends <= t (B_pad is small: a compare beats a search)
    r_t = jnp.minimum(jnp.sum(qsl[None, 1:] <= t[:, None], axis=1, dtype=jnp.int32), b_pad - 1)
    i_t = jnp.clip(t - qsl[r_t], 0, qmax - 1)
    out = o[r_t, i_t]
    valid = t < qsl[-1]
    return jnp.where(valid[:, None, None], out, 0).astype(q.dtype)


# The two batched products, ``[B, nkv, x, *]`` rows with x = G * Q (query heads per kv head
# times queries per request). On a CPU, when every request has one query and its kv head
# serves at most two query heads (x <= 2: a decoding step, a drafter's later passes),
# they take their row operand transposed ([B, nkv, *, x]): XLA:CPU then runs them with its
# own dot instead of YNNPACK, whose fixed cost per call dominates products this small
# (docs/performance.md). The choice is made per platform when the program is lowered; the
# GPU program is unchanged. Both forms compute the same sums (summation order aside).
_CPU_TRANSPOSED_MAX_ROWS = 2


def _product(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """``jnp.einsum(spec, a, b)`` in float32, ``spec`` a ``"bkx?,bk??->bkx?"`` batched
    product with the rows ``x`` third in ``a``; on a CPU at ``x <= 2`` with ``a``'s last
    two axes swapped (``"bk?x,..."``: the same sums, XLA:CPU's own dot)."""
    lhs, rest = spec.split(",")

    def rows(a, b):
        return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)

    def transposed(a, b):
        return jnp.einsum(f"{lhs[:2]}{lhs[3]}{lhs[2]},{rest}", jnp.swapaxes(a, 2, 3), b,
                          preferred_element_type=jnp.float32)

    if a.shape[2] > _CPU_TRANSPOSED_MAX_ROWS:
        return rows(a, b)
    return jax.lax.platform_dependent(a, b, cpu=transposed, default=rows)
