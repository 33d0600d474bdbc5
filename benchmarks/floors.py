"""The physical floor of a step, defined once for every benchmark in this folder.

    floor = (weight bytes + live K/V bytes) / HBM_BPS

``HBM_BPS`` is the H200's measured device-to-device copy rate (bytes read + written,
4.3 TB/s; the datasheet's 4.8 TB/s is not reached by a copy). A forward reads each weight
it multiplies by once; an embedding table counts only when it is also the lm_head (its
gathered rows are ignored). The live K/V of a forward over ``tokens`` new tokens per
request, with ``context`` tokens already cached, is ``batch * (context + tokens)`` tokens of
every layer's K and V: attention reads the cached tokens and the new ones.

Plain Python (no JAX, no torch): the benchmarks import it, and so does
``tests/benchmarks/test_benchmarks_floors.py``. The benchmark geometries (``TARGETS``, the 8B-shaped
EAGLE-3 head) live here too, so that ``e2e.py`` and ``torch_anchors.py`` build the same
shapes the floors are computed for.
"""

from __future__ import annotations

from typing import Iterable, Mapping

HBM_BPS = 4.3e12

#: Target geometries (Hugging Face ``config.json`` keys) of ``benchmarks/e2e.py``'s
#: ``--target``: Llama-3.1-8B, Llama-3.2-1B, and a tiny one for CPU smoke runs.
TARGETS: dict[str, dict] = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0,
               rms_norm_eps=1e-5),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0,
               rms_norm_eps=1e-5, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=256, rope_theta=10000.0,
                 rms_norm_eps=1e-5),
}

#: Draft vocabulary of the EAGLE-3 head built for the 8B target (Llama-3.1-8B EAGLE-3 heads).
EAGLE3_DRAFT_VOCAB_8B = 32000


