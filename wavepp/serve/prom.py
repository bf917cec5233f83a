"""``GET /metrics`` through ``prometheus_client``: the server's instruments and the engine's stats.

Each server has its own :class:`~prometheus_client.CollectorRegistry` holding two sources.
The server's instruments count what it sees (HTTP answers, results as they finish, time to
result, tokens and reuse, recent throughput). At each scrape, :class:`EngineCollector` turns
the engine's ``stats()`` into families as it finds them, every figure a ``wavepp_engine_``
sample: a number is a gauge (a counter for the figures in :data:`COUNTERS`), a dict of
numbers one gauge with a label per key, ``{stage: {field: number}}`` one gauge per field
with a ``stage`` label, a list of seconds a summary; ``stats()["tables"]`` and the
server's own tables are ``wavepp_table_size{table=...}``, and ``stats()["table_limits"]``
(the caps of the tables that are windows of recent history) ``wavepp_table_limit``.

What a prefill autoscaler reads besides time to result: ``wavepp_queue_seconds`` (queue
wait of done requests), ``wavepp_engine_queue_oldest_seconds`` (the wait so far of the
oldest queued request), ``wavepp_engine_tokens_waiting{state=queued|admitted}`` and
``wavepp_drain_seconds`` (:func:`drain_seconds`), all read from state rank 0 keeps anyway.
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from wavepp.handoff.wire import PULL_TARGET
from wavepp.serve.protocol import ServedEngine, ServedResult
from wavepp.stats import percentile

# No ``_created`` timestamp series beside each counter and histogram (a process-wide
# switch of prometheus_client): the exposition keeps one series per figure.
disable_created_metrics()

PREFIX = "wavepp_"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
THROUGHPUT_WINDOW_S = 30.0
QUANTILES = (0.5, 0.9, 0.99)
RESULT_STATUSES = ("done", "cancelled", "rejected", "failed")

# Label names for the engine's dicts of counts, by the dict's key; other dicts get "key".
LABEL_OF = {"requests": "state", "handoffs": "outcome", "tokens_waiting": "state"}

HELP = {
    "requests": "requests by state",
    "handoffs": "requests that handed their cache on, by outcome: done, a failure reason "
    "(timeout, connect, refused, disconnected, bad ack, expired, error) or cancelled",
    "queue_depth": "requests waiting for admission",
    "tokens_waiting": "tokens waiting to be computed: queued = the whole prompts of the requests "
    "waiting for admission (what they reuse is not known yet), admitted = the uncached tokens "
    "of admitted requests that no wave has carried yet",
    "queue_oldest_seconds": "how long the longest-waiting queued request has waited so far, "
    "seconds (0: none queued)",
    "input_tokens": "prompt tokens of done requests (cached included)",
    "cached_tokens": "prompt tokens of done requests served from the cache",
    "good_hits": "done requests that reused ≥ 80% of the prefix they were expected to reuse",
    "expecting_reuse": "done requests that were expected to reuse a prefix",
    "with_deadline": "ended requests that carried a deadline (deadline_s; rejected aside)",
    "deadlines_met": "requests done by their deadline",
    "stages": "per pipeline stage",
    "admission_round_seconds": "admission round time, seconds (recent rounds)",
    "admission_rounds": "admission rounds run",
    "uptime_s": "seconds since the engine started",
}

# Engine figures that only grow: rendered as counters (``_total`` appended).
COUNTERS = {"input_tokens", "cached_tokens", "good_hits", "expecting_reuse", "admission_rounds",
            "with_deadline", "deadlines_met"}

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
GBPS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
# a pulled band's end (wavepp.handoff.base.REASONS) as the pull counters count it
PULL_ABORTS = {"cancelled": "wavepp", "refused": "decoder"}  # reason -> who aborted it


def metric_name(*parts: str) -> str:
    name = re.sub(r"[^a-zA-Z0-9_]", "_", "_".join(p for p in parts if p))
    return name if name.startswith(PREFIX) else PREFIX + name


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and value == value  # NaN is no figure


class _Families:
    """Families by name, so that samples found in any order land in one family each."""

    def __init__(self) -> None:
        self.by_name: dict[str, Metric] = {}

    def gauge(self, name: str, help_text: str, value: float, **labels: str) -> None:
        family = self.by_name.setdefault(name, GaugeMetricFamily(name, help_text,
                                                                 labels=list(labels)))
        family.add_metric(list(labels.values()), float(value))


def engine_families(stats: Mapping[str, Any], prefix: str = PREFIX + "engine") -> Iterator[Metric]:
    """The engine's ``stats()`` as metric families (the shapes: the module docstring)."""
    out = _Families()
    for key, value in stats.items():
        name, key = metric_name(prefix, str(key)), str(key)
        help_text = HELP.get(key, f"engine stats: {name.removeprefix(PREFIX + 'engine_')}")
        if _is_number(value) and key in COUNTERS:
            yield CounterMetricFamily(name, help_text, value=float(value))
        elif _is_number(value):
            out.gauge(name, help_text, value)
        elif isinstance(value, Mapping) and value and all(
                isinstance(v, Mapping) for v in value.values()):  # fmt: skip
            for stage, fields in value.items():  # per stage: {stage: {field: number}}
                for field, v in fields.items():
                    if _is_number(v):
                        out.gauge(metric_name(name, str(field)),
                                  f"{help_text}: {field} per stage", v, stage=str(stage))
        elif isinstance(value, Mapping):
            for k, v in value.items():
                if _is_number(v):
                    out.gauge(name, help_text, v, **{LABEL_OF.get(key, "key"): str(k)})
        elif isinstance(value, Sequence) and not isinstance(value, str) and key.endswith(
                ("seconds", "_s")) and all(_is_number(v) for v in value):  # fmt: skip
            yield _summary(name, help_text, [float(v) for v in value])
    yield from out.by_name.values()
    hits, expecting = stats.get("good_hits"), stats.get("expecting_reuse")
    if _is_number(hits) and _is_number(expecting) and expecting:
        yield GaugeMetricFamily(prefix + "_good_hit_rate",
                                "good hits / done requests expected to reuse a prefix",
                                value=hits / expecting)  # fmt: skip
    met, timed = stats.get("deadlines_met"), stats.get("with_deadline")
    if _is_number(met) and _is_number(timed) and timed:
        yield GaugeMetricFamily(
            prefix + "_slo_attainment",
            "SLO attainment: requests done by their deadline / ended requests with one",
            value=met / timed)  # fmt: skip


