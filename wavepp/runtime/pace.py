"""The pipeline's measured pace on rank 0: how long work admitted now would take.

Stage 0's LOOP feeds it (each wave's send-to-back passage, each measured wave's
slowest-stage time); the admitter asks it whether waiting for a producer beats
recomputing (``wavepp.runtime.admitter``).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence

from wavepp.runtime.planning import WavePlanner


class Pace:
    def __init__(self, planner: WavePlanner, num_stages: int) -> None:
        self.planner = planner
        self.num_stages = num_stages
        self.passage_s: deque[float] = deque(maxlen=16)  # recent send -> back, seconds
        self.waves: deque[tuple[int, float]] = deque(maxlen=32)  # recent measured waves:
        #                                     (tokens, seconds of the slowest stage)

    def passed(self, seconds: float) -> None:
        """A wave with chunks came back from the last stage ``seconds`` after it left."""
        self.passage_s.append(seconds)

    def measured(self, num_tokens: int, seconds: float) -> None:
        """The slowest stage's whole time on a measured wave of ``num_tokens``."""
        self.waves.append((num_tokens, seconds))

    def work_ahead(self) -> list[tuple[int, int]]:
        """(tokens, prefix) of the admitted work not yet planned, in planning order."""
        return [(p.remaining, p.next_token) for p in self.planner.queue]

    def recompute_s(self, tokens: int, prefix: int, ahead: Sequence[tuple[int, int]]) -> float:
        """Seconds until a request admitted now would have computed ``tokens`` after
        ``prefix`` itself: the planner is first come first served, so the work
        ``ahead`` of it ((tokens, prefix) pairs: admitted and not yet planned, then the
        offers before it in its round) goes first, then its own tokens; its last chunk
        then takes a wave's passage through the pipeline. Work is timed at the
        pipeline's measured pace (tokens per second of the slowest stage over recent
        waves), else by the fitted cost model; the passage is the median measured
        send-to-back time of recent waves, else the predicted chunk time on every stage.
        A request waits for a producer at most this long."""
        total = self._time_of([*ahead, (tokens, prefix)])
        if self.passage_s:
            return total + statistics.median(self.passage_s)
        model = self.planner.cost_fit.model()
        last = model.wave([(min(tokens, self.planner.ctx.budget), prefix)])
        return total + (self.num_stages - 1) * last

    def _time_of(self, work: Sequence[tuple[int, int]]) -> float:
        """Seconds the slowest stage takes for (tokens, prefix) work run back to back."""
        num_tokens = sum(t for t, _ in work)
        if num_tokens == 0:
            return 0.0
        measured = sum(t for t, _ in self.waves), sum(s for _, s in self.waves)
        if measured[0] and measured[1]:
            return num_tokens * measured[1] / measured[0]
        model = self.planner.cost_fit.model()
        waves = math.ceil(num_tokens / self.planner.ctx.budget)
        compute = sum(model.chunk(t, p) for t, p in work)
        return waves * model.d + max(compute, waves * model.floor)
