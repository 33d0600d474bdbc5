"""Reference decoding loop: batched speculative decoding with any proposer.

``generate(target, proposer, prompts, sampling_params)`` runs the loop a serving engine
runs (vLLM v1's scheduler + GPU model runner, reduced to what speculative decoding needs):

1. **Schedule (host).** Admit waiting requests while there is a free row and enough KV
   blocks; every running request is scheduled each step: its uncomputed tokens (the whole
   prompt at prefill, else the last sampled token) followed by its drafts. Blocks of the
   paged KV cache are allocated as the request grows (block 0 is a never-allocated null
   block that padding entries of the block table point at) and freed when it finishes.
2. **Step (device): the public step**, ``specjax.runtime.step.make_step(target, proposer)``, on a
   batch from ``specjax.runtime.batch.build_batch``: target forward over the ragged batch (paged
   KV cache written through the slot mapping), ``specjax.sampling.rejection_sample``, and,
   as the proposer's ``feed.drafts_in`` says, its ``propose`` in the same compiled step
   (``"step"``) or in a second call after vLLM's host ``prepare_inputs`` (``"split"``),
   with the KV caches and the proposer state donated. Shapes are padded to buckets
   (requests, query length, context blocks), so the step compiles once per bucket.
3. **Commit (host).** Accepted tokens and the bonus / recovered token are appended;
   requests stop on a stop token, ``max_tokens`` or ``max_model_len``. Token-history
   proposers (``feed.drafts_in == "history"``: n-gram, suffix) draft now, from the
   updated histories.

Plain (non-speculative) decoding is the same loop with ``proposer=None``: one token per
request per step, sampled by the same sampler. Greedy speculative decoding emits exactly
the tokens of plain greedy decoding (``tests/engine/test_engine.py`` proves it for every method).

**Tree verification** (specjax's own; vLLM v0.20 verifies every draft as a chain). When
the proposer's ``token_tree`` branches (EAGLE / EAGLE-3 with a
``speculative_token_tree``; ``Engine(tree_verification=True)`` forces it for a chain), a
step in which every request has one uncomputed token verifies trees: each request's
query block is ``[root, node 0, ..., node n-1]`` (root = the last committed token at
position ``p``; node ``j`` at position ``p + depth(j)``, its KV at logical position
``p + 1 + j``) under the tree's ancestor mask (``CommonAttentionMetadata.tree_mask``);
``specjax.sampling.tree_rejection_sample`` walks the tree from the root (greedy rows on the
target's argmax, random rows by multi-draft rejection sampling over each node's drafted
children, lossless; per-request keys as in a chain step); the accepted nodes' KV is
moved to ``p + 1 .. p + m`` (``compact_tree_kv``); and
the proposer drafts the next tree from the chain-shaped batch chain drafting would have
given it (``tree_chain_inputs``), all inside the jitted step. The tree mask is static
for the whole batch and prompts need causal attention, so a step that prefills a prompt
is a chain step in which no request verifies drafts (decoding requests verify just their
root, gaining one token, and are redrafted). Near the end of a request it verifies a
breadth-first prefix of its tree (every ancestor of a node precedes it): the levels it
can still use (``max_tokens`` / ``max_model_len``), at most as many nodes as KV slots
remain before ``max_model_len``; possibly none (root only). Greedy and random
(``temperature > 0``, top-k / top-p, seeded) requests mix as in chain steps;
``rejection_sample_method='synthetic'`` is refused with a tree. (A seeded random request
is reproducible, but in tree mode its tokens may depend on the rest of the batch: whether
a step verifies a tree does, and a tree step draws from other key streams than a chain
step without drafts; its distribution does not.) Metrics: a request-step counts its
deepest verified level as its draft tokens (the most it can accept) and the accepted
path's levels as accepted positions (``SpecDecodingStats.num_spec_tokens`` = the tree's
depth); a chain tree gives exactly chain verification's numbers.

Not supported (yet): chunked prefill, preemption (admission reserves each request's
worst-case block count instead), synthetic acceptance with tree verification, penalties and
other logits processors (see ``specjax.sampling``). Logprobs: ``SamplingParams.logprobs`` and
``Engine(logprobs_mode=...)`` (``specjax.sampling.logprobs``).
"""

from __future__ import annotations

from specjax.engine.loop import Engine, generate
from specjax.engine.types import GenerateResult, RequestOutput, SamplingParams, TargetModel
from specjax.runtime.step import step_cache_size

__all__ = ["SamplingParams", "RequestOutput", "GenerateResult", "TargetModel", "Engine",
           "generate", "step_cache_size"]