def _summary(name: str, help_text: str, values: Sequence[float]) -> Metric:
    """Recent values as a summary: quantiles computed over them, their count and sum."""
    family = Metric(name, help_text, "summary")
    for q in QUANTILES if values else ():
        family.add_sample(name, {"quantile": str(q)}, percentile(values, q * 100))
    family.add_sample(name + "_count", {}, float(len(values)))
    family.add_sample(name + "_sum", {}, float(sum(values)))
    return family


def drain_seconds(tokens_waiting: Mapping[str, Any], prompt_rate: float,
                  computed_rate: float) -> float | None:  # fmt: skip
    """Predicted seconds until the work waiting now is done, at the recent rates: the
    queued prompt tokens at ``prompt_rate`` (prompt tokens done per second, cached
    included: what admission will find cached is not known yet, and a queued prompt
    reuses about what recent ones did) plus the admitted uncached tokens at
    ``computed_rate`` (uncached tokens done per second). 0 with nothing waiting; None when
    some work waits and no rate measures it (nothing of its kind done lately)."""
    queued = tokens_waiting.get("queued", 0)
    admitted = tokens_waiting.get("admitted", 0)
    seconds = 0.0
    for num_tokens, rate in ((queued, prompt_rate), (admitted, computed_rate)):
        if not _is_number(num_tokens) or num_tokens <= 0:
            continue
        if rate <= 0:
            return None
        seconds += num_tokens / rate
    return seconds


DRAIN_HELP = (
    "predicted seconds to finish the work waiting now: queued prompt tokens / prompt tokens "
    "done per second + admitted uncached tokens / uncached tokens done per second, both rates "
    f"over the last {THROUGHPUT_WINDOW_S:g} s; absent while work waits and none of its kind was "
    "done in that window"
)


