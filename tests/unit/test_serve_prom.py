"""``/metrics``: the server's instruments and the engine's stats in the Prometheus text format."""

from __future__ import annotations

import re

import attrs
from prometheus_client.parser import text_string_to_metric_families

from wavepp.engine import Result
from wavepp.serve.prom import ServerMetrics, drain_seconds, parse_exposition, sample

# The shape of wavepp.engine.Engine.stats().
STATS = {
    "requests": {"queued": 2, "admitted": 1, "running": 3, "done": 10, "cancelled": 1,
                 "rejected": 0, "failed": 0},
    "queue_depth": 2,
    "tokens_waiting": {"queued": 600, "admitted": 90},
    "queue_oldest_seconds": 1.5,
    "input_tokens": 5000,
    "cached_tokens": 4000,
    "good_hits": 6,
    "expecting_reuse": 8,
    "stages": {0: {"utilization": 0.5, "pool_cached": 10, "pool_free": 20, "pool_capacity": 30},
               1: {"utilization": 0.25, "pool_cached": 11, "pool_free": 19, "pool_capacity": 30}},
    "admission_round_seconds": [0.001, 0.002, 0.003, 0.004],
    "admission_rounds": 4,
    "uptime_s": 12.5,
    "tables": {"records": 12, "waiting": 2},
    "note": "ignored",
    "nothing": None,
}  # fmt: skip

LABEL = r'[a-zA-Z_]\w*="(?:[^"\\\n]|\\.)*"'
LINE = re.compile(rf"^[a-zA-Z_:][a-zA-Z0-9_:]*(\{{{LABEL}(,{LABEL})*\}})? \S+$")


class Stats:
    """What ServerMetrics reads of an engine."""

    def __init__(self, stats: dict, healthy: bool = True) -> None:
        self._stats, self._healthy = stats, healthy

    def stats(self) -> dict:
        return self._stats

    def health(self) -> tuple[bool, str]:
        return self._healthy, "ok" if self._healthy else "rank 1 is gone"


def metrics_of(stats: dict, clock=None, in_flight: int = 0, healthy: bool = True):
    kwargs = {} if clock is None else {"clock": clock}
    return ServerMetrics(Stats(stats, healthy), lambda: in_flight,  # type: ignore[arg-type]
                         lambda: {"serve_handles": in_flight}, **kwargs)  # fmt: skip


def kinds(text: str) -> dict[str, str]:
    """Family name (a counter's without ``_total``) -> type."""
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def result(status: str, tokens: int, cached: int, at: float) -> Result:
    done = status == "done"
    return Result("r", status, 1 if done else None, 1.0 if done else None, tokens, cached,
                  None, at - 0.3, at - 0.2, at - 0.1, at)  # fmt: skip


def test_every_line_is_valid_exposition_and_named_wavepp():
    now = [1000.0]
    metrics = metrics_of(STATS, clock=lambda: now[0], in_flight=3)
    metrics.http_answer("/v1/prefill", 200)
    metrics.http_answer('/odd"route\n', 400)
    for status, tokens, cached in [("done", 100, 80), ("done", 50, 0), ("cancelled", 70, 0)]:
        metrics.observe(result(status, tokens, cached, now[0]))
    now[0] += 10
    text = metrics.exposition().decode()
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.match(r"^# (HELP|TYPE) wavepp_\w+ .+$", line), line
        else:
            assert LINE.match(line), line
            assert line.startswith("wavepp_"), line
    types = kinds(text)
    assert types["wavepp_engine_input_tokens"] == "counter"
    assert types["wavepp_engine_admission_round_seconds"] == "summary"
    assert types["wavepp_time_to_result_seconds"] == "histogram"
    assert types["wavepp_results"] == "counter"
    assert len(re.findall(r"^# TYPE wavepp_up ", text, re.M)) == 1  # one family per name
    s = parse_exposition(text)
    assert sample(s, "wavepp_up") == 1
    assert sample(s, "wavepp_engine_requests", state="running") == 3
    assert sample(s, "wavepp_engine_stages_utilization", stage="1") == 0.25
    assert sample(s, "wavepp_engine_stages_pool_free", stage="0") == 20
    assert sample(s, "wavepp_engine_good_hit_rate") == 0.75
    assert sample(s, "wavepp_engine_input_tokens_total") == 5000
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
    assert sample(s, "wavepp_http_in_flight") == 3
    assert sample(s, "wavepp_uptime_seconds") == 10
    assert sample(s, "wavepp_http_responses_total", route='/odd"route\n',
                  code="400") == 1  # fmt: skip
    assert "note" not in text and "nothing" not in text
    now[0] += 100  # the throughput window forgets old results
    assert sample(parse_exposition(metrics.exposition().decode()),
                  "wavepp_throughput_tokens_per_second") == 0  # fmt: skip


