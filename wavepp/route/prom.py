"""The router's ``/metrics``: Prometheus text, every name ``wavepp_route_*``.

Counters by replica (labels stay few: one value per replica, per policy, per reason):
requests routed, prompt and cached tokens of their answers, the cached tokens the router
predicted for them (and how many answers had exactly the predicted reuse), retries by
reason, answers by HTTP code; gauges: replicas up, each replica's state, requests in
flight, the blocks its index holds.
"""

from __future__ import annotations

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
