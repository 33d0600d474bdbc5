"""Spec-decoding metrics: stats, the log line (numbers worked out by hand) and the real
Prometheus exposition text from a fresh CollectorRegistry."""

from __future__ import annotations

import math
import re

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from specjax.metrics import LOG_FORMAT, SpecDecodingLogging, SpecDecodingProm, SpecDecodingStats


class FakeClock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def capture():
    calls = []
    return calls, lambda fmt, *args: calls.append((fmt, args))


# ---------------------------------------------------------------------- stats


def test_stats_new_and_observe_draft():
    s = SpecDecodingStats.new(3)
    assert s == SpecDecodingStats(3, 0, 0, 0, [0, 0, 0])
    s.observe_draft(num_draft_tokens=3, num_accepted_tokens=2)
    s.observe_draft(num_draft_tokens=3, num_accepted_tokens=0)
    s.observe_draft(num_draft_tokens=3, num_accepted_tokens=3)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 9, 5)
    assert s.num_accepted_tokens_per_pos == [2, 2, 1]


def test_stats_bound_check():
    s = SpecDecodingStats.new(2)
    with pytest.raises(ValueError, match="num_spec_tokens"):
        s.observe_draft(num_draft_tokens=2, num_accepted_tokens=3)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        s.observe_draft(num_draft_tokens=-1, num_accepted_tokens=0)
    with pytest.raises(ValueError, match="num_accepted_tokens"):
        s.observe_draft(num_draft_tokens=1, num_accepted_tokens=1.0)
    assert s == SpecDecodingStats.new(2)  # rejected calls change nothing
    with pytest.raises(ValueError, match="num_spec_tokens"):
        SpecDecodingStats.new(-1)


# ---------------------------------------------------------------------- logging


def test_log_line_and_formulas():
    clock = FakeClock(100.0)
    logging_ = SpecDecodingLogging(clock=clock)
    step1 = SpecDecodingStats.new(3)
    step1.observe_draft(3, 3)
    step1.observe_draft(3, 1)
    step2 = SpecDecodingStats.new(3)
    step2.observe_draft(3, 2)
    step2.observe_draft(2, 0)
    logging_.observe(step1)
    logging_.observe(step2)
    clock.t = 104.0
    calls, log_fn = capture()
    logging_.log(log_fn=log_fn)
    assert len(calls) == 1
    fmt, args = calls[0]
    assert fmt == LOG_FORMAT
    # By hand: 4 drafts, 11 drafted, 6 accepted over 4 s.
    # mean acceptance length 1 + 6/4 = 2.5; accepted 1.5 tok/s; drafted 2.75 tok/s;
    # per position: pos0 accepted by 3 drafts, pos1 by 2, pos2 by 1 -> 0.75, 0.5, 0.25;
    # acceptance rate 6/11 = 54.5454...%.
    assert args[:5] == (2.5, 1.5, 2.75, 6, 11)
    assert args[5] == "0.750, 0.500, 0.250"
    assert args[6] == pytest.approx(600 / 11)
    assert fmt % args == (
        "SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: 1.50 tokens/s, "
        "Drafted throughput: 2.75 tokens/s, Accepted: 6 tokens, Drafted: 11 tokens, "
        "Per-position acceptance rate: 0.750, 0.500, 0.250, Avg Draft acceptance rate: 54.5%"
    )
    # It reset: nothing is logged until new stats arrive, and the window restarts at 104.
    logging_.log(log_fn=log_fn)
    assert len(calls) == 1
    assert logging_.last_log_time == 104.0
    step3 = SpecDecodingStats.new(3)
    step3.observe_draft(3, 1)
    logging_.observe(step3)
    clock.t = 106.0
    logging_.log(log_fn=log_fn)
    assert calls[1][1][:6] == (2.0, 0.5, 1.5, 1, 3, "1.000, 0.000, 0.000")


def test_log_edge_cases():
    clock = FakeClock(5.0)
    logging_ = SpecDecodingLogging(clock=clock)
    logging_.observe(SpecDecodingStats.new(2))  # observed, but no drafts
    calls, log_fn = capture()
    logging_.log(log_fn=log_fn)  # elapsed 0 -> throughputs 0
    (fmt, args), = calls
    assert args[1] == 0.0 and args[2] == 0.0
    assert math.isnan(args[0]) and math.isnan(args[6])
    assert args[5] == "nan, nan"
    assert fmt % args == (
        "SpecDecoding metrics: Mean acceptance length: nan, Accepted throughput: 0.00 tokens/s, "
        "Drafted throughput: 0.00 tokens/s, Accepted: 0 tokens, Drafted: 0 tokens, "
        "Per-position acceptance rate: nan, nan, Avg Draft acceptance rate: nan%"
    )
    logging_.observe(SpecDecodingStats.new(2))
    with pytest.raises(ValueError, match="positions"):
        logging_.observe(SpecDecodingStats.new(3))


