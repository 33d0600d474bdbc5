"""Host/device overlap of the engine's decoding phase (``LoopOptions(overlap=True)``,
``specjax.engine.device_loop``): the next device-loop call is dispatched from the previous
call's device state before the host commits it.

References: the engine without overlap (``overlap=False``, itself checked against the
per-step loop and plain greedy decoding in ``test_decode_loop.py`` / ``test_engine.py``) for
the tokens, finish reasons and per-request acceptance counts; the compilation log for
recompiles.
"""

import logging

import jax
import pytest

from specjax.runtime.decode_loop import loop_cache_size
from specjax.engine import Engine, LoopOptions, SamplingParams, generate, step_cache_size

try:
    from test_engine import (FIXED, METHODS, PARAMS_A, PARAMS_B, PROMPTS_A, PROMPTS_B,
                             baseline, build, eos_b, fixed, target)  # noqa: F401
except ImportError:  # tests/ made a package
    from tests.test_engine import (FIXED, METHODS, PARAMS_A, PARAMS_B, PROMPTS_A,  # noqa: F401
                                   PROMPTS_B, baseline, build, eos_b, fixed,
                                   target)


def run(proposer, which: str, n: int, overlap: bool, params=None):
    if which == "A":
        return generate(target(), proposer, PROMPTS_A, params or PARAMS_A,
                        **fixed(steps_per_sync=n, overlap=overlap))
    return generate(target(), proposer, PROMPTS_B, params or PARAMS_B, max_num_seqs=3,
                    eos_token_id=eos_b(), **fixed(steps_per_sync=n, overlap=overlap))


def _per_request(res):
    return [(o.finish_reason, o.num_draft_tokens, o.num_accepted_tokens) for o in res.outputs]


@pytest.mark.parametrize("method", [pytest.param(None, marks=pytest.mark.smoke), "eagle3",
                                    "draft_model", "ngram_gpu"])
@pytest.mark.parametrize("n", [1, 4])
def test_greedy_overlap_equals_no_overlap(method, n):
    """Workload A (all at once) and B (3 rows, 7 requests joining as others leave, EOS and
    max_tokens stops): the same tokens, finish reasons and per-request draft / accepted
    counts as without overlap, and as plain greedy decoding."""
    if method is not None and method not in METHODS:
        pytest.skip(f"{method} not available")
    prop = None if method is None else build(method, 3)
    for which in ("A", "B"):
        off = run(prop, which, n, False)
        on = run(prop, which, n, True)
        assert on.token_ids == off.token_ids == baseline(which).token_ids, (method, which)
        assert _per_request(on) == _per_request(off)
        assert on.spec_stats == off.spec_stats


def test_sampled_overlap_equals_no_overlap():
    """Seeded sampling (temperature, top-k, top-p; greedy rows mixed in): identical tokens
    (a request's key folds in its own generated count, whatever the batch)."""
    sps = [SamplingParams(max_tokens=m, temperature=t, top_k=tk, top_p=tp, seed=s)
           for m, t, tk, tp, s in ((9, 1.0, 0, 1.0, 1), (3, 0.0, 0, 1.0, None), (25, 0.8, 5, 1.0, 2),
                                   (14, 1.2, 0, 0.9, 3), (30, 1.0, 0, 1.0, 4), (7, 0.5, 3, 0.8, 5),
                                   (18, 1.0, 0, 1.0, 6))]
    for method in ("draft_model", None):
        prop = None if method is None else build(method, 3)
        for n in (1, 3):
            off = run(prop, "B", n, False, params=sps)
            on = run(prop, "B", n, True, params=sps)
            assert on.token_ids == off.token_ids, (method, n)
            assert _per_request(on) == _per_request(off)


def test_overlap_dispatches_ahead_and_frees_everything(monkeypatch):
    """The next call is dispatched before the previous one is committed (in the steady
    state, dispatch / commit alternate with one call in flight), every block and row comes
    back, and a second run compiles nothing."""
    import specjax.engine.device_loop as dl

    eng = Engine(target(), build("eagle3", 3), max_num_seqs=3,
                 **fixed(steps_per_sync=1, overlap=True))
    events = []
    disp, comm = dl.DeviceLoopDriver.dispatch, dl.DeviceLoopDriver.commit
    monkeypatch.setattr(dl.DeviceLoopDriver, "dispatch",
                        lambda self, *a, **k: events.append("d") or disp(self, *a, **k))
    monkeypatch.setattr(dl.DeviceLoopDriver, "commit",
                        lambda self, *a, **k: events.append("c") or comm(self, *a, **k))
    out = eng.generate(PROMPTS_B, PARAMS_B, eos_token_id=eos_b())
    assert out.token_ids == baseline("B").token_ids
    seq = "".join(events)
    assert "ddc" in seq and seq.count("d") == seq.count("c")     # ahead by one; all committed
    assert len(eng.scheduler.free_blocks) == eng.num_blocks - 1
    assert len(eng.scheduler.free_rows) == 3
    assert eng.host_s > 0 and eng.wait_s > 0
    before = (loop_cache_size(), step_cache_size())
    again = eng.generate(PROMPTS_B[::-1], PARAMS_B[::-1], eos_token_id=eos_b())
    assert again.token_ids == baseline("B").token_ids[::-1]
    assert (loop_cache_size(), step_cache_size()) == before


