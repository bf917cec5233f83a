"""The router's ``/metrics``: Prometheus text, every name ``wavepp_route_*``.

Counters by replica (labels stay few: one value per replica, per policy, per reason):
requests routed, prompt and cached tokens of their answers, the cached tokens the router
predicted for them (and how many answers had exactly the predicted reuse), retries by
reason, answers by HTTP code; gauges: replicas up, each replica's state, requests in
flight, the blocks its index holds.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

from wavepp.route.replicas import STATES, Replica
from wavepp.serve.prom import Exposition

PREFIX = "wavepp_route_"


class RouteMetrics:
    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.requests: Counter[str] = Counter()  # replica -> requests sent there
        self.answers: Counter[tuple[str, int]] = Counter()  # (replica, HTTP code) -> answers
        self.predicted_tokens: Counter[str] = Counter()  # replica -> predicted cached tokens
        self.prompt_tokens: Counter[str] = Counter()  # replica -> prompt tokens of done answers
        self.cached_tokens: Counter[str] = Counter()  # replica -> cached tokens of done answers
        self.predicted_answers: Counter[str] = Counter()  # done answers with a prediction
        self.predicted_exact: Counter[str] = Counter()  # ... whose cached tokens equal it
        self.retries: Counter[str] = Counter()  # reason -> requests sent again elsewhere
        self.refused: Counter[int] = Counter()  # HTTP code -> answered by the router itself

    def answered(self, replica: str, code: int, status: str | None, num_tokens: int | None,
                 cached: int | None, predicted: int) -> None:  # fmt: skip
        self.answers[replica, code] += 1
        if status == "done" and num_tokens is not None and cached is not None:
            self.prompt_tokens[replica] += num_tokens
            self.cached_tokens[replica] += cached
            self.predicted_tokens[replica] += predicted
            self.predicted_answers[replica] += 1
            self.predicted_exact[replica] += int(cached == predicted)

    def render(self, replicas: Sequence[Replica]) -> str:
        out = Exposition()
        names = [r.name for r in replicas]
        up = sum(1 for r in replicas if r.state == "up")
        out.add(PREFIX + "replicas_up", "gauge", "replicas taking requests", up)
        out.add(PREFIX + "replicas", "gauge", "replicas the router was given", len(replicas))
        for r in replicas:
            for state in STATES:
                out.add(PREFIX + "replica_state", "gauge", "1 for each replica's state",
                        int(r.state == state), {"replica": r.name, "state": state})  # fmt: skip
            out.add(PREFIX + "in_flight", "gauge", "requests sent and not answered",
                    len(r.flights), {"replica": r.name})  # fmt: skip
            blocks = getattr(r.index, "num_blocks", None)
            if blocks is not None:
                out.add(PREFIX + "index_blocks", "gauge", "blocks the replica's events announced",
                        blocks, {"replica": r.name})  # fmt: skip
        counters = (
            ("requests", "requests sent to a replica (retries included)", self.requests),
            ("prompt_tokens", "prompt tokens of done answers", self.prompt_tokens),
            ("cached_tokens", "cached tokens of done answers", self.cached_tokens),
            ("predicted_cached_tokens", "cached tokens predicted for done answers",
             self.predicted_tokens),
            ("predicted_answers", "done answers the router predicted", self.predicted_answers),
            ("predicted_exact", "done answers whose cached tokens were as predicted",
             self.predicted_exact),
        )  # fmt: skip
        for name, help_text, counts in counters:
            for replica in names:
                labels = {"replica": replica, "policy": self.policy}
                out.add(PREFIX + name, "counter", help_text, counts[replica], labels, "_total")
        for (replica, code), n in sorted(self.answers.items()):
            out.add(PREFIX + "answers", "counter", "replica answers passed on, by HTTP code", n,
                    {"replica": replica, "code": str(code)}, "_total")  # fmt: skip
        for reason, n in sorted(self.retries.items()):
            out.add(PREFIX + "retries", "counter", "requests sent again to another replica", n,
                    {"reason": reason}, "_total")  # fmt: skip
        for code, n in sorted(self.refused.items()):
            out.add(PREFIX + "refused", "counter", "requests the router answered itself", n,
                    {"code": str(code)}, "_total")  # fmt: skip
        return out.render()


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
    and cached tokens of done answers, the cached tokens predicted for them; retries.
    None when the scrapes are not a router's (``wavepp.bench.load`` against one server)."""
    if not any(k.startswith(PREFIX) for k in after):
        return None
    fields = {"requests": "requests_total", "prompt_tokens": "prompt_tokens_total",
              "cached_tokens": "cached_tokens_total",
              "predicted_cached_tokens": "predicted_cached_tokens_total",
              "predicted_exact": "predicted_exact_total",
              "predicted_answers": "predicted_answers_total"}  # fmt: skip
    replicas: dict[str, dict[str, float]] = {}
    for field, name in fields.items():
        then = _by_replica(before, PREFIX + name)
        for replica, value in _by_replica(after, PREFIX + name).items():
            replicas.setdefault(replica, {})[field] = value - then.get(replica, 0.0)
    total = {f: sum(r.get(f, 0.0) for r in replicas.values()) for f in fields}
    retries = sum(_by_replica(after, PREFIX + "retries_total").values()) - sum(
        _by_replica(before, PREFIX + "retries_total").values())
    prompt = total["prompt_tokens"]
    return {
        "replicas": replicas,
        "replicas_up": after.get(PREFIX + "replicas_up"),
        "retries": retries,
        **total,
        "reused_share": total["cached_tokens"] / prompt if prompt else None,
        "predicted_share": total["predicted_cached_tokens"] / prompt if prompt else None,
    }
