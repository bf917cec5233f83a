"""Wave planning on rank 0: the admitted requests' unplanned tokens, and the planner.

The planner is the policy's: any function ``(queue, wave_id, ctx) -> Wave | None``
(DESIGN §5). Every planner sees the same online measurements in its context: the cost
model fitted from measured waves (the slowest stage's whole time on each, kept up to
date by :meth:`WavePlanner.observe`) and the latest wave times. Every plan is checked
before it leaves: a planner that breaks the budget or skips tokens is a bug, reported
as a :class:`ProtocolError`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import attrs

from wavepp.plan import CostFit, Pending, PlanContext, Planner, Wave, observe
from wavepp.runtime.records import ProtocolError
from wavepp.state import RequestId


class WavePlanner:
    def __init__(self, planner: Planner, ctx: PlanContext, cost_fit: CostFit) -> None:
        self.planner = planner
        self.ctx = ctx
        self.cost_fit = cost_fit  # the online fit of the pipeline's wave time
        self.recent: deque[float] = deque(maxlen=16)  # latest measured wave times, s
        self.queue: list[Pending] = []  # admitted requests with unplanned tokens, FCFS
        self.next_wave_id = 0

    def add(self, rid: RequestId, start_token: int, num_tokens: int) -> None:
        self.queue.append(Pending(rid, start_token, num_tokens))

    def drop(self, rid: RequestId) -> None:
        self.queue = [p for p in self.queue if p.request_id != rid]

    @property
    def num_unplanned_tokens(self) -> int:
        """Tokens of admitted requests that no wave has carried yet: each one's uncached
        tokens (it was admitted at its reuse point) less those already planned."""
        return sum(p.remaining for p in self.queue)

    def take_wave_id(self) -> int:
        self.next_wave_id += 1
        return self.next_wave_id - 1

    def next(
        self,
        in_flight: int = 0,
        waiting: Sequence[Pending] = (),
        waiting_after_s: float = 0.0,
        running: int = 0,
    ) -> Wave | None:
        """The next wave, ``in_flight`` waves being in the pipeline already (holding
        ``running`` requests besides the queue's), and the ``waiting`` requests about to
        be admitted, in about ``waiting_after_s``."""
        ctx = attrs.evolve(self.ctx, cost_model=self.cost_fit.model(),
                           wave_seconds=tuple(self.recent), in_flight=in_flight,
                           waiting=tuple(waiting), waiting_after_s=waiting_after_s,
                           running=running)  # fmt: skip
        wave = self.planner(self.queue, self.next_wave_id, ctx)
        if wave is None:
            return None
        if wave.num_tokens > wave.budget or wave.budget > self.ctx.budget:
            raise ProtocolError(f"planner broke the budget of {self.ctx.budget} tokens: {wave}")
        self.take_wave_id()
        by_id = {p.request_id: i for i, p in enumerate(self.queue)}
        for chunk in wave.chunks:
            i = by_id.get(chunk.request_id)
            if i is None or chunk.start != self.queue[i].next_token:
                where = "unknown request" if i is None else f"after {self.queue[i]}"
                raise ProtocolError(f"planner skipped tokens: {chunk} ({where})")
            self.queue[i] = self.queue[i].planned_to(chunk.end)
        self.queue = [p for p in self.queue if p.remaining > 0]
        return wave

    def observe(self, wave: Wave, seconds: float) -> None:
        """A measured time of ``wave`` (the cost fit and the planner's window learn it)."""
        if seconds:
            self.recent.append(seconds)
            shape = [(c.end - c.start, c.start) for c in wave.chunks]
            self.cost_fit = observe(self.cost_fit, shape, seconds)
