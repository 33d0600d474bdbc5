"""The copy-and-expand ops as one Mosaic GPU kernel each, written *pull* style.

Each program computes one chunk of 128 elements of one output (no masked stores); the grid
concatenates the chunks of every output (``sections``). The requests touching a chunk are a
contiguous run, found by binary search over ``query_start_loc`` and merged with selects.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from specjax.constants import PADDING_SLOT_ID
from specjax.kernels import _pallas as c

L = c.LANES


def _sections(*counts: int):
    """Program ranges ``[(first, count)]`` of consecutive grid sections."""
    out, first = [], 0
    for n in counts:
        out.append((first, n))
        first += n
    return out, first


def _in_section(g, section, fn):
    first, count = section
    pl.when((g >= first) & (g < first + count))(lambda: fn(g - first))


def _run_over_requests(qsl_ref, n, lo_key, hi_bound, body, carry):
    """Fold ``body(r, start, next_start, carry) -> carry`` over the real requests that can
    touch a chunk.

    Request r spans ``[key(r), key(r + 1))`` with ``key(r) = qsl[r] + r * extra`` (its
    output range when ``extra`` is the per-request growth, its tokens when 0). With
    ``lo_key = (extra, bound)``, the fold starts at the request owning ``bound`` (found by
    binary search; the first request if none does) and runs while ``key(r) < hi_bound``.
    ``start, next_start = qsl[r], qsl[r + 1]``.
    """
    extra, bound = lo_key
    first = jnp.maximum(c.count_le(lambda r: qsl_ref[r] + r * extra, n, bound) - 1, 0)

    def cond(state):
        r, start, _ = state
        return (r < n) & (start + r * extra < hi_bound)

    def step(state):
        r, start, inner = state
        next_start = qsl_ref[r + 1]
        return r + 1, next_start, body(r, start, next_start, inner)

    _, _, carry = lax.while_loop(cond, step, (first, qsl_ref[first], carry))
    return carry


# ============================================================================ EAGLE


def _eagle_body(ids_ref, pos_ref, next_ref, qsl_ref, qel_ref, n_ref,
                ids_out, pos_out, rej_out, msk_out, new_idx_out, map_out, *,
                rows, num_tokens, num_output_tokens, p, shift, padding_token_id,
                parallel_drafting_token_id, sections):
    g = c.program_id()
    lane = c.lanes()
    n = c.num_real(n_ref, rows)
    extra = p - shift  # request r's output starts at qsl[r] + r * extra

    def output_chunk(k):
        b0 = k * L
        o = b0 + lane

        def request(r, start, next_start, acc):
            ids, pos, rej, msk = acc
            end = qel_ref[r]
            bonus = next_ref[r]
            first_pos = pos_ref[jnp.clip(start, 0, num_tokens - 1)]
            out_start = start + r * extra
            j = o - out_start
            mine = (j >= 0) & (j < next_start - start + extra)
            v = end - start + 1 - shift
            # Lane i reads target_token_ids[start + shift + j]; ids_ref has L zeros in front.
            src = jnp.clip(b0 - out_start + start + shift + L, 0, num_tokens + L)
            copied = ids_ref[c.chunk(src)]
            is_rej = j >= v + p
            is_msk = (j > v) & (j < v + p)
            tok = jnp.where(j < v, copied, bonus)
            tok = jnp.where(j > v, parallel_drafting_token_id, tok)
            tok = jnp.where(is_rej, padding_token_id, tok)
            return (jnp.where(mine, tok, ids),
                    jnp.where(mine, jnp.where(is_rej, 0, first_pos + j), pos),
                    jnp.where(mine, is_rej.astype(c.I32), rej),
                    jnp.where(mine, is_msk.astype(c.I32), msk))

        zero = c.full(0)
        ids, pos, rej, msk = _run_over_requests(
            qsl_ref, n, (extra, b0), b0 + L, request, (zero, zero, zero, zero))
        ids_out[c.chunk(b0)] = ids
        pos_out[c.chunk(b0)] = pos
        rej_out[c.chunk(b0)] = rej.astype(jnp.int8)
        msk_out[c.chunk(b0)] = msk.astype(jnp.int8)

    def token_chunk(k):
        t0 = k * L
        t = t0 + lane

        def request(r, start, next_start, acc):
            mine = (t >= start) & (t < next_start)
            return jnp.where(mine, t + r * extra, acc)

        mapping = _run_over_requests(
            qsl_ref, n, (0, t0), t0 + L, request, c.full(num_output_tokens))
        map_out[c.chunk(t0)] = mapping

    def request_chunk(k):
        r0 = k * L
        r = r0 + lane
        real = r < n
        # out_start + V + q = end + r * extra + 1 - shift + q (start cancels).
        base = qel_ref[c.chunk(r0)] + r * extra + (1 - shift)
        for q in range(p):
            new_idx_out[c.chunk(r0), q] = jnp.where(real, base + q, 0)

    _in_section(g, sections[0], output_chunk)
    _in_section(g, sections[1], token_chunk)
    _in_section(g, sections[2], request_chunk)


@functools.partial(
    jax.jit,
    static_argnames=("padding_token_id", "parallel_drafting_token_id",
                     "num_padding_slots_per_request", "shift_input_ids", "num_output_tokens"),
)
def copy_and_expand_eagle_inputs(target_token_ids, target_positions, next_token_ids,
                                 query_start_loc, query_end_loc, *, padding_token_id,
                                 parallel_drafting_token_id, num_padding_slots_per_request,
                                 shift_input_ids, num_output_tokens, num_reqs):
    t = target_token_ids.shape[0]
    r = next_token_ids.shape[0]
    p = num_padding_slots_per_request
    n_out = num_output_tokens
    # At least one chunk per output so that every program has a place to write.
    out_chunks, tok_chunks, req_chunks = (max(c.cdiv(x, L), 1) for x in (n_out, t, r))
    sections, programs = _sections(out_chunks, tok_chunks, req_chunks)
    tp = max(t, 1)  # refs need an element; with t == 0 no real request can exist
    body = functools.partial(
        _eagle_body, rows=r, num_tokens=tp, num_output_tokens=n_out, p=p,
        shift=1 if shift_input_ids else 0, padding_token_id=padding_token_id,
        parallel_drafting_token_id=parallel_drafting_token_id, sections=sections)
    out_type = (
        jax.ShapeDtypeStruct((out_chunks * L,), c.I32),
        jax.ShapeDtypeStruct((out_chunks * L,), c.I32),
        jax.ShapeDtypeStruct((out_chunks * L,), jnp.int8),
        jax.ShapeDtypeStruct((out_chunks * L,), jnp.int8),
        jax.ShapeDtypeStruct((req_chunks * L, p), c.I32),
        jax.ShapeDtypeStruct((tok_chunks * L,), c.I32),
    )
    ids, pos, rej, msk, new_idx, mapping = c.run_kernel(
        body, out_type, programs, "copy_and_expand_eagle_inputs"
    )(
        # A window of L lanes may start up to L - 1 before the first token or end L - 1
        # past the last: L zeros on both sides keep every window in bounds.
        c.pad_rows(target_token_ids, tp + 2 * L, before=L),
        c.pad_rows(target_positions, tp),
        c.pad_rows(next_token_ids, max(r, 1)),
        query_start_loc,
        c.pad_rows(query_end_loc, req_chunks * L),
        num_reqs.reshape(1),
    )
    return (c.head(ids, n_out), c.head(pos, n_out), c.as_mask(c.head(rej, n_out)),
            c.as_mask(c.head(msk, n_out)), c.head(new_idx, r).reshape(r * p),
            c.head(mapping, t))


# ============================================================================ DFlash


def _dflash_body(next_ref, pos_ref, bt_ref, qsl_ref, rej_ref, n_ref,
                 ids_out, ctx_pos_out, q_pos_out, ctx_slot_out, q_slot_out, sample_out, *,
                 rows, num_tokens, num_blocks, block_size, k, pd_token, has_rejected, sections):
    g = c.program_id()
    lane = c.lanes()
    n = c.num_real(n_ref, rows)
    q_len = 1 + k

    def context_chunk(kk):
        t0 = kk * L
        t = t0 + lane
        positions = pos_ref[c.chunk(t0)]
        block = jnp.minimum(lax.div(positions, block_size), num_blocks - 1)

        def request(r, start, next_start, acc):
            live, base = acc
            mine = (t >= start) & (t < next_start)

            # One scalar load per distinct block of this request's lanes (few: context
            # positions are consecutive), smallest block first.
            def smallest(pending):
                return jnp.min(jnp.where(pending, block, c.BIG))

            def more(state):
                _, _, col = state
                return col < c.BIG

            def fetch(state):
                pending, base, col = state
                entry = bt_ref[r, jnp.clip(col, 0, num_blocks - 1)]
                hit = pending & (block == col)
                pending = pending & (block != col)  # not `& ~hit`: no bool `~` on Mosaic GPU
                return pending, jnp.where(hit, entry, base), smallest(pending)

            _, base, _ = lax.while_loop(more, fetch, (mine, base, smallest(mine)))
            return live | mine, base

        live, base = _run_over_requests(
            qsl_ref, n, (0, t0), t0 + L, request, (c.full(0) != 0, c.full(0)))
        ctx_pos_out[c.chunk(t0)] = jnp.where(live, positions, 0)
        slot = base * block_size + lax.rem(positions, block_size)
        ctx_slot_out[c.chunk(t0)] = jnp.where(live, slot, PADDING_SLOT_ID)

    def request_chunk(kk):
        r0 = kk * L
        r = r0 + lane
        real = r < n
        last = qsl_ref[c.chunk(r0 + 1)] - 1
        if has_rejected:
            last = last - rej_ref[c.chunk(r0)]
        last = jnp.clip(last, 0, num_tokens - 1)

        # Gather, per real row: the position at `last`, then the block-table entry of each
        # distinct block its q_len query positions fall in.
        def row(i, acc):
            last_pos, bases = acc
            lp = pos_ref[c.extract(last, i)]
            here = lane == i
            entries, prev_block, prev_entry = [], None, None
            for q in range(q_len):
                blk = jnp.minimum(lax.div(lp + 1 + q, block_size), num_blocks - 1)
                if prev_block is None:
                    entry = bt_ref[r0 + i, blk]
                else:
                    entry = lax.cond(blk == prev_block, lambda e=prev_entry: e,
                                     lambda b=blk: bt_ref[r0 + i, b])
                entries.append(entry)
                prev_block, prev_entry = blk, entry
            bases = tuple(jnp.where(here, e, b) for e, b in zip(entries, bases))
            return jnp.where(here, lp, last_pos), bases

        real_here = jnp.clip(n - r0, 0, L)
        zero = c.full(0)
        last_pos, bases = lax.fori_loop(0, real_here, row, (zero, (zero,) * q_len))
        next_ids = next_ref[c.chunk(r0)]
        for q in range(q_len):
            qpos = last_pos + 1 + q
            ids_out[c.chunk(r0), q] = jnp.where(real, next_ids if q == 0 else pd_token, 0)
            q_pos_out[c.chunk(r0), q] = jnp.where(real, qpos, 0)
            slot = bases[q] * block_size + lax.rem(qpos, block_size)
            q_slot_out[c.chunk(r0), q] = jnp.where(real, slot, PADDING_SLOT_ID)
            if q >= 1:
                sample_out[c.chunk(r0), q - 1] = jnp.where(real, r * q_len + q, 0)

    _in_section(g, sections[0], context_chunk)
    _in_section(g, sections[1], request_chunk)


@functools.partial(
    jax.jit,
    static_argnames=("parallel_drafting_token_id", "block_size", "num_speculative_tokens"),
)
def copy_and_expand_dflash_inputs(next_token_ids, target_positions, block_table, query_start_loc,
                                  num_rejected_tokens, *, parallel_drafting_token_id, block_size,
                                  num_speculative_tokens, num_reqs):
    t = target_positions.shape[0]  # >= 1 (checked by the dispatcher)
    r, num_blocks = block_table.shape
    k = num_speculative_tokens
    q_len = 1 + k
    tok_chunks, req_chunks = c.cdiv(t, L), max(c.cdiv(r, L), 1)
    sections, programs = _sections(tok_chunks, req_chunks)
    rp = req_chunks * L
    has_rejected = num_rejected_tokens is not None
    rejected = num_rejected_tokens if has_rejected else jnp.zeros((1,), c.I32)
    body = functools.partial(
        _dflash_body, rows=r, num_tokens=t, num_blocks=num_blocks, block_size=block_size, k=k,
        pd_token=parallel_drafting_token_id, has_rejected=has_rejected, sections=sections)
    per_query = jax.ShapeDtypeStruct((rp, q_len), c.I32)
    per_token = jax.ShapeDtypeStruct((tok_chunks * L,), c.I32)
    out_type = (per_query, per_token, per_query, per_token, per_query,
                jax.ShapeDtypeStruct((rp, k), c.I32))
    ids, ctx_pos, q_pos, ctx_slot, q_slot, sample = c.run_kernel(
        body, out_type, programs, "copy_and_expand_dflash_inputs"
    )(
        c.pad_rows(next_token_ids, rp),
        c.pad_rows(target_positions, tok_chunks * L),
        block_table if r > 0 else jnp.zeros((1, num_blocks), c.I32),
        c.pad_rows(query_start_loc, rp + 1),
        c.pad_rows(rejected, rp) if has_rejected else rejected,
        num_reqs.reshape(1),
    )
    return (c.head(ids, r).reshape(r * q_len), c.head(ctx_pos, t),
            c.head(q_pos, r).reshape(r * q_len), c.head(ctx_slot, t),
            c.head(q_slot, r).reshape(r * q_len), c.head(sample, r).reshape(r * k))
