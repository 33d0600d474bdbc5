"""``benchmarks/prefill.py`` (time to first token against PyTorch and the attention options
for long queries, issue 50) on CPU: ``--tiny`` gives the engine TTFT, the bare forward and
every attention option as a row (measured, skipped with a reason, or the failure recorded:
never fatal), the outputs checked against the float64 oracle; the FLOP count by hand."""

import suite_paths  # tests/support: where the suite's pieces are
import json
import sys

import pytest


sys.path.insert(0, str(suite_paths.BENCHMARKS))

import prefill  # noqa: E402


def test_prefill_flops_counted_by_hand():
    geo = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, head_dim=4, vocab_size=10)
    fl = prefill.prefill_flops(geo, 3)
    # per token and layer: 2 x (q|k|v 8 x 16 + o 8 x 8 + gate/up/down 3 x 8 x 16) = 2 x 576
    assert fl["dense"] == 2 * 3 * 2 * 576
    # causal: 4 x heads x head_dim x T(T+1)/2 per layer = 4 x 2 x 4 x 6
    assert fl["attention"] == 2 * 4 * 2 * 4 * 6
    assert fl["head"] == 2 * 8 * 10
    assert fl["total"] == fl["dense"] + fl["attention"] + fl["head"]


def test_tiny_run_records_every_case(tmp_path, capsys):
    out = tmp_path / "prefill.json"
    assert prefill.main(["--tiny", "--prompts", "32", "--parts", "engine,forward,torch,attention,gemm",
                         "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    by = {r["case"]: r for r in rows if "case" in r}
    for case in ("engine TTFT", "specjax forward"):
        assert by[case]["ms"] > 0 and by[case]["tflops"] > 0 and "error" not in by[case]
    assert by["specjax forward"]["attn_backend"] == "xla"
    assert 0 <= by["specjax forward"]["token"] < prefill.floors.TARGETS["tiny"]["vocab_size"]
    att = {r["case"]: r for r in rows if r.get("kind") == "attention"}
    assert set(att) == set(prefill.ATTN_CASES)
    for case in ("specjax:xla", "specjax:pallas", "jax_dpa_xla"):   # fp32: the oracle's figures
        assert att[case]["ms"] > 0 and att[case]["rel_err"] < 1e-5, case
    assert att["specjax:auto"]["note"].startswith("-> ")      # the backend "auto" resolved to
    for r in att.values():      # each measured, skipped with a reason or its failure recorded
        assert ("ms" in r) or ("skipped" in r) or ("error" in r), r
    gemm = next(r for r in rows if r.get("kind") == "gemm")
    assert gemm["tflops"] > 0 and doc["gemm_tflops"] == gemm["tflops"]
    table = capsys.readouterr().out
    assert "| prompt tokens | specjax TTFT ms |" in table and "| 32 | specjax:xla |" in table


@pytest.mark.slow   # two engines compiled with a proposer: ~15 s
def test_tiny_batch_prefill_rows(tmp_path):
    out = tmp_path / "batch.json"
    assert prefill.main(["--tiny", "--batch-prefill", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["plain", "eagle3"]
    for r in rows:
        assert "error" not in r, r
        assert (r["batch"], r["prompt"]) == (4, 32)
        assert r["ttft_ms"] > 0 and r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0
