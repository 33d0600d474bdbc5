"""``benchmarks/sampling.py`` (the sampling features' cost in the engine step) on CPU with the
tiny target: every variant's row for every method, each variant's features on as the step
ran them (processor state, sampled path, logprobs bucket and mode), and the penalties
visibly changing the processed logprobs (and not the raw ones) of the step it times."""

import suite_paths  # tests/support: where the suite's pieces are
import dataclasses
import json
import sys

import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(suite_paths.BENCHMARKS))

import e2e  # noqa: E402
import sampling  # noqa: E402

#: variant -> (procs on, greedy batch, logprobs mode or None)
WANT = {
    "a greedy": (False, True, None),
    "b top_k/top_p": (False, False, None),
    "c + penalties, min_p": (True, False, None),
    "d + logprobs=5": (True, False, "raw_logprobs"),
    "e processed logprobs": (True, False, "processed_logprobs"),
    "mixed a|d": (True, False, "raw_logprobs"),
}


@pytest.mark.slow   # ~55 s on 2 shared cores: 15 compiled steps
def test_every_variant_row_with_its_features_on(tmp_path, capsys):
    out = tmp_path / "sampling.json"
    assert sampling.main(["--target", "tiny", "--batch", "2", "--context", "24", "--iters", "1",
                          "--rounds", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["vocab_size"] == e2e.TARGETS["tiny"]["vocab_size"]
    rows = {(r["variant"], r["method"]): r for r in doc["rows"]}
    assert set(rows) == {(v, m) for v in WANT for m in sampling.METHODS}
    table = capsys.readouterr().out
    for (v, m), r in rows.items():
        procs, greedy, mode = WANT[v]
        assert (r["batch"], r["k"]) == (2, 0 if m == "plain" else 3)
        assert r["procs"] is procs and r["all_greedy"] is greedy, (v, m)
        if mode is None:
            assert r["num_logprobs"] is None and r["logprobs_cols"] is None, (v, m)
        else:       # logprobs=5 runs in bucket 8: the emitted token + the top 8
            assert (r["num_logprobs"], r["logprobs_cols"], r["logprobs_mode"]) == (8, 9, mode), (v, m)
            assert r["logprobs_finite"] is True           # every request's emitted token has one
        assert r["ms"] > 0 and r["step_ms"] > 0 and r["build_ms"] > 0
        assert r["ms"] == pytest.approx(r["step_ms"] + r["host_ms"])   # one round: no median mix
        a, b = rows[("a greedy", m)]["ms"], rows[("b top_k/top_p", m)]["ms"]
        assert r["x_a"] == pytest.approx(r["ms"] / a) and r["x_b"] == pytest.approx(r["ms"] / b)
        assert (r["host_ms"] > 0) is (m == "ngram")       # host drafting: the n-gram proposer only
        assert f"| {v} | 2 | {m} | {r['ms']:.3f} | {r['x_a']:.3f} | {r['x_b']:.3f} |" in table


def test_penalties_change_the_processed_logprobs_of_the_timed_step():
    """The variant-e step applies the penalties and min_p: its processed top-n logprobs at
    the first verified position differ from the same batch's without them (and repeat
    exactly with them: the difference is theirs), while the raw ones (variant d) do not."""
    models = e2e.Models("tiny", jnp.float32)
    mml = e2e.max_model_len(24, 3)
    plain = dataclasses.replace(sampling.LOGPROBS, presence_penalty=0.0, frequency_penalty=0.0,
                                repetition_penalty=1.0, min_p=0.0)
    top = {}
    for mode in ("raw_logprobs", "processed_logprobs"):
        eng = sampling.engine(models, "eagle3", 2, mml, 3, jnp.float32, mode)
        for name, sp in (("on", sampling.LOGPROBS), ("off", plain), ("again", sampling.LOGPROBS)):
            batch, out = eng.diagnostics.decode_step_output(2, 24, sampling_params=sp)
            assert (batch.procs is not None) is (name != "off")
            top[mode, name] = np.asarray(out.logprobs.logprobs)[:2, 0, 1:]   # slot 0, the top 8
    assert np.isfinite(top["raw_logprobs", "on"]).all()
    np.testing.assert_array_equal(top["raw_logprobs", "on"], top["raw_logprobs", "off"])
    np.testing.assert_array_equal(top["processed_logprobs", "on"], top["processed_logprobs", "again"])
    assert not np.array_equal(top["processed_logprobs", "on"], top["processed_logprobs", "off"])
    # processed values are a renormalized subset of the vocabulary: above the raw ones
    assert (top["processed_logprobs", "on"][:, 0] > top["raw_logprobs", "on"][:, 0]).all()


def test_bad_variant_is_refused_by_name():
    with pytest.raises(SystemExit):
        sampling.main(["--target", "tiny", "--variants", "z"])


def test_bench_sampling_params_checked_before_work():
    """``engine.diagnostics.time_decode_step(sampling_params=...)``: one per request or one for all,
    each within the engine's processor limits; refused naming the argument otherwise."""
    eng = sampling.engine(e2e.Models("tiny", jnp.float32), "plain", 2, e2e.max_model_len(24, 3), 3,
                          jnp.float32, "raw_logprobs")
    free = len(eng.scheduler.free_rows)
    with pytest.raises(ValueError, match=r"sampling_params must be None, a SamplingParams or 2"):
        eng.diagnostics.time_decode_step(2, 24, sampling_params=[sampling.GREEDY])
    with pytest.raises(ValueError, match=r"sampling_params\[1\]\.logit_bias has 40 entries.*max_logit_bias is 32"):
        eng.diagnostics.time_decode_step(2, 24, sampling_params=[sampling.GREEDY, dataclasses.replace(
            sampling.GREEDY, logit_bias={t: 1.0 for t in range(40)})])
    assert len(eng.scheduler.free_rows) == free         # nothing taken