def test_table_sizes_name_the_engines_tables_and_the_servers():
    metrics = metrics_of(STATS, in_flight=2)
    metrics.observe(result("done", 10, 0, 1e12))  # one result in the throughput window
    s = parse_exposition(metrics.exposition().decode())
    sizes = {k: v for k, v in s.items() if k.startswith("wavepp_table_size{")}
    assert sizes == {'wavepp_table_size{table="records"}': 12,
                     'wavepp_table_size{table="waiting"}': 2,
                     'wavepp_table_size{table="serve_handles"}': 2,
                     'wavepp_table_size{table="serve_recent_seconds"}': 1}  # fmt: skip
    assert not any(k.startswith("wavepp_engine_tables") for k in s)
    assert sample(s, "wavepp_table_limit", table="serve_recent_seconds") == 31  # a window
    without = parse_exposition(metrics_of({"queue_depth": 0}).exposition().decode())
    assert sample(without, "wavepp_table_size", table="serve_handles") == 0  # no engine tables


def test_each_server_has_its_own_registry():
    """Two apps in one process (the tests do that) count apart and do not collide."""
    one, two = metrics_of({}), metrics_of({}, healthy=False)
    one.http_answer("/health", 200)
    a = parse_exposition(one.exposition().decode())
    b = parse_exposition(two.exposition().decode())
    assert sample(a, "wavepp_http_responses_total", route="/health", code="200") == 1
    assert sample(b, "wavepp_http_responses_total", route="/health", code="200") is None
    assert (sample(a, "wavepp_up"), sample(b, "wavepp_up")) == (1, 0)


def test_the_drain_time_is_the_waiting_work_at_the_recent_rates():
    # queued prompts at the prompt-token rate, admitted uncached tokens at the computed rate
    assert drain_seconds({"queued": 3000, "admitted": 500}, 1000.0, 250.0) == 5.0
    assert drain_seconds({"queued": 0, "admitted": 0}, 0.0, 0.0) == 0.0  # nothing waits
    assert drain_seconds({"queued": 3000, "admitted": 0}, 1000.0, 0.0) == 3.0
    assert drain_seconds({"queued": 3000, "admitted": 0}, 0.0, 0.0) is None  # no rate yet
    assert drain_seconds({"queued": 0, "admitted": 10}, 1000.0, 0.0) is None


def test_the_autoscaling_figures_follow_the_engine_and_the_done_requests():
    now = [1000.0]
    metrics = metrics_of(STATS, clock=lambda: now[0])
    s = parse_exposition(metrics.exposition().decode())
    assert sample(s, "wavepp_engine_tokens_waiting", state="queued") == 600
    assert sample(s, "wavepp_engine_tokens_waiting", state="admitted") == 90
    assert sample(s, "wavepp_engine_queue_oldest_seconds") == 1.5
    assert sample(s, "wavepp_drain_seconds") is None  # work waits, nothing done yet
    now[0] += 10
    for tokens, cached in [(100, 80), (200, 40)]:  # 300 prompt, 180 computed tokens in 10 s
        metrics.observe(result("done", tokens, cached, now[0]))
    s = parse_exposition(metrics.exposition().decode())
    assert sample(s, "wavepp_throughput_tokens_per_second") == 30.0
    assert sample(s, "wavepp_computed_tokens_per_second") == 18.0
    assert sample(s, "wavepp_drain_seconds") == 600 / 30 + 90 / 18
    idle = metrics_of({**STATS, "tokens_waiting": {"queued": 0, "admitted": 0}})
    assert sample(parse_exposition(idle.exposition().decode()), "wavepp_drain_seconds") == 0


