"""Sampling under speculation: sampling metadata and logits processing
(:mod:`~specjax.sampling.metadata`, :mod:`~specjax.sampling.logits_processors`), chain
rejection sampling (:mod:`~specjax.sampling.rejection`), tree verification
(:mod:`~specjax.sampling.tree`) and logprobs (:mod:`~specjax.sampling.logprobs`)."""

from specjax.sampling.metadata import (GREEDY_TEMPERATURE, MAX_SPEC_LEN, PLACEHOLDER_TOKEN_ID,
                                       SamplingMetadata, SamplingState, apply_top_k_top_p,
                                       process_logits)
from specjax.sampling.rejection import (parse_output, rejection_sample, sample_tokens,
                                        unconditional_to_conditional_rates)
from specjax.sampling.tree import tree_greedy_verify, tree_rejection_sample

__all__ = ["GREEDY_TEMPERATURE", "MAX_SPEC_LEN", "PLACEHOLDER_TOKEN_ID", "SamplingMetadata",
           "SamplingState", "apply_top_k_top_p", "process_logits", "parse_output",
           "rejection_sample", "sample_tokens", "unconditional_to_conditional_rates",
           "tree_greedy_verify", "tree_rejection_sample"]
