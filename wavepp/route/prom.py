"""The router's ``/metrics`` through ``prometheus_client``, every name ``wavepp_route_*``.

Counters by replica (labels stay few: one value per replica, per policy, per reason):
requests routed, prompt and cached tokens of their answers, the cached tokens the router
predicted for them (and how many answers had exactly the predicted reuse), answers to
requests with a deadline and those that met it (the replica's ``deadline_met``), retries
by reason, answers by HTTP code, deadlines that passed at the router; gauges: replicas
up, each replica's state, requests in flight, the blocks its index holds, SLO attainment.
With decoders (``--decoder``): each leg's answers by HTTP code, prefills whose cache the
replica held for the decoder (or not), and each decoder's state and requests in flight.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from wavepp.route.body import Answer
from wavepp.route.replicas import STATES, Replica

# No ``_created`` timestamp series beside each counter and histogram (a process-wide
# switch of prometheus_client): the exposition keeps one series per figure.
disable_created_metrics()

PREFIX = "wavepp_route_"


class ReplicaCollector:
    """At each scrape, the replicas' states, loads and indexes as gauges."""

    def __init__(self, replicas: Sequence[Replica]) -> None:
        self.replicas = replicas

    def collect(self) -> Iterator[Metric]:
        replicas = self.replicas
        yield GaugeMetricFamily(PREFIX + "replicas_up", "replicas taking requests",
                                value=sum(1 for r in replicas if r.state == "up"))  # fmt: skip
        yield GaugeMetricFamily(PREFIX + "replicas", "replicas the router was given",
                                value=len(replicas))  # fmt: skip
        state = GaugeMetricFamily(PREFIX + "replica_state", "1 for each replica's state",
                                  labels=["replica", "state"])  # fmt: skip
        in_flight = GaugeMetricFamily(PREFIX + "in_flight", "requests sent and not answered",
                                      labels=["replica"])  # fmt: skip
        blocks = GaugeMetricFamily(PREFIX + "index_blocks", "blocks the replica's events "
                                   "announced", labels=["replica"])  # fmt: skip
        for r in replicas:
            for name in STATES:
                state.add_metric([r.name, name], int(r.state == name))
            in_flight.add_metric([r.name], len(r.flights))
            if r.index is not None:
                blocks.add_metric([r.name], r.index.num_blocks)
        yield from (state, in_flight, blocks)


class DecoderCollector:
    """At each scrape, the decoders' states and requests in flight."""

    def __init__(self, decoders: Sequence) -> None:
        self.decoders = decoders

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(PREFIX + "decoders_up", "decoders taking requests",
                                value=sum(1 for d in self.decoders if d.state == "up"))
        in_flight = GaugeMetricFamily(PREFIX + "decoder_in_flight", "decode legs sent and "
                                      "not answered", labels=["decoder"])  # fmt: skip
        up = GaugeMetricFamily(PREFIX + "decoder_up", "1 while the decoder's /health answers",
                               labels=["decoder"])  # fmt: skip
        for d in self.decoders:
            in_flight.add_metric([d.name], d.in_flight)
            up.add_metric([d.name], int(d.state == "up"))
        yield from (in_flight, up)


class Attainment:
    """The fleet's deadlines so far: answers that said whether theirs was met, the ones
    met, and requests whose deadline passed at the router (missed, answered 504)."""

    def __init__(self) -> None:
        self.answered = 0
        self.met = 0
        self.expired = 0

    def answer(self, met: bool) -> None:
        self.answered += 1
        self.met += int(met)

    def expire(self) -> None:
        self.expired += 1

    @property
    def share(self) -> float | None:
        """Met / requests with a deadline (None before the first)."""
        timed = self.answered + self.expired
        return self.met / timed if timed else None

    def snapshot(self) -> dict:
        return {"answered": self.answered, "met": self.met, "expired": self.expired,
                "slo_attainment": self.share}  # fmt: skip

    def collect(self) -> Iterator[Metric]:
        if self.share is not None:
            yield GaugeMetricFamily(PREFIX + "slo_attainment", "SLO attainment: answers that "
                                    "met their deadline / answers with one plus deadlines that "
                                    "passed at the router", value=self.share)  # fmt: skip