def test_log_uses_the_module_logger_by_default(caplog):
    logging_ = SpecDecodingLogging()
    s = SpecDecodingStats.new(1)
    s.observe_draft(1, 1)
    logging_.observe(s)
    with caplog.at_level("INFO", logger="specjax.metrics"):
        logging_.log()
    assert re.search(r"SpecDecoding metrics: Mean acceptance length: 2\.00, .* Avg Draft acceptance rate: 100\.0%", caplog.text)


# ---------------------------------------------------------------------- prometheus


def samples(registry: CollectorRegistry) -> dict:
    """Parse the exposition text: {(name, frozenset(labels)): value}, _created excluded."""
    out = {}
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith("#") or not line:
            continue
        m = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)", line)
        assert m, line
        name, labels, value = m.groups()
        if name.endswith("_created"):
            continue
        pairs = frozenset(re.findall(r'(\w+)="([^"]*)"', labels or ""))
        out[(name, pairs)] = float(value)
    return out


def test_prometheus_names_help_labels_and_values():
    registry = CollectorRegistry()
    prom = SpecDecodingProm(2, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]}, registry=registry)
    s = SpecDecodingStats.new(2)
    s.observe_draft(2, 2)
    s.observe_draft(2, 1)
    s.observe_draft(1, 0)
    prom.observe(s)
    prom.observe(s)
    prom.observe(s, engine_idx=1)

    text = generate_latest(registry).decode()
    for name, doc in [
        ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
        ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
        ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
        ("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position."),
    ]:
        assert f"# HELP {name}_total {doc}\n" in text
        assert f"# TYPE {name}_total counter\n" in text

    got = samples(registry)
    e0 = {("model_name", "m"), ("engine", "0")}
    e1 = {("model_name", "m"), ("engine", "1")}
    assert got == {
        ("vllm:spec_decode_num_drafts_total", frozenset(e0)): 6.0,
        ("vllm:spec_decode_num_draft_tokens_total", frozenset(e0)): 10.0,
        ("vllm:spec_decode_num_accepted_tokens_total", frozenset(e0)): 6.0,
        ("vllm:spec_decode_num_accepted_tokens_per_pos_total", frozenset(e0 | {("position", "0")})): 4.0,
        ("vllm:spec_decode_num_accepted_tokens_per_pos_total", frozenset(e0 | {("position", "1")})): 2.0,
        ("vllm:spec_decode_num_drafts_total", frozenset(e1)): 3.0,
        ("vllm:spec_decode_num_draft_tokens_total", frozenset(e1)): 5.0,
        ("vllm:spec_decode_num_accepted_tokens_total", frozenset(e1)): 3.0,
        ("vllm:spec_decode_num_accepted_tokens_per_pos_total", frozenset(e1 | {("position", "0")})): 2.0,
        ("vllm:spec_decode_num_accepted_tokens_per_pos_total", frozenset(e1 | {("position", "1")})): 1.0,
    }


def test_prometheus_prefix_and_config_object():
    class Config:
        num_speculative_tokens = 1

    registry = CollectorRegistry()
    prom = SpecDecodingProm(Config(), ["engine"], {0: ["0"]}, prefix="specjax:", registry=registry)
    s = SpecDecodingStats.new(1)
    s.observe_draft(1, 1)
    prom.observe(s)
    got = samples(registry)
    assert got[("specjax:spec_decode_num_drafts_total", frozenset({("engine", "0")}))] == 1.0
    assert not any(name.startswith("vllm:") for name, _ in got)
    # The same names again in the same registry collide, as in prometheus_client.
    with pytest.raises(ValueError):
        SpecDecodingProm(Config(), ["engine"], {0: ["0"]}, prefix="specjax:", registry=registry)
    # A different prefix coexists.
    SpecDecodingProm(Config(), ["engine"], {0: ["0"]}, prefix="other:", registry=registry)


def test_prometheus_disabled_without_config():
    registry = CollectorRegistry()
    prom = SpecDecodingProm(None, ["model_name", "engine"], {0: ["m", "0"]}, registry=registry)
    prom.observe(SpecDecodingStats.new(4))
    assert generate_latest(registry).decode() == ""


def test_prometheus_bad_arguments():
    registry = CollectorRegistry()
    with pytest.raises(ValueError, match="per_engine_labelvalues"):
        SpecDecodingProm(2, ["model_name", "engine"], {0: ["m"]}, registry=registry)
    with pytest.raises(ValueError, match="position"):
        SpecDecodingProm(2, ["position"], {0: ["0"]}, registry=registry)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpecDecodingProm(-2, ["engine"], {0: ["0"]}, registry=registry)
    prom = SpecDecodingProm(2, ["engine"], {0: ["0"]}, registry=registry)
    with pytest.raises(ValueError, match="engine_idx"):
        prom.observe(SpecDecodingStats.new(2), engine_idx=3)
    with pytest.raises(ValueError, match="positions"):
        prom.observe(SpecDecodingStats.new(3))