@pytest.mark.smoke
def test_overlap_refused_by_name():
    for method, extra, match in (("ngram", {}, "overlap=True: method='ngram'"),
                                 ("suffix", {}, "overlap=True: method='suffix'"),
                                 ("eagle3", dict(disable_padded_drafter_batch=True),
                                  "overlap=True: disable_padded_drafter_batch")):
        if method not in METHODS:
            continue
        with pytest.raises(ValueError, match=match):
            Engine(target(), build(method, 3, **extra), **dict(fixed(overlap=True), max_num_seqs=4))
    for bad in (1, "yes", 0.0):
        with pytest.raises(ValueError, match="overlap must be True, False or None"):
            LoopOptions(overlap=bad)
        with pytest.raises(ValueError, match="early_exit must be True, False or None"):
            LoopOptions(early_exit=bad)


@pytest.mark.smoke
@pytest.mark.parametrize("on_cpu", [False, True])
def test_defaults_overlap_the_device_loop_with_the_fixed_trip_form_unless_a_request_waits(
        monkeypatch, on_cpu):
    """The defaults (overlap=None, early_exit=None): overlap on where the device loop
    runs the proposer, per-step (N = 1) too unless only the while form runs there (a CPU
    target, or early_exit=True), off for host proposers; each device-loop call uses the
    fixed-trip form while no request waits and the early-exit form when one does, and on a
    CPU target the early-exit form for every call (``on_cpu``: what the engine finds the
    target's devices to be)."""
    import specjax.engine.device_loop as dl

    monkeypatch.setattr(dl, "_on_cpu", lambda params: on_cpu)

    def overlap(prop=None, **loop):
        return Engine(target(), prop, max_num_seqs=2, **fixed(**loop)).options.overlap

    assert overlap() is True
    assert overlap(steps_per_sync=1) is (not on_cpu)
    assert overlap(steps_per_sync=1, overlap=False) is False
    assert overlap(steps_per_sync=1, early_exit=True) is False
    assert overlap(steps_per_sync=4, early_exit=True) is True
    if "ngram" in METHODS:
        assert overlap(build("ngram", 3)) is False
    forms = []
    real = dl.decode_loop

    def spy(*a, **kw):
        forms.append((bool(kw["stop_on_finish"]), kw["early_exit"]))
        return real(*a, **kw)

    monkeypatch.setattr(dl, "decode_loop", spy)
    eng = Engine(target(), None, max_num_seqs=2, **fixed(steps_per_sync=4))
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]          # 3 requests, 2 at a time: one waits
    eng.generate(prompts, [SamplingParams(max_tokens=m, ignore_eos=True) for m in (3, 12, 12)])
    assert eng.driver.forms() == ((True,) if on_cpu else (False, True))
    if on_cpu:
        assert (True, True) in forms and (False, True) in forms
        assert all(ee for _, ee in forms)
    else:
        assert (True, True) in forms and (False, False) in forms
        assert all(stop == ee for stop, ee in forms)


def test_cpu_target_found_from_its_params():
    """``_on_cpu``: True for params on CPU devices (this suite's), from the arrays' devices,
    and the backend's platform for host arrays."""
    import numpy as np
    from specjax.engine.device_loop import _on_cpu

    assert _on_cpu({"w": jax.device_put(np.ones(2), jax.devices("cpu")[0])}) is True
    assert _on_cpu({"w": np.ones(2)}) is (jax.default_backend() == "cpu")
    assert Engine(target(), None, **dict(FIXED, max_num_seqs=2)).driver.idle_early_exit is (
        jax.devices()[0].platform == "cpu")


def test_tree_overlap_equals_plain_greedy():
    """Tree verification (a branching EAGLE-3 tree) under overlap: plain greedy's tokens
    (its acceptance counts may differ: a step that prefills a joining request verifies no
    tree, and overlap runs one more tree step before a request joins)."""
    if "eagle3" not in METHODS:
        pytest.skip("eagle3 not available")
    tree = [(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (1, 0, 0)]
    prop = build("eagle3", len(tree), speculative_token_tree=str(tree))
    for which in ("A", "B"):
        for n in (1, 4):
            assert run(prop, which, n, True).token_ids == baseline(which).token_ids, (which, n)


def test_no_call_dispatched_ahead_once_every_request_surely_finishes(monkeypatch):
    """With overlap, a call is not dispatched after one in which every request surely
    finishes (within ``steps_per_sync`` tokens of ``max_tokens``): no call runs only masked
    iterations at the end of a batch. Reference: the same tokens as without overlap, and a
    spy on every device-loop call's iteration count."""
    import specjax.engine.device_loop as dl

    runs = []
    real = dl.decode_loop

    def spy(*a, **kw):
        out = real(*a, **kw)
        runs.append(int(jax.device_get(out[0].num_iters)))
        return out

    monkeypatch.setattr(dl, "decode_loop", spy)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    sps = SamplingParams(max_tokens=11, ignore_eos=True)
    got = generate(target(), None, prompts, sps, max_num_seqs=2,
                   **fixed(steps_per_sync=4, overlap=True))
    assert runs and all(n > 0 for n in runs), runs
    runs.clear()
    want = generate(target(), None, prompts, sps, max_num_seqs=2,
                    **fixed(steps_per_sync=4, overlap=False))
    assert got.token_ids == want.token_ids
