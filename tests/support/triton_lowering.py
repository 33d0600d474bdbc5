"""Lowering a Pallas-Triton kernel for an H200 on a machine without a GPU (no PTX): catches
what interpret mode does not check (power-of-two tensors, unsupported primitives, and, through
MLIR's verifier, ill-typed IR that XLA's Triton parser would refuse on the GPU)."""

from __future__ import annotations

import pytest


def fake_h200(monkeypatch) -> None:
    """Make Pallas-Triton's lowering see an H200 and verify every Triton module it emits;
    skips the test when JAX's internals moved."""
    try:
        from jax._src.pallas.triton import pallas_call_registration as reg
        if hasattr(reg, "gpu_info_lib"):     # (jax._src.pallas.triton.gpu_info or jax._src.gpu_info)
            gpu_info = reg.gpu_info_lib
            h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
            monkeypatch.setattr(gpu_info, "get_gpu_info", lambda: h200)
        lower = reg.lowering.lower_jaxpr_to_triton_module
    except (ImportError, AttributeError) as e:  # pragma: no cover - JAX internals moved
        pytest.skip(f"cannot fake a GPU for the Triton lowering: {e}")

    def verified(*args, **kwargs):
        result = lower(*args, **kwargs)
        with result.module.context:
            result.module.operation.verify()    # MLIRError naming the op and source line
        return result

    monkeypatch.setattr(reg.lowering, "lower_jaxpr_to_triton_module", verified)
