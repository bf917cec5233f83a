"""The Prometheus text format of the server's counters and the engine's stats."""

from __future__ import annotations

import re

from wavepp.serve.prom import ServerMetrics, families, parse_exposition, sample
from wavepp.serve.testing import FakeResult

# The shape of wavepp.engine.Engine.stats().
STATS = {
    "requests": {"queued": 2, "admitted": 1, "running": 3, "done": 10, "cancelled": 1,
                 "rejected": 0, "failed": 0},
    "queue_depth": 2,
    "input_tokens": 5000,
    "cached_tokens": 4000,
    "good_hits": 6,
    "expecting_reuse": 8,
    "stages": {0: {"utilization": 0.5, "pool_cached": 10, "pool_free": 20, "pool_capacity": 30},
               1: {"utilization": 0.25, "pool_cached": 11, "pool_free": 19, "pool_capacity": 30}},
    "admission_round_seconds": [0.001, 0.002, 0.003, 0.004],
    "admission_rounds": 4,
    "uptime_s": 12.5,
    "note": "ignored",
    "nothing": None,
}  # fmt: skip

LABEL = r'[a-zA-Z_]\w*="(?:[^"\\\n]|\\.)*"'
LINE = re.compile(rf"^[a-zA-Z_:][a-zA-Z0-9_:]*(\{{{LABEL}(,{LABEL})*\}})? \S+$")


def result(status: str, tokens: int, cached: int, at: float) -> FakeResult:
    done = status == "done"
    return FakeResult("r", status, 1 if done else None, 1.0 if done else None, tokens, cached,
                      None, at - 0.3, at - 0.2, at - 0.1, at)  # fmt: skip


def test_every_line_is_valid_exposition_and_named_wavepp():
    now = [1000.0]
    metrics = ServerMetrics(clock=lambda: now[0])
    metrics.http_answer("/v1/prefill", 200)
    metrics.http_answer('/odd"route\n', 400)
    for status, tokens, cached in [("done", 100, 80), ("done", 50, 0), ("cancelled", 70, 0)]:
        metrics.observe(result(status, tokens, cached, now[0]))
    now[0] += 10
    text = metrics.render(STATS, healthy=True)
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.match(r"^# (HELP|TYPE) wavepp_\w+ .+$", line), line
        else:
            assert LINE.match(line), line
            assert line.startswith("wavepp_"), line
    kinds = dict(families(text))
    assert kinds["wavepp_engine_input_tokens_total"] == "counter"
    assert kinds["wavepp_engine_admission_round_seconds"] == "summary"
    assert kinds["wavepp_time_to_result_seconds"] == "histogram"
    assert len(kinds) == len(set(kinds))
    s = parse_exposition(text)
    assert sample(s, "wavepp_engine_requests", state="running") == 3
    assert sample(s, "wavepp_engine_stages_utilization", stage="1") == 0.25
    assert sample(s, "wavepp_engine_stages_pool_free", stage="0") == 20
    assert sample(s, "wavepp_engine_good_hit_rate") == 0.75
    assert sample(s, "wavepp_engine_admission_round_seconds_count") == 4
    assert abs(sample(s, "wavepp_engine_admission_round_seconds_sum") - 0.01) < 1e-12
    assert sample(s, "wavepp_engine_admission_round_seconds", quantile="0.5") == 0.003
    assert sample(s, "wavepp_results_total", status="done") == 2
    assert sample(s, "wavepp_results_total", status="failed") == 0
    assert sample(s, "wavepp_prompt_tokens_total") == 150
    assert sample(s, "wavepp_cached_tokens_total") == 80
    assert abs(sample(s, "wavepp_reused_share") - 80 / 150) < 1e-12
    assert sample(s, "wavepp_throughput_tokens_per_second") == 15.0  # 150 tokens in 10 s
    assert sample(s, "wavepp_time_to_result_seconds_bucket", le="0.25") == 0
    assert sample(s, "wavepp_time_to_result_seconds_bucket", le="0.5") == 2
    assert sample(s, "wavepp_time_to_result_seconds_bucket", le="+Inf") == 2
    assert sample(s, "wavepp_queue_seconds_count") == 2
    assert sample(s, "wavepp_http_responses_total", route='/odd"route\n',
                  code="400") == 1  # fmt: skip
    assert "note" not in text and "nothing" not in text
    now[0] += 100  # the throughput window forgets old results
    assert sample(parse_exposition(metrics.render({}, True)),
                  "wavepp_throughput_tokens_per_second") == 0  # fmt: skip
