"""specjax: speculative decoding for JAX (a port of vLLM v1's spec_decode module)."""

from specjax.constants import PADDING_SLOT_ID, next_power_of_2
from specjax.converters import _specjax_getattr as __getattr__  # lazy specjax.load_pretrained

__version__ = "0.1.0.dev0"

__all__ = ["PADDING_SLOT_ID", "next_power_of_2", "__version__"]
