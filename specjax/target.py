"""``Target``: the protocol of a target model, everything specjax reads of it.

``specjax.models.DecoderLM`` is one implementation; any object with these members runs in
``make_step``, ``Engine``, ``generate`` and ``make_proposer`` (chain verification on one
device; :func:`check_target` says what is refused). docs/integration.md, "Bring your own
model"."""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

from specjax.checks import ArgumentTypeError

__all__ = ["Target", "TARGET_MEMBERS", "check_target", "has_accept", "has_move_kv"]


@runtime_checkable
class Target(Protocol):
    """A target model as specjax reads it (hashable: it is a static argument of the step).

    Members:
      vocab_size, hidden_size, num_layers: ints (vocabulary checks, drafter shapes, the
        EAGLE-3 default aux layers).
      aux_layer_ids: layer ids whose *input* (the residual stream before the layer)
        ``forward`` returns as ``aux`` (EAGLE-3 / DFlash read them); ``with_aux_layers(ids)``:
        a copy returning those layers (how a caller asks for them).
      forward(params, input_ids [T] int32, positions [T] int32, kv, attn) -> (hidden [T, H],
        aux [T, n_aux, H] or None, kv): ``attn`` a ``CommonAttentionMetadata`` (write this
        step's KV through ``attn.slot_mapping``, -1 dropped; read context through
        ``block_table`` / ``seq_lens`` / ``query_start_loc``); ``hidden`` the final-norm output
        of EVERY token (drafters prefill from them).
      compute_logits(params, hidden [N, H]) -> [N, V'] with V' >= vocab_size (the sampler).
      init_kv_caches(num_blocks, block_size, dtype) -> kv and kv_bytes_per_block(block_size,
        dtype) -> int: for callers that let specjax allocate (Engine's memory check).
      shared_weights(params) -> {"embed_tokens": {"embedding": [V, H]}, "lm_head": {"kernel":
        [H, V]} or {"embedding": [V, H]}}: the target's own arrays, shared into drafters
        (EAGLE, EAGLE-3, DFlash, MTP) without their own.
      recurrent: True for state carried across steps (linear attention, SSMs): needs accept.
      Optional move_kv(kv, src_slots [N], dst_slots [N]) -> kv: copy the KV of each source
        slot to its destination (-1: none); tree verification's compaction, refused without it.
      Optional accept(kv, num_kept [B] int32, attn) -> kv: after a chain step's verification,
        each request's recurrent state as after its first num_kept scheduled tokens (0: padding
        row); a token at slot_mapping -1 must not advance it. Tree verification is refused."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    aux_layer_ids: tuple[int, ...]
    recurrent: bool

    def with_aux_layers(self, ids: Sequence[int]) -> "Target": ...

    def forward(self, params: Any, input_ids: Any, positions: Any, kv: Any, attn: Any
                ) -> tuple[Any, Any, Any]: ...

    def compute_logits(self, params: Any, hidden: Any) -> Any: ...

    def init_kv_caches(self, num_blocks: int, block_size: int, dtype: Any) -> Any: ...

    def kv_bytes_per_block(self, block_size: int, dtype: Any) -> int: ...

    def shared_weights(self, params: Any) -> dict: ...


#: the required members, in the order a missing one is named
TARGET_MEMBERS = ("vocab_size", "hidden_size", "num_layers", "aux_layer_ids", "recurrent",
                  "with_aux_layers", "forward", "compute_logits", "init_kv_caches",
                  "kv_bytes_per_block", "shared_weights")


def check_target(target: Any, name: str = "target") -> Any:
    """``target`` when it has every member of :class:`Target` and, if recurrent, ``accept``;
    else ``ArgumentTypeError`` (a TypeError and a ValueError) naming what is missing."""
    missing = [m for m in TARGET_MEMBERS if not hasattr(target, m)]
    if missing:
        raise ArgumentTypeError(
            f"{name} must implement specjax.Target (e.g. a specjax.models.DecoderLM); "
            f"{type(target).__name__} lacks {', '.join(missing)}")
    if target.recurrent and not has_accept(target):
        raise ArgumentTypeError(f"{name} is recurrent (recurrent=True) but has no accept hook: "
                                "a recurrent target needs accept(kv, num_kept, attn) -> kv, the "
                                "rollback of its state to the kept tokens (specjax.Target)")
    return target


def has_move_kv(target: Any) -> bool:
    """Whether ``target`` offers the optional ``move_kv`` (tree verification needs it)."""
    return callable(getattr(target, "move_kv", None))


def has_accept(target: Any) -> bool:
    """Whether ``target`` offers the optional ``accept`` (a recurrent target needs it)."""
    return callable(getattr(target, "accept", None))
