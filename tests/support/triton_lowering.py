"""Lowering a Pallas-Triton kernel for an H200 on a machine without a GPU (no PTX): catches
what interpret mode does not check (power-of-two tensors, unsupported primitives)."""

from __future__ import annotations

import pytest


def fake_h200(monkeypatch) -> None:
    """Make Pallas-Triton's lowering see an H200; skips the test when JAX's internals moved."""
    try:
        from jax._src.pallas.triton import pallas_call_registration as reg
        if hasattr(reg, "gpu_info_lib"):
            from jax._src.pallas.triton import gpu_info
            h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
            monkeypatch.setattr(reg.gpu_info_lib, "get_gpu_info", lambda: h200)
    except (ImportError, AttributeError) as e:  # pragma: no cover - JAX internals moved
        pytest.skip(f"cannot fake a GPU for the Triton lowering: {e}")
