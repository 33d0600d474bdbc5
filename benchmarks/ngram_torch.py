"""vLLM v0.20's GPU n-gram matcher restated in PyTorch, for a same-process comparison.

``vllm_ngram_gpu`` follows ``NgramGPUKernel.forward`` / ``_find_first_and_extract_all_n_parallel``
as ``../shared/research/vllm_spec_decode.md`` §1.5 describes it: for each n in
[min_n, max_n] every length-n window (vLLM: ``unfold``; here n shifted slices of a padded
copy, the same comparison, as inductor failed on the original) is compared with the trailing n tokens;
a window counts only if at least one token follows it (start <= L - n - 1); the earliest
match per n, the largest n with a match wins; the drafts are the k tokens after the match,
-1 past the sequence end (no ``max_model_len`` cap), all -1 without a match or where the
mask is False. ``NgramProposerGPU`` compiles it with torch.compile (inductor) and no CUDA
graph; so does :func:`compiled`.

GPU machine only (torch is there, never in CI): ``python benchmarks/ngram.py --gpu --torch``
times it beside specjax's ``NgramGPUProposer.propose_arrays`` on the same buffers, and
:func:`check` compares the two matchers' drafts on random inputs first.
"""

from __future__ import annotations

import numpy as np


def vllm_ngram_gpu(num_tokens, token_ids, mask, min_n: int, max_n: int, k: int):
    """``(drafts [B, k] int32 (-1: none), num_drafts [B] int32)``; torch tensors in."""
    import torch

    b, t = token_ids.shape
    dev = token_ids.device
    lens = num_tokens.long()
    rows = torch.arange(b, device=dev)
    best_start = torch.full((b,), -1, dtype=torch.long, device=dev)
    best_n = torch.zeros((b,), dtype=torch.long, device=dev)
    # Every n compares windows at all t starts of a copy padded with max_n - 1 columns of
    # -2 (no token): a window running into the padding never matches, so this is vLLM's
    # ``unfold(1, n, 1) == tail`` over t - n + 1 starts. (Inductor in torch 2.11 failed,
    # "8253 v.s. 8254", fusing the per-n reductions of different widths.)
    padded = torch.cat([token_ids, torch.full((b, max_n - 1), -2, dtype=token_ids.dtype,
                                              device=dev)], dim=1)
    starts = torch.arange(t, device=dev)[None, :]
    for n in range(min_n, max_n + 1):
        tail_idx = (lens[:, None] - n + torch.arange(n, device=dev)[None, :]).clamp(min=0)
        tail = token_ids[rows[:, None], tail_idx]                         # [B, n]
        hit = padded[:, 0:t] == tail[:, 0:1]
        for j in range(1, n):
            hit = hit & (padded[:, j:j + t] == tail[:, j:j + 1])          # [B, T]
        hit = hit & (starts <= (lens[:, None] - n - 1)) & (lens[:, None] >= n)
        any_hit = hit.any(dim=1)
        first = torch.where(any_hit, hit.float().argmax(dim=1), torch.full_like(lens, -1))
        take = any_hit                                                    # larger n overrides
        best_start = torch.where(take, first, best_start)
        best_n = torch.where(take, torch.full_like(lens, n), best_n)
    found = (best_start >= 0) & mask.bool()
    pos = best_start[:, None] + best_n[:, None] + torch.arange(k, device=dev)[None, :]
    inside = found[:, None] & (pos < lens[:, None])
    drafts = token_ids[rows[:, None], pos.clamp(max=t - 1)]
    drafts = torch.where(inside, drafts, torch.full_like(drafts, -1)).to(torch.int32)
    return drafts, inside.sum(dim=1).to(torch.int32)


def compiled():
    """``vllm_ngram_gpu`` under torch.compile (inductor, no CUDA graph: vLLM's setting)."""
    import torch

    return torch.compile(vllm_ngram_gpu, dynamic=False)


def check(trials: int = 30, seed: int = 0) -> int:
    """Drafts of the torch matcher equal specjax's ``propose_arrays`` (with ``max_model_len``
    above every context, where the two rules coincide) on random small-vocabulary rows;
    returns the number of rows compared."""
    import jax.numpy as jnp
    import torch

    from specjax.proposers.ngram_gpu import NgramGPUProposer

    rng = np.random.default_rng(seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rows = 0
    for _ in range(trials):
        b, t = int(rng.integers(1, 9)), int(rng.integers(8, 65))
        min_n = int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 6))
        k = int(rng.integers(1, 6))
        tok = rng.integers(0, 4, (b, t)).astype(np.int32)
        lens = rng.integers(0, t + 1, b).astype(np.int32)
        mask = rng.random(b) < 0.9
        prop = NgramGPUProposer(num_speculative_tokens=k, max_model_len=4 * t,
                                prompt_lookup_min=min_n, prompt_lookup_max=max_n)
        ours = prop.propose_arrays(jnp.asarray(lens), jnp.asarray(tok), jnp.asarray(mask))
        d, n = vllm_ngram_gpu(torch.tensor(lens, device=dev), torch.tensor(tok, device=dev),
                              torch.tensor(mask, device=dev), min_n, max_n, k)
        want = [list(r[:c]) for r, c in zip(d.cpu().numpy().tolist(), n.cpu().numpy().tolist())]
        got = [list(r[:c]) for r, c in zip(np.asarray(ours.token_ids).tolist(),
                                           np.asarray(ours.num_drafts).tolist())]
        assert got == want, (tok.tolist(), lens.tolist(), mask.tolist(), min_n, max_n, k, got, want)
        rows += b
    return rows
