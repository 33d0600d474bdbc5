"""Kernel ops on the GPU: Triton and compiled Pallas against backend="xla" and the NumPy oracle.

Run on the GPU machine with ``python -m pytest -m gpu tests/kernels/test_kernels_gpu.py``. Every output
must be bit-identical to the XLA backend's and to the oracle's, on many seeded random batches
(up to 1024 requests), eagerly and inside ``jax.jit``.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import specjax.kernels as K

try:
    import kernel_cases as cases
    import kernel_oracle as oracle
except ImportError:  # tests/ made a package
    from tests import kernel_cases as cases
    from tests import kernel_oracle as oracle

pytestmark = pytest.mark.gpu   # skipped without a GPU by tests/conftest.py

GPU_BACKENDS = ("triton", "pallas")
BATCHES_PER_CONFIG = 6
RANDOM_CONFIGS = 8

OUTPUT_NAMES = cases.OUTPUT_NAMES

# The biggest batch: 1024 requests.
BIG_CONFIGS = {
    "eagle_step_update_slot_mapping_and_metadata": dict(
        rows=1024, block_size=16, num_block_columns=128, max_model_len=4096,
        input_batch_size=2048),
    "eagle_prepare_inputs_padded": dict(rows=1024),
    "eagle_prepare_next_token_padded": dict(rows=1024, num_sampled=8, vocab_size=32000),
    "copy_and_expand_eagle_inputs": dict(
        rows=1024, tokens=8192, num_padding_slots_per_request=4, shift_input_ids=True,
        padding_token_id=-1, parallel_drafting_token_id=151643, num_output_tokens=16384),
    "copy_and_expand_dflash_inputs": dict(
        rows=1024, tokens=8192, num_speculative_tokens=7, block_size=16, num_block_columns=128,
        parallel_drafting_token_id=151643, has_rejected=True),
}

STATIC_ARGS = {
    "eagle_step_update_slot_mapping_and_metadata": (
        "block_size", "max_model_len", "input_batch_size"),
    "eagle_prepare_inputs_padded": (),
    "eagle_prepare_next_token_padded": ("vocab_size",),
    "copy_and_expand_eagle_inputs": (
        "padding_token_id", "parallel_drafting_token_id", "num_padding_slots_per_request",
        "shift_input_ids", "num_output_tokens"),
    "copy_and_expand_dflash_inputs": (
        "parallel_drafting_token_id", "block_size", "num_speculative_tokens"),
}


def skip_if_missing(backend: str, op: str) -> None:
    if backend == "triton":
        try:
            K.resolve_backend("triton")
        except ValueError as e:
            pytest.skip(str(e))
    elif backend != "pallas":
        return
    import importlib

    mod = importlib.import_module(f"specjax.kernels.{cases.FAMILY[op]}.{backend}")
    if getattr(mod, op, None) is None:
        pytest.skip(f"specjax.kernels.{cases.FAMILY[op]}.{backend} has no {op}")


def assert_outputs_equal(op, got, want, context):
    names = OUTPUT_NAMES[op]
    assert isinstance(got, tuple) and len(got) == len(names), (op, type(got), len(got))
    for name, g, w in zip(names, got, want):
        g = np.asarray(g)
        w = np.asarray(w)
        assert g.dtype == w.dtype, f"{op} {name}: dtype {g.dtype}, expected {w.dtype} {context}"
        np.testing.assert_array_equal(g, w, err_msg=f"{op} output {name} {context}")


def gpu_configs(op):
    """The CPU configs, the 1024-request config, and random ones (seeded)."""
    rng = np.random.default_rng(1234)
    configs = list(cases.CPU_CONFIGS[op]) + [BIG_CONFIGS[op]]
    configs += [cases.random_config(op, rng, max_reqs=1024) for _ in range(RANDOM_CONFIGS)]
    return configs


def batches(op):
    """(context, kwargs) for every seeded batch of ``op``; the 1024-row config includes a
    batch with every row real and one with a single real row."""
    for ci, config in enumerate(gpu_configs(op)):
        rng = np.random.default_rng(ci)
        rows = config["rows"]
        fixed = [rows, 0, 1] if rows == 1024 else [rows, 0]
        for bi in range(BATCHES_PER_CONFIG + len(fixed)):
            num_real = fixed[bi] if bi < len(fixed) else None
            kwargs = cases.make_case(op, rng, config, num_real)
            yield f"config={config} batch={bi} num_real={num_real}", kwargs


@pytest.mark.parametrize("backend", ("xla",) + GPU_BACKENDS)
@pytest.mark.parametrize("op", cases.OP_NAMES)
def test_matches_xla_and_oracle(op, backend):
    skip_if_missing(backend, op)
    fn = getattr(K, op)
    for context, kwargs in batches(op):
        want = oracle.OPS[op](**kwargs)
        got = fn(**kwargs, backend=backend)
        if backend != "xla":
            ref = fn(**kwargs, backend="xla")
            assert_outputs_equal(op, got, tuple(np.asarray(x) for x in ref),
                                 context=f"vs xla {context}")
        assert_outputs_equal(op, got, want, context=f"vs oracle {context}")


def call_jitted(op, kwargs, backend):
    """Run ``op`` under jax.jit: arrays (num_reqs included) traced, static args bound."""
    static = {k: kwargs[k] for k in STATIC_ARGS[op]}
    nones = {k: None for k, v in kwargs.items() if k not in static and v is None}
    arrays = {k: v for k, v in kwargs.items() if k not in static and v is not None}
    fn = jax.jit(functools.partial(getattr(K, op), backend=backend, **static, **nones))
    return fn(**arrays)


@pytest.mark.parametrize("backend", ("xla",) + GPU_BACKENDS)
@pytest.mark.parametrize("op", cases.OP_NAMES)
def test_under_jit(op, backend):
    skip_if_missing(backend, op)
    for config in (cases.CPU_CONFIGS[op][1], BIG_CONFIGS[op]):
        rng = np.random.default_rng(7)
        # One compilation per config, num_reqs changing between calls.
        for num_real in (config["rows"], config["rows"] // 2, 1, 0):
            kwargs = cases.make_case(op, rng, config, num_real)
            got = call_jitted(op, kwargs, backend)
            assert_outputs_equal(op, got, oracle.OPS[op](**kwargs),
                                 context=f"jit config={config} num_real={num_real}")