class EngineCollector:
    """A ``prometheus_client`` collector: at each scrape, the engine's health, its
    ``stats()``, the size of every table (the engine's and the server's), and the
    predicted time to drain (:func:`drain_seconds`)."""

    def __init__(self, engine: ServedEngine, tables: Callable[[], Mapping[str, int]],
                 limits: Callable[[], Mapping[str, int]] = dict,
                 rates: Callable[[], tuple[float, float]] | None = None) -> None:  # fmt: skip
        """``tables``: the server's own tables' sizes; ``limits``: the caps of those that
        are windows of recent history; ``rates``: (prompt, uncached) tokens done per second
        lately."""
        self.engine = engine
        self.tables = tables
        self.limits = limits
        self.rates = rates or (lambda: (0.0, 0.0))

    def collect(self) -> Iterator[Metric]:
        ok, _ = self.engine.health()
        yield GaugeMetricFamily(PREFIX + "up", "1 while every rank answers heartbeats",
                                value=int(ok))  # fmt: skip
        stats = dict(self.engine.stats())
        tables = {**stats.pop("tables", {}), **self.tables()}
        limits = {**stats.pop("table_limits", {}), **self.limits()}
        yield from engine_families(stats)
        waiting = stats.get("tokens_waiting")
        if isinstance(waiting, Mapping):
            drain = drain_seconds(waiting, *self.rates())
            if drain is not None:
                yield GaugeMetricFamily(PREFIX + "drain_seconds", DRAIN_HELP, value=drain)
        yield _by_table("table_size", "entries in each of the engine's and the server's tables",
                        tables)  # fmt: skip
        yield _by_table("table_limit", "the cap of each table that is a window of recent "
                        "history", limits)  # fmt: skip


def _by_table(name: str, help_text: str, figures: Mapping[str, Any]) -> Metric:
    family = GaugeMetricFamily(PREFIX + name, help_text, labels=["table"])
    for table, value in sorted(figures.items()):
        if _is_number(value):
            family.add_metric([str(table)], float(value))
    return family


