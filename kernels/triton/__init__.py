"""Deprecated: the Triton backend of each op now lives in its folder
(``kernels/<op>/triton.py``); this package forwards to them. Importing it needs neither
triton nor jax-triton: the kernel modules load on the first call."""

from __future__ import annotations

import importlib
import warnings

_OPS = {
    "paged_attention": "paged_attention",
    "eagle_step_update_slot_mapping_and_metadata": "eagle_step",
    "eagle_prepare_inputs_padded": "prepare",
    "eagle_prepare_next_token_padded": "prepare",
    "copy_and_expand_eagle_inputs": "copy_expand",
    "copy_and_expand_dflash_inputs": "copy_expand",
}
__all__ = list(_OPS)


def _forward(name: str):
    def op(*args, **kw):
        mod = importlib.import_module(f"specjax.kernels.{_OPS[name]}.triton")
        return getattr(mod, name)(*args, **kw)
    op.__name__ = name
    return op


for _name in _OPS:
    globals()[_name] = _forward(_name)

warnings.warn("specjax.kernels.triton moved: each op's Triton backend is "
              "specjax.kernels.<op>.triton", DeprecationWarning, stacklevel=2)
