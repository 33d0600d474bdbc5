"""Constants and tiny helpers shared by every layer (vLLM ``spec_decode/utils.py``)."""

from __future__ import annotations

import numpy as np

#: Slot-mapping value that tells the KV-cache writer to skip a token.
PADDING_SLOT_ID: int = -1

#: dtype of every device index array (positions, slots, block tables, counts).
INDEX_DTYPE = np.int32

#: Exclusive upper bound of an int32 index.
INT32_LIMIT: int = 2**31

#: vLLM v0.20's ``LogprobsMode`` values (``specjax.sampling.logprobs``).
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
DEFAULT_LOGPROBS_MODE = "raw_logprobs"
#: Most top logprobs a request may ask for (vLLM's default ``max_logprobs``).
MAX_LOGPROBS = 20


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n``; 1 for ``n <= 0`` (vLLM's bit-smearing helper)."""
    n = int(n)
    if n <= 1:
        return 1
    return 1 << (n - 1).bit_length()


def check_index_range(name: str, value: int) -> None:
    """Raise ValueError if an index quantity does not fit int32."""
    if value >= INT32_LIMIT:
        raise ValueError(
            f"{name}={value} does not fit the int32 index dtype (must be < 2**31); "
            "specjax keeps every device index in int32 and never enables jax_enable_x64"
        )