class ServerMetrics:
    """What the HTTP server counts, and its exposition. Single-threaded: the event loop's.

    ``in_flight`` and ``tables`` are read at each scrape: the prefill requests awaiting
    their result, and the server's tables by name ({name: entries})."""

    def __init__(self, engine: ServedEngine, in_flight: Callable[[], int],
                 tables: Callable[[], Mapping[str, int]], clock=time.time,
                 simulated: bool = False) -> None:  # fmt: skip
        self.clock = clock
        self.started_at = clock()
        self.registry = registry = CollectorRegistry()
        # [second, prompt tokens, uncached tokens] of the done results, one entry per
        # second of the window
        self._recent: deque[list[int]] = deque()
        self._prompt_tokens = self._cached_tokens = 0
        self.http = Counter(PREFIX + "http_responses", "HTTP answers by route and status",
                            ["route", "code"], registry=registry)  # fmt: skip
        self.results = Counter(PREFIX + "results", "finished requests by final status",
                               ["status"], registry=registry)  # fmt: skip
        for status in RESULT_STATUSES:
            self.results.labels(status)
        self.disconnect_cancels = Counter(
            PREFIX + "disconnect_cancels", "requests cancelled because their client disconnected",
            registry=registry)  # fmt: skip
        self.drain_cancels = Counter(
            PREFIX + "drain_cancels",
            "requests cancelled because the drain timeout ran out (interrupted)",
            registry=registry)  # fmt: skip
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens",
                                     "prompt tokens of done requests (cached included)",
                                     registry=registry)  # fmt: skip
        self.cached_tokens = Counter(PREFIX + "cached_tokens",
                                     "prompt tokens of done requests served from the cache",
                                     registry=registry)  # fmt: skip
        self.time_to_result = Histogram(PREFIX + "time_to_result_seconds",
                                        "submission to result, done requests",
                                        buckets=LATENCY_BUCKETS, registry=registry)  # fmt: skip
        self.queue_time = Histogram(PREFIX + "queue_seconds",
                                    "submission to admission, done requests",
                                    buckets=LATENCY_BUCKETS, registry=registry)  # fmt: skip
        self.handoff_bytes = Counter(
            PREFIX + "handoff_bytes", "tensor bytes of prompt caches handed to a decoder "
            "(every stage's band, whatever the handoff's outcome)", registry=registry)  # fmt: skip
        self.handoff_time = Histogram(
            PREFIX + "handoff_seconds", "done handoffs: the request's last chunk to the "
            "decoder's acknowledgement, the slowest stage's", buckets=LATENCY_BUCKETS,
            registry=registry)  # fmt: skip
        self.pulls = PullMetrics(registry)
        gauges: list[tuple[str, str, Callable[[], float]]] = [
            ("uptime_seconds", "seconds since the server started",
             lambda: self.clock() - self.started_at),
            ("http_in_flight", "prefill requests awaiting their result", in_flight),
            ("reused_share", "cached / prompt tokens of done requests", self.reused_share),
            ("throughput_tokens_per_second",
             f"prompt tokens done per second over the last {THROUGHPUT_WINDOW_S:g} s",
             self.throughput),
            ("computed_tokens_per_second",
             f"uncached prompt tokens done per second over the last {THROUGHPUT_WINDOW_S:g} s",
             self.computed_throughput),
        ]  # fmt: skip
        for name, help_text, read in gauges:
            Gauge(PREFIX + name, help_text, registry=registry).set_function(read)
        Gauge(PREFIX + "simulated", "1: the sim executor predicts every wave's time; the "
              "figures are simulated", registry=registry).set(int(simulated))  # fmt: skip
        registry.register(EngineCollector(engine, lambda: {**tables(), **self.tables()},
                                          self.table_limits, self.rates))  # fmt: skip

    def http_answer(self, route: str, status: int) -> None:
        self.http.labels(route, str(status)).inc()

    def observe(self, result: ServedResult) -> None:
        """One finished request (from the engine's results stream)."""
        self.results.labels(result.status).inc()
        self._count_handoff(result.handoff)
        if result.status != "done":
            return
        self._prompt_tokens += result.num_tokens
        self._cached_tokens += result.cached_tokens
        self.prompt_tokens.inc(result.num_tokens)
        self.cached_tokens.inc(result.cached_tokens)
        self.time_to_result.observe(max(result.done_at - result.submitted_at, 0.0))
        if result.admitted_at is not None:
            self.queue_time.observe(max(result.admitted_at - result.submitted_at, 0.0))
        second = int(result.done_at)
        computed = max(result.num_tokens - result.cached_tokens, 0)
        if self._recent and self._recent[-1][0] >= second:  # this second (or one late)
            self._recent[-1][1] += result.num_tokens
            self._recent[-1][2] += computed
        else:
            self._recent.append([second, result.num_tokens, computed])
        self._trim()

    def _count_handoff(self, handoff: Mapping[str, Any] | None) -> None:
        """A result's handoff summary (``Record.handoff_summary``): bytes, and the time of
        a done one; a pulled one's stages one by one (:class:`PullMetrics`)."""
        stages = (handoff or {}).get("stages") or ()
        self.handoff_bytes.inc(sum(s.get("bytes") or 0 for s in stages))
        if handoff and handoff.get("status") == "done" and stages:
            self.handoff_time.observe(max(s.get("seconds") or 0.0 for s in stages))
        if handoff and handoff.get("target") == PULL_TARGET:
            for stage in stages:
                self.pulls.observe(stage)

    def _trim(self) -> None:
        now = self.clock()
        while self._recent and self._recent[0][0] < int(now - THROUGHPUT_WINDOW_S):
            self._recent.popleft()

    def reused_share(self) -> float:
        return self._cached_tokens / self._prompt_tokens if self._prompt_tokens else 0.0

    def throughput(self) -> float:
        """Prompt tokens (cached included) of the requests done in the last window, per second."""
        return self.rates()[0]

    def computed_throughput(self) -> float:
        """Uncached prompt tokens of the requests done in the last window, per second."""
        return self.rates()[1]

    def rates(self) -> tuple[float, float]:
        """(prompt, uncached) tokens of the requests done in the last window, per second."""
        self._trim()
        window = min(THROUGHPUT_WINDOW_S, max(self.clock() - self.started_at, 1e-9))
        return (sum(entry[1] for entry in self._recent) / window,
                sum(entry[2] for entry in self._recent) / window)  # fmt: skip

    def tables(self) -> dict[str, int]:
        return {"serve_recent_seconds": len(self._recent)}

    def table_limits(self) -> dict[str, int]:
        return {"serve_recent_seconds": int(THROUGHPUT_WINDOW_S) + 1}

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class PullMetrics:
    """Bands decoders pulled from the stages' band servers (``pull:``), per stage, from
    each ended request's handoff: bytes, the time from the stage's last chunk to the
    decoder's ack, the transfer's GB/s, and how the others ended — the lease run out,
    aborted (by WavePP: a cancel; by the decoder: its refusal), or failed mid-pull. (The
    pulls a stage refused before sending anything are its figures:
    ``wavepp_engine_stages_pulls_refused``.)"""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.bytes = Counter(PREFIX + "pull_bytes", "band bytes decoders pulled and acknowledged",
                             ["stage"], registry=registry)  # fmt: skip
        self.ack_seconds = Histogram(
            PREFIX + "pull_ack_seconds", "a pulled band: the request's last chunk on the stage "
            "to the decoder's ack (the wait for the decoder included)", ["stage"],
            buckets=LATENCY_BUCKETS, registry=registry)  # fmt: skip
        self.gbps = Histogram(
            PREFIX + "pull_gigabytes_per_second", "a pulled band's bytes over its time on the "
            "wire (the pull's acceptance to the ack), 1e9 bytes per second", ["stage"],
            buckets=GBPS_BUCKETS, registry=registry)  # fmt: skip
        self.expiries = Counter(PREFIX + "pull_lease_expiries", "bands whose lease ran out "
                                "before a decoder pulled them", ["stage"],
                                registry=registry)  # fmt: skip
        self.aborts = Counter(PREFIX + "pull_aborts", "bands held for pulling that were aborted: "
                              "by wavepp (the request cancelled) or by the decoder (its ack "
                              "refused the band)", ["stage", "by"], registry=registry)  # fmt: skip
        self.failures = Counter(PREFIX + "pull_failures", "pulls that failed once under way, by "
                                "reason (disconnected, timeout, bad ack, error)",
                                ["stage", "reason"], registry=registry)  # fmt: skip

    def observe(self, outcome: Mapping[str, Any]) -> None:
        """One stage's outcome in a result's handoff summary."""
        stage, reason = str(outcome.get("stage")), outcome.get("reason")
        if outcome.get("ok"):
            size, wire_s = outcome.get("bytes") or 0, outcome.get("wire_s") or 0.0
            self.bytes.labels(stage).inc(size)
            self.ack_seconds.labels(stage).observe(outcome.get("seconds") or 0.0)
            if wire_s > 0:
                self.gbps.labels(stage).observe(size / wire_s / 1e9)
        elif reason == "expired":
            self.expiries.labels(stage).inc()
        elif reason in PULL_ABORTS:
            self.aborts.labels(stage, PULL_ABORTS[reason]).inc()
        else:
            self.failures.labels(stage, str(reason)).inc()


def _key(name: str, labels: Mapping[str, str]) -> str:
    escaped = (str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
               for v in labels.values())  # fmt: skip
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(zip(labels, escaped, strict=True)))
    return f"{name}{{{inner}}}" if labels else name


def parse_exposition(text: str) -> dict[str, float]:
    """Samples of a text exposition as ``{'name{labels}': value}``, labels sorted by name
    (for the load generator and tests; read them with :func:`sample`)."""
    return {_key(s.name, s.labels): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(samples: Mapping[str, float], name: str, **labels: str) -> float | None:
    return samples.get(_key(name, labels))