class RouteMetrics:
    """The router's counters and gauges, in a registry of its own."""

    def __init__(self, policy: str, replicas: Sequence[Replica]) -> None:
        self.policy = policy
        self.registry = registry = CollectorRegistry()

        def by_replica(name: str, help_text: str) -> Counter:
            counter = Counter(PREFIX + name, help_text, ["replica", "policy"], registry=registry)
            for r in replicas:  # every replica shows, at 0 until it counts
                counter.labels(r.name, policy)
            return counter

        self.requests = by_replica("requests", "requests sent to a replica (retries included)")
        self.prompt_tokens = by_replica("prompt_tokens", "prompt tokens of done answers")
        self.cached_tokens = by_replica("cached_tokens", "cached tokens of done answers")
        self.predicted_tokens = by_replica("predicted_cached_tokens",
                                           "cached tokens predicted for done answers")
        self.predicted_answers = by_replica("predicted_answers",
                                            "done answers the router predicted")
        self.predicted_exact = by_replica("predicted_exact",
                                          "done answers whose cached tokens were as predicted")
        self.with_deadline = by_replica("with_deadline", "answers to requests with a deadline "
                                        "(that said whether it was met)")
        self.deadlines_met = by_replica("deadlines_met", "answers that met their deadline")
        self.answers = Counter(PREFIX + "answers", "replica answers passed on, by HTTP code",
                               ["replica", "code"], registry=registry)  # fmt: skip
        self.retries = Counter(PREFIX + "retries", "requests sent again to another replica",
                               ["reason"], registry=registry)  # fmt: skip
        self.refused = Counter(PREFIX + "refused", "requests the router answered itself",
                               ["code"], registry=registry)  # fmt: skip
        self.deadlines_expired = Counter(PREFIX + "deadlines_expired", "requests whose "
                                         "deadline passed before a replica could take them "
                                         "(the router's 504)", registry=registry)  # fmt: skip
        self.attainment = Attainment()
        registry.register(ReplicaCollector(replicas))
        registry.register(self.attainment)
        self.legs = Counter(PREFIX + "pd_legs", "prefill and decode legs of requests sent to a "
                            "decoder (--decoder), by leg and HTTP code", ["leg", "code"],
                            registry=registry)  # fmt: skip
        self.held = Counter(PREFIX + "pd_prefills", "prefills answered for a decoder, by "
                            "whether the replica held the cache for it (held) or not (none: "
                            "the decoder computed the prompt)", ["cache"],
                            registry=registry)  # fmt: skip
        self.decoder_answers = Counter(PREFIX + "decoder_answers", "decoders' answers, by "
                                       "decoder and HTTP code", ["decoder", "code"],
                                       registry=registry)  # fmt: skip

    def watch_decoders(self, decoders: Sequence) -> None:
        """Show the decoders' states and loads at each scrape."""
        self.registry.register(DecoderCollector(decoders))

    def pd_leg(self, leg: str, code: int, *, held: bool | None = None,
               decoder: str | None = None) -> None:  # fmt: skip
        """A leg of a P/D request answered ``code`` (``held``: the prefill's cache is held
        for the decoder; ``decoder``: which decoder answered)."""
        self.legs.labels(leg, str(code)).inc()
        if held is not None:
            self.held.labels("held" if held else "none").inc()
        if decoder is not None:
            self.decoder_answers.labels(decoder, str(code)).inc()

    def sent(self, replica: str) -> None:
        self.requests.labels(replica, self.policy).inc()

    def retried(self, reason: str) -> None:
        self.retries.labels(reason).inc()

    def refused_with(self, code: int) -> None:
        self.refused.labels(str(code)).inc()

    def expired(self) -> None:
        self.deadlines_expired.inc()
        self.attainment.expire()

    def passed_on(self, replica: str, code: int) -> None:
        self.answers.labels(replica, str(code)).inc()

    def answered(self, replica: str, code: int, answer: Answer, predicted: int) -> None:
        self.passed_on(replica, code)
        labels = (replica, self.policy)
        if answer.deadline_met is not None:
            self.with_deadline.labels(*labels).inc()
            self.deadlines_met.labels(*labels).inc(int(answer.deadline_met))
            self.attainment.answer(answer.deadline_met)
        num_tokens, cached = answer.num_tokens, answer.cached_tokens
        if answer.status == "done" and num_tokens is not None and cached is not None:
            self.prompt_tokens.labels(*labels).inc(num_tokens)
            self.cached_tokens.labels(*labels).inc(cached)
            self.predicted_tokens.labels(*labels).inc(predicted)
            self.predicted_answers.labels(*labels).inc()
            self.predicted_exact.labels(*labels).inc(int(cached == predicted))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def _by_replica(samples: dict[str, float], name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in samples.items():
        if key.split("{", 1)[0] == name:
            match = _REPLICA.search(key)
            replica = match.group(1) if match else ""
            out[replica] = out.get(replica, 0.0) + value
    return out


_REPLICA = re.compile(r'replica="([^"]*)"')


def fleet_figures(before: dict[str, float], after: dict[str, float]) -> dict | None:
    """What a router's ``/metrics`` says of the requests between two scrapes (parsed by
    ``wavepp.serve.prom.parse_exposition``): per replica and in all, requests sent, prompt
    and cached tokens of done answers, the cached tokens predicted for them, answers with
    a deadline and those that met it; retries, deadlines that passed at the router, and
    the SLO attainment of the requests with a deadline (None without any). None when the
    scrapes are not a router's (``wavepp.bench.load`` against one server)."""
    if not any(k.startswith(PREFIX) for k in after):
        return None
    fields = {"requests": "requests_total", "prompt_tokens": "prompt_tokens_total",
              "cached_tokens": "cached_tokens_total",
              "predicted_cached_tokens": "predicted_cached_tokens_total",
              "predicted_exact": "predicted_exact_total",
              "predicted_answers": "predicted_answers_total",
              "with_deadline": "with_deadline_total",
              "deadlines_met": "deadlines_met_total"}  # fmt: skip
    replicas: dict[str, dict[str, float]] = {}
    for field, name in fields.items():
        then = _by_replica(before, PREFIX + name)
        for replica, value in _by_replica(after, PREFIX + name).items():
            replicas.setdefault(replica, {})[field] = value - then.get(replica, 0.0)
    total = {f: sum(r.get(f, 0.0) for r in replicas.values()) for f in fields}
    def counted(name: str) -> float:
        return sum(_by_replica(after, PREFIX + name).values()) - sum(
            _by_replica(before, PREFIX + name).values())

    retries, expired = counted("retries_total"), counted("deadlines_expired_total")
    prompt, timed = total["prompt_tokens"], total["with_deadline"] + expired
    return {
        "replicas": replicas,
        "replicas_up": after.get(PREFIX + "replicas_up"),
        "retries": retries,
        "deadlines_expired": expired,
        **total,
        "reused_share": total["cached_tokens"] / prompt if prompt else None,
        "predicted_share": total["predicted_cached_tokens"] / prompt if prompt else None,
        "slo_attainment": total["deadlines_met"] / timed if timed else None,
    }
