"""``GET /metrics``: the server's counters and the engine's stats in Prometheus text format.

Two sources. :class:`ServerMetrics` counts what the server sees (HTTP answers, results
as they finish, time to result, tokens and reuse, recent throughput). The engine's
``stats()`` dict is rendered as it is, every figure a ``wavepp_`` sample: a number is a
gauge, a dict of numbers one gauge with a label per key, a list of numbers one gauge
per stage (or a summary for a list of seconds), a list of dicts one sample per stage
and field. Names and label values are escaped as the exposition format requires.
"""

from __future__ import annotations

import bisect
import math
import re
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from wavepp.stats import percentile

PREFIX = "wavepp_"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
THROUGHPUT_WINDOW_S = 30.0

# Label names for the engine's dicts of counts, by the dict's key; other dicts get "key".
LABEL_OF = {"requests": "state", "counts": "state", "states": "state", "by_state": "state",
            "handoffs": "outcome"}

HELP = {
    "requests": "requests by state",
    "handoffs": "requests that handed their cache on, by outcome: done, a failure reason "
    "(timeout, connect, refused, disconnected, bad ack, error) or cancelled",
    "queue_depth": "requests waiting for admission",
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

# Engine figures that only grow: rendered as counters, ``_total`` appended.
COUNTERS = {"input_tokens", "cached_tokens", "good_hits", "expecting_reuse", "admission_rounds",
            "with_deadline", "deadlines_met"}


def escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def metric_name(*parts: str) -> str:
    name = "_".join(p for p in parts if p)
    name = re.sub(r"[^a-zA-Z0-9_]", "_", name)
    if name[:1].isdigit():
        name = "_" + name
    return name if name.startswith(PREFIX) else PREFIX + name


def _number(value: float) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{escape_label(str(v))}"' for k, v in labels.items())
    return "{" + inner + "}"


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not (isinstance(value, float) and math.isnan(value))


class Exposition:
    """Collects families (HELP, TYPE, samples) and renders the text format."""

    def __init__(self) -> None:
        self._families: dict[str, tuple[str, str, list[str]]] = {}

    def add(
        self,
        name: str,
        kind: str,
        help_text: str,
        value: float,
        labels: Mapping[str, str] | None = None,
        suffix: str = "",
    ) -> None:
        family = self._families.setdefault(name, (kind, help_text, []))
        family[2].append(f"{name}{suffix}{_labels(labels or {})} {_number(value)}")

    def summary(self, name: str, help_text: str, values: Sequence[float]) -> None:
        for q in (0.5, 0.9, 0.99):
            if values:
                self.add(
                    name, "summary", help_text, percentile(values, q * 100), {"quantile": str(q)}
                )
        self.add(name, "summary", help_text, len(values), suffix="_count")
        self.add(name, "summary", help_text, float(sum(values)), suffix="_sum")

    def histogram(
        self,
        name: str,
        help_text: str,
        buckets: Sequence[float],
        counts: Sequence[int],
        total: float,
    ) -> None:
        running = 0
        for bound, count in zip(buckets, counts, strict=False):
            running += count
            self.add(
                name, "histogram", help_text, running, {"le": _number(float(bound))}, "_bucket"
            )
        running += counts[len(buckets)]
        self.add(name, "histogram", help_text, running, {"le": "+Inf"}, "_bucket")
        self.add(name, "histogram", help_text, running, suffix="_count")
        self.add(name, "histogram", help_text, total, suffix="_sum")

    def render(self) -> str:
        lines = []
        for name, (kind, help_text, samples) in self._families.items():
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(samples)
        return "\n".join(lines) + "\n"


def add_stats(out: Exposition, stats: Mapping[str, Any], prefix: str = "") -> None:
    """The engine's ``stats()`` as gauges (see the module docstring for the shapes)."""
    for key, value in stats.items():
        name = metric_name(prefix, str(key))
        help_text = HELP.get(str(key), f"engine stats: {name.removeprefix(PREFIX + 'engine_')}")
        if value is None or isinstance(value, str):
            continue
        if _is_number(value) and str(key) in COUNTERS:
            out.add(name + "_total", "counter", help_text, value)
        elif _is_number(value):
            out.add(name, "gauge", help_text, value)
        elif isinstance(value, Mapping):
            if (
                value
                and all(isinstance(v, Mapping) for v in value.values())
                and all(str(k).isdigit() for k in value)
            ):  # per stage: {stage: {field: number}}
                _per_stage(out, name, help_text, value.items())
            elif all(_is_number(v) for v in value.values()):
                label = LABEL_OF.get(str(key), "key")
                for k, v in value.items():
                    out.add(name, "gauge", help_text, v, {label: str(k)})
            else:
                add_stats(out, value, prefix=name)
        elif isinstance(value, Sequence):
            if all(_is_number(v) for v in value):
                if str(key).endswith(("seconds", "_s")):
                    out.summary(name, help_text, [float(v) for v in value])
                else:
                    for stage, v in enumerate(value):
                        out.add(name, "gauge", help_text, v, {"stage": str(stage)})
            elif all(isinstance(v, Mapping) for v in value):
                _per_stage(out, name, help_text, enumerate(value))


def _per_stage(out: Exposition, name: str, help_text: str, parts) -> None:
    for stage, part in parts:
        for field, v in part.items():
            if _is_number(v):
                out.add(
                    metric_name(name, str(field)),
                    "gauge",
                    f"{help_text}: {field} per stage",
                    v,
                    {"stage": str(stage)},
                )


class Histogram:
    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value


class ServerMetrics:
    """What the HTTP server itself counts. Single-threaded: the event loop's only."""

    def __init__(self, clock=time.time) -> None:
        self.clock = clock
        self.started_at = clock()
        self.http: dict[tuple[str, int], int] = {}
        self.results = dict.fromkeys(("done", "cancelled", "rejected", "failed"), 0)
        self.disconnect_cancels = 0
        self.drain_cancels = 0  # cancelled because the drain timeout ran out
        self.in_flight = 0  # prefill HTTP requests awaiting their result
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.time_to_result = Histogram()
        self.queue_time = Histogram()
        self._recent: deque[tuple[float, int]] = deque()  # (done_at, tokens) of done results

    def http_answer(self, route: str, status: int) -> None:
        self.http[(route, status)] = self.http.get((route, status), 0) + 1

    def observe(self, result: Any) -> None:
        """One finished request (from the engine's results stream)."""
        self.results[result.status] = self.results.get(result.status, 0) + 1
        if result.status != "done":
            return
        self.prompt_tokens += result.num_tokens
        self.cached_tokens += result.cached_tokens
        self.time_to_result.observe(max(result.done_at - result.submitted_at, 0.0))
        if result.admitted_at is not None:
            self.queue_time.observe(max(result.admitted_at - result.submitted_at, 0.0))
        self._recent.append((result.done_at, result.num_tokens))

    def throughput(self) -> float:
        """Prompt tokens (cached included) of the requests done in the last window, per second."""
        now = self.clock()
        while self._recent and self._recent[0][0] < now - THROUGHPUT_WINDOW_S:
            self._recent.popleft()
        window = min(THROUGHPUT_WINDOW_S, max(now - self.started_at, 1e-9))
        return sum(tokens for _, tokens in self._recent) / window

    def render(self, stats: Mapping[str, Any], healthy: bool) -> str:
        out = Exposition()
        out.add(PREFIX + "up", "gauge", "1 while every rank answers heartbeats", int(healthy))
        out.add(
            PREFIX + "uptime_seconds",
            "gauge",
            "seconds since the server started",
            self.clock() - self.started_at,
        )
        out.add(
            PREFIX + "http_in_flight",
            "gauge",
            "prefill requests awaiting their result",
            self.in_flight,
        )
        for (route, status), n in sorted(self.http.items()):
            out.add(
                PREFIX + "http_responses_total",
                "counter",
                "HTTP answers by route and status",
                n,
                {"route": route, "code": str(status)},
            )
        for status, n in sorted(self.results.items()):
            out.add(
                PREFIX + "results_total",
                "counter",
                "finished requests by final status",
                n,
                {"status": status},
            )
        out.add(
            PREFIX + "disconnect_cancels_total",
            "counter",
            "requests cancelled because their client disconnected",
            self.disconnect_cancels,
        )
        out.add(
            PREFIX + "drain_cancels_total",
            "counter",
            "requests cancelled because the drain timeout ran out (interrupted)",
            self.drain_cancels,
        )
        out.add(
            PREFIX + "prompt_tokens_total",
            "counter",
            "prompt tokens of done requests (cached included)",
            self.prompt_tokens,
        )
        out.add(
            PREFIX + "cached_tokens_total",
            "counter",
            "prompt tokens of done requests served from the cache",
            self.cached_tokens,
        )
        out.add(
            PREFIX + "reused_share",
            "gauge",
            "cached / prompt tokens of done requests",
            self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
        )
        out.add(
            PREFIX + "throughput_tokens_per_second",
            "gauge",
            f"prompt tokens done per second over the last {THROUGHPUT_WINDOW_S:g} s",
            self.throughput(),
        )
        for name, hist, text in [
            ("time_to_result_seconds", self.time_to_result, "submission to result, done requests"),
            ("queue_seconds", self.queue_time, "submission to admission, done requests"),
        ]:
            out.histogram(PREFIX + name, text, hist.buckets, hist.counts, hist.total)
        add_stats(out, stats, prefix=PREFIX + "engine")
        hits, expecting = stats.get("good_hits"), stats.get("expecting_reuse")
        if _is_number(hits) and _is_number(expecting) and expecting:
            out.add(
                PREFIX + "engine_good_hit_rate",
                "gauge",
                "good hits / done requests expected to reuse a prefix",
                hits / expecting,
            )
        met, timed = stats.get("deadlines_met"), stats.get("with_deadline")
        if _is_number(met) and _is_number(timed) and timed:
            out.add(
                PREFIX + "engine_slo_attainment",
                "gauge",
                "SLO attainment: requests done by their deadline / ended requests with one",
                met / timed,
            )
        return out.render()


def parse_exposition(text: str) -> dict[str, float]:
    """Samples of a text exposition as ``{'name{labels}': value}`` (for the load generator
    and tests); comment lines are skipped."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        samples[key] = float(value)
    return samples


def sample(samples: Mapping[str, float], name: str, **labels: str) -> float | None:
    key = name + _labels(labels)
    return samples.get(key)


def families(text: str) -> Iterable[tuple[str, str]]:
    """(name, type) of every ``# TYPE`` line."""
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            yield name, kind
