"""Kernel ops against the NumPy oracle (CPU: the XLA backend and Pallas in interpret mode).

(a) the oracle itself, on small batches worked out by hand from the docstrings of
    ``kernels/_api.py`` (the same batches are then run on every backend); (b) hypothesis
    property tests: every backend equals the oracle bit for bit on random ragged, padded
    batches (tests/support/kernel_cases.py), plus fixed edge batches, zero-row batches and the ops
    under ``jax.jit``; (c) argument errors: ValueError naming the argument.

Pallas runs in interpret mode here, so it gets fewer examples and only small configs; a
backend op that does not exist yet is skipped.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import specjax.kernels as K

try:
    import kernel_cases as cases
    import kernel_oracle as oracle
except ImportError:  # tests/ made a package
    from tests import kernel_cases as cases
    from tests import kernel_oracle as oracle

CPU_BACKENDS = ("xla", "pallas")
OUTPUT_NAMES = cases.OUTPUT_NAMES
# Hypothesis examples per (op, backend): Pallas runs in interpret mode on CPU (slow), so it
# gets fewer examples and smaller batches.
EXAMPLES = {"xla": 100, "pallas": 16}


def skip_if_missing(backend: str, op: str) -> None:
    if backend == "pallas":
        import importlib

        mod = importlib.import_module(f"specjax.kernels.{cases.FAMILY[op]}.pallas")
        if getattr(mod, op, None) is None:
            pytest.skip(f"specjax.kernels.{cases.FAMILY[op]}.pallas has no {op}")


def assert_outputs_equal(op, got, want, context=""):
    names = OUTPUT_NAMES[op]
    assert isinstance(got, tuple) and len(got) == len(names), (op, type(got), len(got))
    for name, g, w in zip(names, got, want):
        g = np.asarray(g)
        w = np.asarray(w)
        assert g.dtype == w.dtype, f"{op} {name}: dtype {g.dtype}, expected {w.dtype} {context}"
        np.testing.assert_array_equal(g, w, err_msg=f"{op} output {name} {context}")


def run_op(op, kwargs, backend):
    return getattr(K, op)(**kwargs, backend=backend)


def i32(*v):
    return np.array(v, dtype=np.int32)


def i32_2d(rows):
    return np.array(rows, dtype=np.int32)


# ============================================================================ (a) oracle
# Each hand case: (op, kwargs, expected outputs), expected values worked out by hand from
# the specification text.

F, T = False, True

HAND_CASES = {
    # block_size 4, max_model_len 10, 3 columns, 2 real rows of 3, slot buffer of 5.
    # row 0: new 4 -> block min(1, 2) = 1 -> 9*4 + 0 = 36, seq 4 + 1 = 5.
    # row 1: new 9 -> block min(2, 2) = 2 -> 3*4 + 1 = 13, seq 9 + 1 = 10, cap 10.
    # row 2: padding -> 0, -1, 0; slot_mapping[3:] = -1.
    "eagle_step_padded": (
        "eagle_step_update_slot_mapping_and_metadata",
        dict(positions=i32(3, 8, 6), block_table=i32_2d([[5, 9, 2], [7, 1, 3], [0, 0, 0]]),
             seq_lens=i32(4, 9, 3), block_size=4, max_model_len=10, input_batch_size=5,
             num_reqs=np.asarray(2, np.int32)),
        (i32(4, 9, 0), i32(36, 13, -1, -1, -1), i32(5, 10, 0)),
    ),
    # block_size 2, max_model_len 6, 2 columns, every row real.
    # row 0: new 5 -> block min(2, 1) = 1 -> 6*2 + 1 = 13, seq 6 (cap 6).
    # row 1: new 6 >= 6 -> position 0, slot -1, seq 1.
    # row 2: new 1 -> block 0 -> 1*2 + 1 = 3, seq 0 + 1 = 1.
    # row 3: position 3 = max_model_len - 3: new 4 -> block min(2, 1) = 1 -> 8*2 + 0 = 16,
    #        seq 9 + 1 = 10 capped at 6.
    "eagle_step_clamp": (
        "eagle_step_update_slot_mapping_and_metadata",
        dict(positions=i32(4, 5, 0, 3), block_table=i32_2d([[4, 6], [4, 6], [1, 2], [7, 8]]),
             seq_lens=i32(5, 6, 0, 9), block_size=2, max_model_len=6),
        (i32(5, 0, 1, 4), i32(13, -1, 3, 16), i32(6, 1, 1, 6)),
    ),
    # vLLM's _calc_spec_decode_metadata example (research 1.2): cu_num_scheduled_tokens
    # [4,104,107,207,209], num_draft_tokens [3,0,2,0,1] -> cu [3,3,5,5,6].
    # valid: req0 1 of 3 accepted (2) -> rejected 3+1-2 = 2, index 4-1-2 = 1;
    # req1 no drafts -> 0, 103; req2 all accepted (3) -> 0, 106; req3 no drafts -> 0, 206;
    # req4 discarded (0) -> rejected 1+1-0 = 2, index 209-1-2 = 206.
    "prepare_inputs_metadata_example": (
        "eagle_prepare_inputs_padded",
        dict(cu_num_draft_tokens=i32(3, 3, 5, 5, 6), valid_sampled_tokens_count=i32(2, 1, 3, 1, 0),
             query_start_loc=i32(0, 4, 104, 107, 207, 209)),
        (i32(1, 103, 106, 206, 206), i32(2, 0, 0, 0, 2)),
    ),
    # Same batch with num_reqs = 3: rows 3 and 4 give 0 and 0.
    "prepare_inputs_padded_rows": (
        "eagle_prepare_inputs_padded",
        dict(cu_num_draft_tokens=i32(3, 3, 5, 5, 6), valid_sampled_tokens_count=i32(2, 1, 3, 1, 0),
             query_start_loc=i32(0, 4, 104, 107, 207, 209), num_reqs=np.asarray(3, np.int32)),
        (i32(1, 103, 106, 0, 0), i32(2, 0, 0, 0, 0)),
    ),
    # vocab 10. row0: 3, 5 valid -> (5, 2); row1: none valid -> (backup 7, 0);
    # row2: 10 is out of vocab -> valid 4 and 2 -> (2, 2) (highest valid index is 2);
    # row3: discarded -> (backup 1, 0); row4: -2 counts as valid, 12 does not -> (-2, 1);
    # row5: padding -> (0, 0).
    "next_token": (
        "eagle_prepare_next_token_padded",
        dict(sampled_token_ids=i32_2d([[3, 5, -1], [-1, -1, -1], [4, 10, 2], [6, 8, 9],
                                       [-2, -1, 12], [1, 1, 1]]),
             discard_request_mask=np.array([F, F, F, T, F, F]),
             backup_next_token_ids=i32(9, 7, 9, 1, 3, 4), vocab_size=10,
             num_reqs=np.asarray(5, np.int32)),
        (i32(5, 7, 2, 1, -2, 0), i32(2, 0, 2, 0, 1, 0)),
    ),
    # Two requests qsl [0,4,7], last valid token qel [2,6], one stray token (index 7), P = 2.
    # shift (EAGLE): req0 V = 2 reads ids[1:3] = 11,12, o = 0, rejected 4-2-1 = 1:
    #   out 0..4 = 11,12, bonus 100, pd 50 (masked), pad -1 (rejected);
    #   positions 5,6,7,8, 0; new_token_indices 2,3; hidden map 0..3.
    # req1 V = 2 reads ids[5:7] = 21,22, o = 4 + 1*(2-1) = 5, rejected 0:
    #   out 5..8 = 21,22, 200, 50; positions 0,1,2,3; new 7,8; hidden map 5,6,7.
    # token 7: hidden map = num_output_tokens = 12; outputs 9..11: fill.
    "copy_eagle_shift": (
        "copy_and_expand_eagle_inputs",
        dict(target_token_ids=i32(10, 11, 12, 13, 20, 21, 22, 99),
             target_positions=i32(5, 6, 7, 8, 0, 1, 2, 0), next_token_ids=i32(100, 200),
             query_start_loc=i32(0, 4, 7), query_end_loc=i32(2, 6), padding_token_id=-1,
             parallel_drafting_token_id=50, num_padding_slots_per_request=2,
             shift_input_ids=True, num_output_tokens=12),
        (i32(11, 12, 100, 50, -1, 21, 22, 200, 50, 0, 0, 0),
         i32(5, 6, 7, 8, 0, 0, 1, 2, 3, 0, 0, 0),
         np.array([F, F, F, F, T, F, F, F, F, F, F, F]),
         np.array([F, F, F, T, F, F, F, F, T, F, F, F]),
         i32(2, 3, 7, 8), i32(0, 1, 2, 3, 5, 6, 7, 12)),
    ),
    # No shift (draft model): req0 V = 3 reads 10,11,12, o = 0, rejected 1 -> 6 outputs
    #   10,11,12, 100, 50 (masked), -1 (rejected); positions 5..9, 0; new 3,4; hidden 0..3.
    # req1 V = 3 reads 20,21,22, o = 4 + 1*2 = 6 -> 20,21,22, 200, 50; positions 0..4;
    #   new 9,10; hidden 6,7,8. Output 11: fill; token 7 -> 12.
    "copy_eagle_no_shift": (
        "copy_and_expand_eagle_inputs",
        dict(target_token_ids=i32(10, 11, 12, 13, 20, 21, 22, 99),
             target_positions=i32(5, 6, 7, 8, 0, 1, 2, 0), next_token_ids=i32(100, 200),
             query_start_loc=i32(0, 4, 7), query_end_loc=i32(2, 6), padding_token_id=-1,
             parallel_drafting_token_id=50, num_padding_slots_per_request=2,
             shift_input_ids=False, num_output_tokens=12),
        (i32(10, 11, 12, 100, 50, -1, 20, 21, 22, 200, 50, 0),
         i32(5, 6, 7, 8, 9, 0, 0, 1, 2, 3, 4, 0),
         np.array([F, F, F, F, F, T, F, F, F, F, F, F]),
         np.array([F, F, F, F, T, F, F, F, F, F, T, F]),
         i32(3, 4, 9, 10), i32(0, 1, 2, 3, 6, 7, 8, 12)),
    ),
    # The shift case with only 6 output slots: req1's writes at 6..8 are dropped; the index
    # outputs keep their values (a hidden map >= 6 is skipped by a drop scatter anyway).
    "copy_eagle_dropped": (
        "copy_and_expand_eagle_inputs",
        dict(target_token_ids=i32(10, 11, 12, 13, 20, 21, 22, 99),
             target_positions=i32(5, 6, 7, 8, 0, 1, 2, 0), next_token_ids=i32(100, 200),
             query_start_loc=i32(0, 4, 7), query_end_loc=i32(2, 6), padding_token_id=-1,
             parallel_drafting_token_id=50, num_padding_slots_per_request=2,
             shift_input_ids=True, num_output_tokens=6),
        (i32(11, 12, 100, 50, -1, 21), i32(5, 6, 7, 8, 0, 0),
         np.array([F, F, F, F, T, F]), np.array([F, F, F, T, F, F]),
         i32(2, 3, 7, 8), i32(0, 1, 2, 3, 5, 6, 7, 6)),
    ),
    # The shift case with num_reqs = 1: request 1 is padding.
    "copy_eagle_padding_row": (
        "copy_and_expand_eagle_inputs",
        dict(target_token_ids=i32(10, 11, 12, 13, 20, 21, 22, 99),
             target_positions=i32(5, 6, 7, 8, 0, 1, 2, 0), next_token_ids=i32(100, 200),
             query_start_loc=i32(0, 4, 7), query_end_loc=i32(2, 6), padding_token_id=-1,
             parallel_drafting_token_id=50, num_padding_slots_per_request=2,
             shift_input_ids=True, num_output_tokens=12, num_reqs=np.asarray(1, np.int32)),
        (i32(11, 12, 100, 50, -1, 0, 0, 0, 0, 0, 0, 0),
         i32(5, 6, 7, 8, 0, 0, 0, 0, 0, 0, 0, 0),
         np.array([F, F, F, F, T, F, F, F, F, F, F, F]),
         np.array([F, F, F, T, F, F, F, F, F, F, F, F]),
         i32(2, 3, 0, 0), i32(0, 1, 2, 3, 12, 12, 12, 12)),
    ),
    # qsl[0] > 0 (tokens 0, 1 and 7 belong to no request), shift, P = 2. req0 [2,4) with
    # end 2: V = 0 (nothing copied), o = 2, rejected 1 -> out 2..4 = bonus 100 (position
    # pos[2] = 7), 50 masked (8), -1 rejected (0); new 2,3; hidden 2,3. req1 as above:
    # o = 5 -> 21,22,200,50 at positions 0..3; new 7,8; hidden 5,6,7. Others -> 12.
    "copy_eagle_offset_start": (
        "copy_and_expand_eagle_inputs",
        dict(target_token_ids=i32(10, 11, 12, 13, 20, 21, 22, 99),
             target_positions=i32(5, 6, 7, 8, 0, 1, 2, 0), next_token_ids=i32(100, 200),
             query_start_loc=i32(2, 4, 7), query_end_loc=i32(2, 6), padding_token_id=-1,
             parallel_drafting_token_id=50, num_padding_slots_per_request=2,
             shift_input_ids=True, num_output_tokens=12),
        (i32(0, 0, 100, 50, -1, 21, 22, 200, 50, 0, 0, 0),
         i32(0, 0, 7, 8, 0, 0, 1, 2, 3, 0, 0, 0),
         np.array([F, F, F, F, T, F, F, F, F, F, F, F]),
         np.array([F, F, F, T, F, F, F, F, T, F, F, F]),
         i32(2, 3, 7, 8), i32(12, 12, 2, 3, 5, 6, 7, 12)),
    ),
    # P = 1, shift, every draft accepted (end = next_start - 1): o = start, no masked or
    # rejected slot. req0 [0,3): V = 2 -> 31,32, bonus 7; req1 [3,4): V = 0 -> bonus 8.
    "copy_eagle_p1": (
        "copy_and_expand_eagle_inputs",
        dict(target_token_ids=i32(30, 31, 32, 40), target_positions=i32(9, 10, 11, 3),
             next_token_ids=i32(7, 8), query_start_loc=i32(0, 3, 4), query_end_loc=i32(2, 3),
             padding_token_id=0, parallel_drafting_token_id=1,
             num_padding_slots_per_request=1, shift_input_ids=True, num_output_tokens=4),
        (i32(31, 32, 7, 8), i32(9, 10, 11, 3), np.array([F, F, F, F]),
         np.array([F, F, F, F]), i32(2, 3), i32(0, 1, 2, 3)),
    ),
    # k = 2 (Q = 3), block_size 4, 2 columns, qsl [0,3,5,5], rejected [1,0,-], num_reqs 2.
    # req0 context positions 10,11,12 -> blocks min(2|2|3, 1) = 1 -> 8*4 + 2,3,0 = 34,35,32;
    #   last = pos[3-1-1] = 11 -> queries 12,13,14 -> 32,33,34; ids 100,50,50; sample 1,2.
    # req1 context 4,5 -> block 1 -> 6*4 + 0,1 = 24,25; last = pos[5-1-0] = 5 -> 6,7,8 ->
    #   26,27, (8: block min(2,1) = 1) 24; ids 200,50,50; sample 4,5.
    # req2 padding; token 5 of no real request -> position 0, slot -1.
    "dflash_padded": (
        "copy_and_expand_dflash_inputs",
        dict(next_token_ids=i32(100, 200, 300), target_positions=i32(10, 11, 12, 4, 5, 77),
             block_table=i32_2d([[3, 8], [5, 6], [9, 9]]), query_start_loc=i32(0, 3, 5, 5),
             num_rejected_tokens=i32(1, 0, 0), parallel_drafting_token_id=50, block_size=4,
             num_speculative_tokens=2, num_reqs=np.asarray(2, np.int32)),
        (i32(100, 50, 50, 200, 50, 50, 0, 0, 0), i32(10, 11, 12, 4, 5, 0),
         i32(12, 13, 14, 6, 7, 8, 0, 0, 0), i32(34, 35, 32, 24, 25, -1),
         i32(32, 33, 34, 26, 27, 24, -1, -1, -1), i32(1, 2, 4, 5, 0, 0)),
    ),
    # Same batch, no rejected counts, every row real: req0 last = pos[2] = 12 -> 13,14,15 ->
    # 33,34,35; req2 has an empty context [5,5): last = pos[4] = 5 -> 6,7,8 with row [9,9]
    # -> 38,39,36; ids 300,50,50; sample 7,8.
    "dflash_all_real": (
        "copy_and_expand_dflash_inputs",
        dict(next_token_ids=i32(100, 200, 300), target_positions=i32(10, 11, 12, 4, 5, 77),
             block_table=i32_2d([[3, 8], [5, 6], [9, 9]]), query_start_loc=i32(0, 3, 5, 5),
             num_rejected_tokens=None, parallel_drafting_token_id=50, block_size=4,
             num_speculative_tokens=2),
        (i32(100, 50, 50, 200, 50, 50, 300, 50, 50), i32(10, 11, 12, 4, 5, 0),
         i32(13, 14, 15, 6, 7, 8, 6, 7, 8), i32(34, 35, 32, 24, 25, -1),
         i32(33, 34, 35, 26, 27, 24, 38, 39, 36), i32(1, 2, 4, 5, 7, 8)),
    ),
    # Empty context with rejected tokens: index 0-1-1 is clipped to 0 -> last = pos[0] = 7;
    # queries 8, 9 -> block min(2, 0) = 0 -> 2*4 + 0, 1. Token 0 belongs to no request.
    "dflash_clip": (
        "copy_and_expand_dflash_inputs",
        dict(next_token_ids=i32(5), target_positions=i32(7), block_table=i32_2d([[2]]),
             query_start_loc=i32(0, 0), num_rejected_tokens=i32(1),
             parallel_drafting_token_id=-1, block_size=4, num_speculative_tokens=1),
        (i32(5, -1), i32(0), i32(8, 9), i32(-1), i32(8, 9), i32(1)),
    ),
}


@pytest.mark.parametrize("name", sorted(HAND_CASES))
def test_oracle_hand_worked(name):
    op, kwargs, want = HAND_CASES[name]
    assert_outputs_equal(op, oracle.OPS[op](**kwargs), want, context=name)


@pytest.mark.smoke
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("name", sorted(HAND_CASES))
def test_backend_hand_worked(name, backend):
    op, kwargs, want = HAND_CASES[name]
    skip_if_missing(backend, op)
    assert_outputs_equal(op, run_op(op, kwargs, backend), want, context=name)


def test_oracle_int32_slots_do_not_overflow():
    # The largest block id whose slots fit int32: id * 16 + 15 == 2**31 - 1.
    top = (2**31 - 1 - 15) // 16
    out = oracle.eagle_step_update_slot_mapping_and_metadata(
        i32(14), i32_2d([[top]]), i32(3), block_size=16, max_model_len=100)
    assert out[1].tolist() == [2**31 - 1]


# ============================================================================ (b) properties


def configs_for(op, backend):
    """The CPU configs of ``op``. Pallas (interpret mode: seconds per compilation, and a
    run time that grows with the rows) gets the small ones, shared by all its tests so that
    each compiles once."""
    configs = cases.CPU_CONFIGS[op]
    if backend == "xla":
        return configs
    return [c for c in configs if c["rows"] <= 16 and c.get("tokens", 0) <= 128]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("op", cases.OP_NAMES)
def test_backend_matches_oracle(op, backend):
    skip_if_missing(backend, op)
    configs = configs_for(op, backend)

    @settings(max_examples=EXAMPLES[backend], deadline=None, derandomize=True,
              database=None, suppress_health_check=list(HealthCheck))
    @given(which=st.integers(0, len(configs) - 1), seed=st.integers(0, 2**32 - 1),
           num_real=st.one_of(st.none(), st.integers(0, 2**16)))
    def check(which, seed, num_real):
        config = configs[which]
        if num_real is not None:
            num_real %= config["rows"] + 1
        kwargs = cases.make_case(op, np.random.default_rng(seed), config, num_real)
        want = oracle.OPS[op](**kwargs)
        got = run_op(op, kwargs, backend)
        assert_outputs_equal(op, got, want, context=f"config={config} seed={seed} "
                                                    f"num_real={num_real}")

    check()


def config_with_rows(op, rows, backend):
    return next(c for c in configs_for(op, backend) if c["rows"] >= rows)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("op", cases.OP_NAMES)
def test_backend_edge_batches(op, backend):
    """Fixed batches at the bucket edges: no real row, one row, a full bucket, all rows real."""
    skip_if_missing(backend, op)
    biggest = max(c["rows"] for c in configs_for(op, backend))
    for seed, num_real, rows in ((1, 0, 4), (2, 1, 1), (3, biggest, biggest), (4, None, 4)):
        config = config_with_rows(op, rows, backend)
        rng = np.random.default_rng(seed)
        if num_real is None:  # every row real, num_reqs=None
            kwargs = cases.make_case(op, rng, config, config["rows"])
            kwargs["num_reqs"] = None
        else:
            kwargs = cases.make_case(op, rng, config, num_real)
        assert_outputs_equal(op, run_op(op, kwargs, backend), oracle.OPS[op](**kwargs),
                             context=f"seed={seed} num_real={num_real}")


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


def call_jitted(op, kwargs, backend):
    """Run ``op`` under jax.jit: arrays (num_reqs included) traced, static args bound."""
    static = {k: kwargs[k] for k in STATIC_ARGS[op]}
    arrays = {k: v for k, v in kwargs.items() if k not in static and v is not None}
    nones = {k: None for k, v in kwargs.items() if k not in static and v is None}
    fn = jax.jit(functools.partial(getattr(K, op), backend=backend, **static, **nones))
    return fn(**arrays)


# Under jax.jit on CPU: the XLA backend only (what is checked is the public op on tracers;
# Pallas under jit runs compiled in tests/kernels/test_kernels_gpu.py).
@pytest.mark.smoke
@pytest.mark.parametrize("backend", ["xla"])
@pytest.mark.parametrize("op", cases.OP_NAMES)
def test_backend_under_jit(op, backend):
    rng = np.random.default_rng(11)
    config = config_with_rows(op, 4, backend)
    for num_real in (config["rows"], 3, 0):  # one compilation, three num_reqs
        kwargs = cases.make_case(op, rng, config, num_real)
        assert_outputs_equal(op, call_jitted(op, kwargs, backend), oracle.OPS[op](**kwargs),
                             context=f"jit num_real={num_real}")


# A batch of zero rows is allowed by the checks (num_reqs in [0, 0]).
ZERO_ROW_CASES = {
    "eagle_step_update_slot_mapping_and_metadata": dict(
        positions=i32(), block_table=np.zeros((0, 2), np.int32), seq_lens=i32(), block_size=4,
        max_model_len=16, input_batch_size=3),
    "eagle_prepare_inputs_padded": dict(
        cu_num_draft_tokens=i32(), valid_sampled_tokens_count=i32(), query_start_loc=i32(0)),
    "eagle_prepare_next_token_padded": dict(
        sampled_token_ids=np.zeros((0, 3), np.int32), discard_request_mask=np.zeros(0, bool),
        backup_next_token_ids=i32(), vocab_size=8),
    "copy_and_expand_eagle_inputs": dict(
        target_token_ids=i32(1, 2), target_positions=i32(3, 4), next_token_ids=i32(),
        query_start_loc=i32(0), query_end_loc=i32(), padding_token_id=0,
        parallel_drafting_token_id=1, num_padding_slots_per_request=2, shift_input_ids=True,
        num_output_tokens=4),
    "copy_and_expand_dflash_inputs": dict(
        next_token_ids=i32(), target_positions=i32(3, 4), block_table=np.zeros((0, 2), np.int32),
        query_start_loc=i32(0), num_rejected_tokens=None, parallel_drafting_token_id=1,
        block_size=4, num_speculative_tokens=2),
}


@pytest.mark.smoke
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("op", cases.OP_NAMES)
def test_backend_zero_rows(op, backend):
    skip_if_missing(backend, op)
    kwargs = ZERO_ROW_CASES[op]
    assert_outputs_equal(op, run_op(op, kwargs, backend), oracle.OPS[op](**kwargs))


# ============================================================================ (c) errors


def _step_args(**over):
    kw = dict(positions=i32(1, 2), block_table=i32_2d([[0, 1], [2, 3]]), seq_lens=i32(2, 3),
              block_size=4, max_model_len=16)
    kw.update(over)
    return "eagle_step_update_slot_mapping_and_metadata", kw


def _inputs_args(**over):
    kw = dict(cu_num_draft_tokens=i32(1, 3), valid_sampled_tokens_count=i32(1, 2),
              query_start_loc=i32(0, 2, 5))
    kw.update(over)
    return "eagle_prepare_inputs_padded", kw


def _next_args(**over):
    kw = dict(sampled_token_ids=i32_2d([[1, -1], [2, 3]]), discard_request_mask=np.array([F, T]),
              backup_next_token_ids=i32(4, 5), vocab_size=8)
    kw.update(over)
    return "eagle_prepare_next_token_padded", kw


def _eagle_args(**over):
    kw = dict(target_token_ids=i32(1, 2, 3), target_positions=i32(0, 1, 2),
              next_token_ids=i32(7), query_start_loc=i32(0, 3), query_end_loc=i32(1),
              padding_token_id=0, parallel_drafting_token_id=1, num_padding_slots_per_request=2,
              shift_input_ids=True, num_output_tokens=8)
    kw.update(over)
    return "copy_and_expand_eagle_inputs", kw


def _dflash_args(**over):
    kw = dict(next_token_ids=i32(7), target_positions=i32(0, 1, 2), block_table=i32_2d([[0, 1]]),
              query_start_loc=i32(0, 3), num_rejected_tokens=i32(1), parallel_drafting_token_id=1,
              block_size=4, num_speculative_tokens=2)
    kw.update(over)
    return "copy_and_expand_dflash_inputs", kw


ERROR_CASES = {
    # wrong dtype
    "step_positions_float": (_step_args(positions=np.array([1.0, 2.0])), "positions"),
    "step_block_table_bool": (_step_args(block_table=np.ones((2, 2), bool)), "block_table"),
    "inputs_cu_float": (_inputs_args(cu_num_draft_tokens=np.array([1.0, 3.0])),
                        "cu_num_draft_tokens"),
    "next_discard_int": (_next_args(discard_request_mask=i32(0, 1)), "discard_request_mask"),
    "next_sampled_float": (_next_args(sampled_token_ids=np.zeros((2, 2), np.float32)),
                           "sampled_token_ids"),
    "eagle_positions_float": (_eagle_args(target_positions=np.zeros(3, np.float32)),
                              "target_positions"),
    "dflash_rejected_float": (_dflash_args(num_rejected_tokens=np.array([1.0])),
                              "num_rejected_tokens"),
    "step_num_reqs_float": (_step_args(num_reqs=np.asarray(1.0)), "num_reqs"),
    # wrong rank
    "step_block_table_rank1": (_step_args(block_table=i32(0, 1)), "block_table"),
    "step_positions_rank2": (_step_args(positions=i32_2d([[1], [2]])), "positions"),
    "inputs_qsl_rank2": (_inputs_args(query_start_loc=i32_2d([[0, 2, 5]])), "query_start_loc"),
    "next_sampled_rank1": (_next_args(sampled_token_ids=i32(1, 2)), "sampled_token_ids"),
    "eagle_qel_rank2": (_eagle_args(query_end_loc=i32_2d([[1]])), "query_end_loc"),
    "dflash_block_table_rank1": (_dflash_args(block_table=i32(0, 1)), "block_table"),
    "step_num_reqs_rank1": (_step_args(num_reqs=i32(1)), "num_reqs"),
    # mismatched lengths
    "step_seq_lens_len": (_step_args(seq_lens=i32(2, 3, 4)), "seq_lens"),
    "step_block_table_rows": (_step_args(block_table=i32_2d([[0, 1]])), "block_table"),
    "inputs_valid_len": (_inputs_args(valid_sampled_tokens_count=i32(1)),
                         "valid_sampled_tokens_count"),
    "inputs_qsl_len": (_inputs_args(query_start_loc=i32(0, 2)), "query_start_loc"),
    "next_backup_len": (_next_args(backup_next_token_ids=i32(4)), "backup_next_token_ids"),
    "next_discard_len": (_next_args(discard_request_mask=np.array([F])), "discard_request_mask"),
    "eagle_positions_len": (_eagle_args(target_positions=i32(0, 1)), "target_positions"),
    "eagle_qel_len": (_eagle_args(query_end_loc=i32(1, 2)), "query_end_loc"),
    "eagle_qsl_len": (_eagle_args(query_start_loc=i32(0, 1, 3)), "query_start_loc"),
    "dflash_rejected_len": (_dflash_args(num_rejected_tokens=i32(1, 1)), "num_rejected_tokens"),
    "dflash_block_table_rows": (_dflash_args(block_table=i32_2d([[0], [1]])), "block_table"),
    "dflash_qsl_len": (_dflash_args(query_start_loc=i32(0)), "query_start_loc"),
    "step_input_batch_size_small": (_step_args(input_batch_size=1), "input_batch_size"),
    "step_num_reqs_too_big": (_step_args(num_reqs=np.asarray(3, np.int32)), "num_reqs"),
    # non-positive static sizes
    "step_block_size_0": (_step_args(block_size=0), "block_size"),
    "step_block_size_neg": (_step_args(block_size=-4), "block_size"),
    "step_max_model_len_0": (_step_args(max_model_len=0), "max_model_len"),
    "step_max_model_len_neg": (_step_args(max_model_len=-1), "max_model_len"),
    "dflash_block_size_0": (_dflash_args(block_size=0), "block_size"),
    "dflash_k_0": (_dflash_args(num_speculative_tokens=0), "num_speculative_tokens"),
    "next_vocab_0": (_next_args(vocab_size=0), "vocab_size"),
    "eagle_p_0": (_eagle_args(num_padding_slots_per_request=0), "num_padding_slots_per_request"),
    "eagle_n_out_neg": (_eagle_args(num_output_tokens=-1), "num_output_tokens"),
    "eagle_shift_int": (_eagle_args(shift_input_ids=1), "shift_input_ids"),
    "eagle_pad_id_float": (_eagle_args(padding_token_id=0.5), "padding_token_id"),
    "step_max_model_len_int32": (_step_args(max_model_len=2**31), "max_model_len"),
    "dflash_empty_positions": (_dflash_args(target_positions=i32(), query_start_loc=i32(0, 0)),
                               "target_positions"),
}


@pytest.mark.smoke
@pytest.mark.parametrize("name", sorted(ERROR_CASES))
def test_argument_errors(name):
    (op, kwargs), arg = ERROR_CASES[name]
    with pytest.raises(ValueError, match=arg):
        run_op(op, kwargs, "xla")


@pytest.mark.parametrize("op", cases.OP_NAMES)
@pytest.mark.parametrize("backend", ["cuda", "XLA", "", None])
def test_unknown_backend(op, backend):
    kwargs = HAND_CASES[next(n for n in sorted(HAND_CASES) if HAND_CASES[n][0] == op)][1]
    with pytest.raises(ValueError, match="backend"):
        run_op(op, kwargs, backend)


@pytest.mark.smoke
@pytest.mark.skipif(jax.default_backend() == "gpu", reason="Triton is available on a GPU")
@pytest.mark.parametrize("op", cases.OP_NAMES)
def test_triton_on_cpu_is_refused(op):
    kwargs = HAND_CASES[next(n for n in sorted(HAND_CASES) if HAND_CASES[n][0] == op)][1]
    with pytest.raises(ValueError, match="backend='triton'"):
        run_op(op, kwargs, "triton")
