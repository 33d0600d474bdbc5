"""Chain rejection sampling: verify drafts against the target (vLLM ``rejection_sampler.py``).

Greedy rows accept while the draft equals the target argmax; random rows accept ``x`` when
``p_target(x) / p_draft(x) >= u`` and on rejection sample the normalized residual
``max(p_target - p_draft, 0)``. specjax's proposers draft greedily and pass no draft
probabilities (``p_draft(x) = 1``), as vLLM's do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.metadata import SpecDecodeMetadata
from specjax.sampling.metadata import (_STREAM_ACCEPT, _STREAM_BONUS, _STREAM_RECOVER,
                                       GREEDY_TEMPERATURE, MAX_SPEC_LEN, PLACEHOLDER_TOKEN_ID,
                                       SamplingMetadata, _keys, _post, _pre, _process)

def _chain_prefix(drafts: jax.Array, t: int):
    """Chain verification: position j's prefix is the request's first j drafts."""
    b, k = drafts.shape
    tok = jnp.broadcast_to(drafts[:, None, :], (b, t, k))
    return tok, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (b, t))


def sample_tokens(logits: jax.Array, sampling: SamplingMetadata,
                  prefix_tokens: jax.Array | None = None, prefix_len: jax.Array | None = None
                  ) -> jax.Array:
    """The bonus-position sampler: ``[B, V]`` -> ``[B] int32``, argmax for greedy rows, else
    the exponential trick (``argmax p / q``, ``q ~ Exp(1)``) keyed per request;
    ``prefix_tokens [B, D]`` / ``prefix_len [B]``: the drafts before the position.
    """
    logits = logits.astype(jnp.float32)
    if sampling.procs is None:       # the plain program
        greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        if sampling.all_greedy:
            return greedy
        probs = jax.nn.softmax(_process(logits, sampling.temperature, sampling.top_k,
                                        sampling.top_p), -1)
    else:
        if prefix_tokens is not None:
            prefix_tokens, prefix_len = prefix_tokens[:, None], prefix_len[:, None]
        pre = _pre(logits[:, None], sampling, prefix_tokens, prefix_len)
        greedy = jnp.argmax(pre[:, 0], axis=-1).astype(jnp.int32)
        if sampling.all_greedy:
            return greedy
        probs = jax.nn.softmax(_post(pre, sampling)[:, 0], -1)
    keys = _keys(sampling.keys, _STREAM_BONUS, 0)
    q = jax.vmap(lambda k: jax.random.exponential(k, (logits.shape[-1],)))(keys)
    sampled = jnp.argmax(probs / q, axis=-1).astype(jnp.int32)
    return jnp.where(sampling.temperature == GREEDY_TEMPERATURE, greedy, sampled)


@jax.jit
def rejection_sample(
    metadata: SpecDecodeMetadata,
    draft_probs: jax.Array | None,
    logits: jax.Array,
    sampling: SamplingMetadata,
    synthetic_conditional_rates: jax.Array | None = None,
) -> jax.Array:
    """Verify the drafts of a batch: ``[B_pad, max_spec_len + 1] int32``, accepted drafts
    then the recovered or bonus token, -1 after (padding rows all -1).

    ``metadata``: where the drafts are (static ``max_spec_len <= MAX_SPEC_LEN``);
    ``draft_probs [N_pad, V]``, ``[B_pad, K', V']`` per row, or None (certain drafts); ``logits [N_pad + B_pad, V]`` rows
    as ``metadata.logits_indices``; ``synthetic_conditional_rates [max_spec_len]`` float32
    for vLLM's synthetic mode (``[B_pad, max_spec_len]``: per row), or None.
    """
    k = metadata.max_spec_len
    if k > MAX_SPEC_LEN:
        raise ValueError(f"max_spec_len={k} exceeds MAX_SPEC_LEN={MAX_SPEC_LEN}")
    b = metadata.num_draft_tokens.shape[0]
    v = logits.shape[-1]
    n_draft = metadata.num_draft_tokens
    rows = jnp.arange(b, dtype=jnp.int32)
    real = rows < metadata.num_reqs
    start = metadata.cu_num_draft_tokens - n_draft                    # exclusive cumsum
    j = jnp.arange(k, dtype=jnp.int32)
    has = j[None, :] < n_draft[:, None]                               # [B, K]
    flat = jnp.where(has, start[:, None] + j[None, :], 0)
    n_pad = metadata.draft_token_ids.shape[0]
    flat = jnp.clip(flat, 0, max(n_pad - 1, 0))
    drafts = metadata.draft_token_ids[flat] if n_pad else jnp.zeros((b, k), jnp.int32)
    tgt_rows = metadata.target_logits_indices[flat] if n_pad else jnp.zeros((b, k), jnp.int32)
    tgt_logits = logits[tgt_rows].astype(jnp.float32)                 # [B, K, V]
    bonus_logits = logits[metadata.bonus_logits_indices]              # [B, V]
    greedy_row = sampling.temperature == GREEDY_TEMPERATURE
    safe_drafts = jnp.clip(drafts, 0, v - 1)
    if sampling.procs is not None:     # position j sees drafts[:j] as output; bonus all
        if k:
            tgt_logits = _pre(tgt_logits, sampling, *_chain_prefix(safe_drafts, k))
        bonus = sample_tokens(bonus_logits, sampling, safe_drafts, n_draft)
    else:
        bonus = sample_tokens(bonus_logits, sampling)
    tgt_argmax = jnp.argmax(tgt_logits, axis=-1).astype(jnp.int32)

    if synthetic_conditional_rates is not None:
        u = jax.vmap(lambda kk: jax.random.uniform(kk, (k,)))(_keys(sampling.keys, _STREAM_ACCEPT, 0))
        r = synthetic_conditional_rates
        synth_accept = u < (r[None, :k] if r.ndim == 1 else r[:, :k])

    # --- greedy rows
    if synthetic_conditional_rates is None:
        accept_g = drafts == tgt_argmax
    else:
        accept_g = synth_accept
    recovered_g = tgt_argmax

    if sampling.all_greedy:
        accept, recovered = accept_g, recovered_g
    else:
        # --- random rows
        proc = _post(tgt_logits, sampling)
        tgt_probs = jax.nn.softmax(proc, axis=-1)
        p_t = jnp.take_along_axis(tgt_probs, safe_drafts[..., None], axis=-1)[..., 0]
        if draft_probs is None:
            p_d = jnp.ones_like(p_t)
            residual = jnp.where(jnp.arange(v)[None, None, :] == safe_drafts[..., None], 0.0, tgt_probs)
        else:
            dprobs = _rows(draft_probs, k, v) if draft_probs.ndim == 3 else \
                draft_probs[flat].astype(jnp.float32)                   # [B, K, V]
            p_d = jnp.take_along_axis(dprobs, safe_drafts[..., None], axis=-1)[..., 0]
            residual = jnp.maximum(tgt_probs - dprobs, 0.0)
        if synthetic_conditional_rates is None:
            u = jax.vmap(lambda kk: jax.random.uniform(kk, (k,)))(
                _keys(sampling.keys, _STREAM_ACCEPT, 0))
            ratio = p_t / jnp.where(p_d > 0, p_d, 1.0)
            accept_r = (p_d > 0) & (ratio >= u)
        else:
            accept_r = synth_accept
        qkeys = _keys(sampling.keys, _STREAM_RECOVER, j)                  # [B, K] keys
        q = jax.vmap(jax.vmap(lambda kk: jax.random.exponential(kk, (v,))))(qkeys)
        recovered_r = jnp.argmax(residual / q, axis=-1).astype(jnp.int32)
        accept = jnp.where(greedy_row[:, None], accept_g, accept_r)
        recovered = jnp.where(greedy_row[:, None], recovered_g, recovered_r)

    # Leading accepted drafts; the first rejection emits the recovered token.
    accepted_prefix = jnp.cumprod((accept & has).astype(jnp.int32), axis=1).astype(bool)
    n_acc = accepted_prefix.sum(axis=1)                                # [B]
    out = jnp.full((b, k + 1), PLACEHOLDER_TOKEN_ID, jnp.int32)
    jj = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    drafts_ext = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)
    rec_ext = jnp.concatenate([recovered, jnp.zeros((b, 1), jnp.int32)], axis=1)
    all_acc = n_acc == n_draft
    out = jnp.where(jj < n_acc[:, None], drafts_ext, out)
    out = jnp.where((jj == n_acc[:, None]) & ~all_acc[:, None], rec_ext, out)
    out = jnp.where((jj == n_draft[:, None]) & all_acc[:, None], bonus[:, None], out)
    return jnp.where(real[:, None], out, PLACEHOLDER_TOKEN_ID)


def unconditional_to_conditional_rates(rates) -> list[float]:
    """vLLM's synthetic-mode helper: ``out[i] = rates[i] / rates[i-1]`` (``rates[-1] = 1``),
    0 where the denominator is 0."""
    out, prev = [], 1.0
    for r in rates:
        out.append(0.0 if prev == 0 else float(r) / prev)
        prev = float(r)
    return out


def parse_output(output_token_ids, vocab_size: int, discard_req_indices=()) -> list[list[int]]:
    """Host-side: keep entries that are not -1 and below vocab; empty discarded rows."""
    import numpy as np

    arr = np.asarray(output_token_ids)
    out = [[int(t) for t in row if t != PLACEHOLDER_TOKEN_ID and t < vocab_size] for row in arr]
    for i in discard_req_indices:
        out[i] = []
    return out


def _rows(probs: jax.Array, k: int, v: int) -> jax.Array:
    """Per-row ``probs [B, K', V']`` as ``[B, k, v]`` float32 (cut, or zero-padded)."""
    p = probs[:, :k, :v].astype(jnp.float32)
    return jnp.pad(p, ((0, 0), (0, k - p.shape[1]), (0, v - p.shape[2])))