def test_handoffs_count_their_bytes_and_the_slowest_stages_time():
    metrics = metrics_of({})
    stages = [{"stage": 0, "ok": True, "bytes": 1000, "seconds": 0.02},
              {"stage": 1, "ok": True, "bytes": 3000, "seconds": 0.3}]
    done = attrs.evolve(result("done", 10, 0, 1e12),
                        handoff={"status": "done", "stages": stages})
    failed = attrs.evolve(result("failed", 10, 0, 1e12),
                          handoff={"status": "failed", "stages": stages[:1]})
    for r in (done, failed, result("done", 10, 0, 1e12)):
        metrics.observe(r)
    s = parse_exposition(metrics.exposition().decode())
    assert sample(s, "wavepp_handoff_bytes_total") == 5000
    assert sample(s, "wavepp_handoff_seconds_count") == 1  # the done one
    assert sample(s, "wavepp_handoff_seconds_sum") == 0.3
    assert sample(s, "wavepp_handoff_seconds_bucket", le="0.25") == 0


def test_pulled_bands_are_counted_per_stage_by_how_they_ended():
    metrics = metrics_of({})

    def pulled(*stages):
        return attrs.evolve(result("done", 10, 0, 1e12), handoff={
            "target": "pull:", "status": "done", "stages": list(stages)})  # fmt: skip

    ok0 = {"stage": 0, "ok": True, "reason": None, "bytes": 2_000_000_000, "seconds": 0.5,
           "wire_s": 1.0}  # fmt: skip
    ok1 = {**ok0, "stage": 1, "bytes": 1_000_000, "wire_s": 0.001}
    metrics.observe(pulled(ok0, ok1))
    for reason in ("expired", "cancelled", "refused", "disconnected", "timeout"):
        metrics.observe(pulled({"stage": 1, "ok": False, "reason": reason, "bytes": 0,
                                "seconds": 30.0, "wire_s": 0.0}))  # fmt: skip
    pushed = attrs.evolve(result("done", 10, 0, 1e12), handoff={
        "target": "unix:/x", "status": "done", "stages": [ok0]})  # fmt: skip
    metrics.observe(pushed)  # a push is no pull
    s = parse_exposition(metrics.exposition().decode())
    assert sample(s, "wavepp_pull_bytes_total", stage="0") == 2_000_000_000
    assert sample(s, "wavepp_pull_bytes_total", stage="1") == 1_000_000
    assert sample(s, "wavepp_pull_ack_seconds_count", stage="0") == 1
    assert sample(s, "wavepp_pull_ack_seconds_sum", stage="0") == 0.5
    assert sample(s, "wavepp_pull_gigabytes_per_second_bucket", stage="0", le="2.0") == 1
    assert sample(s, "wavepp_pull_gigabytes_per_second_bucket", stage="0", le="1.0") == 0
    assert sample(s, "wavepp_pull_gigabytes_per_second_sum", stage="1") == 1.0
    assert sample(s, "wavepp_pull_lease_expiries_total", stage="1") == 1
    assert sample(s, "wavepp_pull_aborts_total", stage="1", by="wavepp") == 1
    assert sample(s, "wavepp_pull_aborts_total", stage="1", by="decoder") == 1
    assert sample(s, "wavepp_pull_failures_total", stage="1", reason="disconnected") == 1
    assert sample(s, "wavepp_pull_failures_total", stage="1", reason="timeout") == 1
    assert sample(s, "wavepp_pull_lease_expiries_total", stage="0") is None
