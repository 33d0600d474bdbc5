"""MXFP4 (OCP microscaling E2M1 + E8M0 scales), gpt-oss's expert storage -> floats, as
transformers' ``integrations/mxfp4.py::convert_moe_packed_tensors``."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from specjax.converters.errors import CheckpointError
from specjax.converters.tensor_ref import TensorRef

#: E2M1 code -> value (bit 3 the sign): transformers' ``FP4_VALUES``.
FP4_VALUES = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
#: The E8M0 scale bias; the scale byte 0xFF is NaN (OCP MX spec).
SCALE_BIAS, SCALE_NAN = 127, 255
BLOCK = 32   # values per scale: 16 bytes, two E2M1 codes a byte
#: What the experts are dequantized to: transformers' dequantize dtype (exact: an E2M1 value
#: times a power of two 2^-127..2^127 is a bfloat16, subnormals included).
OUT_DTYPE = np.dtype(ml_dtypes.bfloat16)


def check_mxfp4(blocks, scales, key: str) -> None:
    """CheckpointError naming ``key`` unless blocks are uint8 [..., G, 16], scales [..., G]."""
    bs, ss = tuple(blocks.shape), tuple(scales.shape)
    for name, t in (("blocks", blocks), ("scales", scales)):
        if np.dtype(t.dtype) != np.uint8:
            raise CheckpointError(f"{key}_{name}: MXFP4 {name} must be uint8, found {t.dtype}")
    if len(bs) < 2 or bs[-1] != BLOCK // 2 or bs[:-1] != ss:
        raise CheckpointError(f"{key}_blocks {list(bs)} / {key}_scales {list(ss)}: MXFP4 needs "
                              f"blocks [..., G, {BLOCK // 2}] and scales [..., G]")


#: byte -> (value of its low nibble, of its high nibble); scale byte -> 2^(scale - 127)
_PAIRS = np.stack([FP4_VALUES[np.arange(256) & 0x0F], FP4_VALUES[np.arange(256) >> 4]], -1)
_SCALES = np.append(np.ldexp(1.0, np.arange(SCALE_NAN) - SCALE_BIAS), np.nan).astype(np.float32)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray, dtype=np.float32,
                     key: str = "mxfp4") -> np.ndarray:
    """uint8 ``blocks [..., G, 16]`` (element 2j the low nibble of byte j, 2j+1 the high)
    and ``scales [..., G]`` -> ``dtype [..., G*32]``, each block times 2^(scale - 127)."""
    check_mxfp4(blocks, scales, key)
    vals = np.take(_PAIRS, blocks, axis=0)   # [..., G, 16, 2]
    with np.errstate(over="ignore"):   # 2^127 x |v| >= 2 is inf, as in transformers
        np.multiply(vals, _SCALES[scales][..., None, None], out=vals)   # exact: powers of 2
    return vals.reshape(*blocks.shape[:-2], -1).astype(dtype, copy=False)


def experts_ref(blocks: TensorRef, scales: TensorRef, key: str,
                dtype=OUT_DTYPE) -> TensorRef:
    """gpt-oss ``{key}_blocks [E, R, C/32, 16]`` + ``_scales`` -> ``key [E, C, R]`` (transposed,
    as transformers), dequantized lazily one expert at a time."""
    check_mxfp4(blocks, scales, key)
    if len(blocks.shape) != 4:
        raise CheckpointError(f"{key}_blocks has shape {list(blocks.shape)}; gpt-oss MXFP4 "
                              f"experts are [E, rows, cols/{BLOCK}, {BLOCK // 2}]")
    e, rows, g, _ = blocks.shape
    shape = (e, g * BLOCK, rows)

    def load() -> np.ndarray:
        b, s = blocks.load(), scales.load()
        out = np.empty(shape, dtype)
        for i in range(e):   # the float32 temporary is one expert's
            out[i] = dequantize_mxfp4(b[i], s[i], np.float32, key).T
        return out

    return TensorRef(shape, dtype, load, source=f"{blocks.source} (MXFP4, dequantized)")