def head_dim(geo: Mapping) -> int:
    return int(geo.get("head_dim") or geo["hidden_size"] // geo["num_attention_heads"])


def _attn_mlp_params(geo: Mapping, qkv_in: int) -> int:
    """One decoder layer's projection parameters (q, k, v from ``qkv_in`` wide inputs, o,
    gate, up, down); Llama has no biases."""
    h, i, hd = geo["hidden_size"], geo["intermediate_size"], head_dim(geo)
    nh, nkv = geo["num_attention_heads"], geo["num_key_value_heads"]
    return qkv_in * (nh + 2 * nkv) * hd + nh * hd * h + 3 * h * i


def llama_weight_bytes(geo: Mapping, dtype_bytes: int = 2) -> int:
    """Bytes one forward of a Llama-shaped decoder reads: every layer's projections and its
    two RMSNorm scales, the final norm and the lm_head (tied: the embedding, counted once;
    untied: the embedding's gathered rows are not counted)."""
    h, v = geo["hidden_size"], geo["vocab_size"]
    per_layer = _attn_mlp_params(geo, h) + 2 * h
    return (geo["num_hidden_layers"] * per_layer + h + v * h) * dtype_bytes


def eagle3_weight_bytes(geo: Mapping, draft_vocab: int, dtype_bytes: int = 2) -> tuple[int, int]:
    """``(bytes of one draft forward without fc, fc bytes)`` of a one-layer EAGLE-3 head of
    the target geometry ``geo``: fc (3 aux states -> hidden), the layer (q/k/v read the
    2 * hidden concatenation of the embedding and the hidden state), its input, hidden and
    post-attention norms, the final norm and the draft lm_head. The token embedding is the
    target's (gathered rows: not counted). fc runs in the first pass only."""
    h = geo["hidden_size"]
    layer = _attn_mlp_params(geo, 2 * h) + 3 * h
    return (layer + h + draft_vocab * h) * dtype_bytes, 3 * h * h * dtype_bytes


def mtp_weight_bytes(geo: Mapping, dtype_bytes: int = 2) -> int:
    """Bytes one forward of a MiMo MTP module of the target geometry ``geo`` reads: its
    token / hidden norms, ``input_proj`` (2 * hidden -> hidden), one Qwen2 layer (q/k/v with
    bias, two norms), the final norm and the target's lm_head (the embedding's gathered
    rows are not counted)."""
    h, hd = geo["hidden_size"], head_dim(geo)
    qkv_bias = (geo["num_attention_heads"] + 2 * geo["num_key_value_heads"]) * hd
    layer = _attn_mlp_params(geo, h) + qkv_bias + 2 * h
    return (2 * h + 2 * h * h + layer + h + geo["vocab_size"] * h) * dtype_bytes


def mtp_propose_bytes(geo: Mapping, batch: int, context: int, k: int, dtype_bytes: int = 2) -> int:
    """MTP's ``propose`` of ``k`` drafts (every forward runs module 0, input_proj included),
    forward ``i`` reading ``context + i`` tokens of the module's one-layer K/V."""
    return chain_bytes(mtp_weight_bytes(geo, dtype_bytes), kv_bytes_per_token(geo, dtype_bytes, layers=1),
                       batch, [context + i for i in range(k)])


def kv_bytes_per_token(geo: Mapping, dtype_bytes: int = 2, layers: int | None = None) -> int:
    """K and V bytes of one token over ``layers`` layers (default: all of ``geo``'s)."""
    n = geo["num_hidden_layers"] if layers is None else layers
    return 2 * n * geo["num_key_value_heads"] * head_dim(geo) * dtype_bytes


def floor_bytes(weight_bytes: int, kv_per_token: int, batch: int, context: int, tokens: int = 1) -> int:
    """Bytes one forward must move: its weights once, plus the live K/V of ``batch``
    requests with ``context`` cached tokens each and ``tokens`` new ones."""
    for name, val in (("weight_bytes", weight_bytes), ("kv_per_token", kv_per_token), ("batch", batch),
                      ("context", context), ("tokens", tokens)):
        if val < 0:
            raise ValueError(f"{name} must be >= 0, got {val}")
    return weight_bytes + batch * (context + tokens) * kv_per_token


def floor_ms(nbytes: float, bps: float = HBM_BPS) -> float:
    """Milliseconds to move ``nbytes`` at ``bps``."""
    return nbytes / bps * 1e3


def target_step_bytes(geo: Mapping, batch: int, context: int, tokens: int, dtype_bytes: int = 2) -> int:
    """One target forward over ``tokens`` tokens per request (1: a decode step; k + 1: a
    verify step)."""
    return floor_bytes(llama_weight_bytes(geo, dtype_bytes), kv_bytes_per_token(geo, dtype_bytes),
                       batch, context, tokens)


def chain_bytes(weight_bytes: int, kv_per_token: int, batch: int, contexts: Iterable[int],
                once_bytes: int = 0, tokens: int = 0) -> int:
    """A draft chain: one forward per entry of ``contexts`` (its live K/V length, ``tokens``
    added), each reading ``weight_bytes``, plus ``once_bytes`` read by one of them only
    (EAGLE-3's fc in the first pass)."""
    return once_bytes + sum(floor_bytes(weight_bytes, kv_per_token, batch, c, tokens) for c in contexts)


def eagle3_propose_bytes(geo: Mapping, batch: int, context: int, k: int, draft_vocab: int,
                         dtype_bytes: int = 2) -> int:
    """EAGLE-3's ``propose`` of ``k`` drafts (the first pass, then ``k - 1`` single-token
    forwards), forward ``i`` reading ``context + i`` tokens of the head's one-layer K/V (as
    ``benchmarks/proposers.py`` counts it)."""
    w, fc = eagle3_weight_bytes(geo, draft_vocab, dtype_bytes)
    return chain_bytes(w, kv_bytes_per_token(geo, dtype_bytes, layers=1), batch,
                       [context + i for i in range(k)], once_bytes=fc)


def tree_bytes(leaves: Iterable) -> int:
    """Bytes of arrays with ``.size`` and ``.dtype.itemsize`` (a JAX or NumPy params tree's
    leaves)."""
    return sum(int(x.size) * x.dtype.itemsize for x in leaves)
