"""Wave planners (DESIGN §5): pure functions from the admitted work to the next wave.

A planner sees the admitted requests in FCFS order, each with the next token to compute,
and returns the next wave (or None when nothing is left). Every token of every admitted
request is planned exactly once and in order: a request's chunks are consecutive and a
later chunk never comes before an earlier one.

Researchers plug their own planner in by dotted path (``--planner pkg.mod:fn``) or as
the ``planner`` field of a policy; it must have the signature of :data:`Planner`. Every
planner, the cost-aware one included, gets the runtime's online measurements in its
:class:`PlanContext` (the fitted cost model, recent wave times).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import attrs

from wavepp.plan.wave import Chunk, Wave
from wavepp.state.ids import RequestId

if TYPE_CHECKING:
    from wavepp.plan.cost import CostModel


@attrs.frozen
class Pending:
    """An admitted request as the planner sees it."""

    request_id: RequestId
    next_token: int  # first token not yet planned (starts at the reuse point, in tokens)
    num_tokens: int  # whole prompt length
    start: int | None = None  # where its planned work began (the reuse point it was
    #   admitted at); None: next_token — a request not yet planned, or one that did not say

    @property
    def remaining(self) -> int:
        return self.num_tokens - self.next_token

    @property
    def first_token(self) -> int:
        """The first token of this request's work: :attr:`start`, else :attr:`next_token`."""
        return self.next_token if self.start is None else self.start

    def planned_to(self, end: int) -> Pending:
        """This request with its tokens up to ``end`` planned (its start kept)."""
        return Pending(self.request_id, end, self.num_tokens, self.first_token)


@attrs.frozen
class PlanContext:
    """What the planner may know besides the queue."""

    budget: int  # M: max tokens in one wave
    ring: int  # R: waves the pipeline holds in flight (2P by default)
    min_budget: int  # smallest budget MPU may halve to
    cost_model: CostModel | None = None  # stage time fitted online from measured waves
    #   (the executor's prior before any measurement); None where the runtime has none
    wave_seconds: tuple[float, ...] = ()  # stage 0's most recent measured wave times, s,
    #   oldest first (a bounded window)
    stages: int = 0  # P, the pipeline's stages (0: not given)
    in_flight: int = 0  # waves planned earlier and not yet back from the last stage
    waiting: tuple[Pending, ...] = ()  # queued requests about to be admitted (offered
    #   to the next round or the one under way), from their reuse point on rank 0 —
    #   work that will feed the ring soon but cannot be planned yet
    waiting_after_s: float = 0.0  # when they are expected in the queue: a round's
    #   recent wall time (0: at once)
    running: int = 0  # requests not in the queue (nothing left to plan) whose waves are
    #   still in the pipeline: in a closed loop each brings a new request when it ends


Planner = Callable[[Sequence[Pending], int, PlanContext], Wave | None]
"""``planner(queue, wave_id, ctx) -> Wave | None``."""


def fill(queue: Sequence[Pending], wave_id: int, budget: int) -> Wave | None:
    """Greedy FCFS fill of one wave up to ``budget`` tokens."""
    chunks: list[Chunk] = []
    room = budget
    for item in queue:
        if room == 0:
            break
        if item.remaining <= 0:
            continue
        size = min(item.remaining, room)
        chunks.append(
            Chunk(item.request_id, item.next_token, item.next_token + size, item.num_tokens)
        )
        room -= size
    if not chunks:
        return None
    return Wave(wave_id, budget, tuple(chunks))


def static(queue: Sequence[Pending], wave_id: int, ctx: PlanContext) -> Wave | None:
    """Fill every wave to the full budget M, first come first served."""
    return fill(queue, wave_id, ctx.budget)


def estimated_waves(queue: Sequence[Pending], budget: int) -> float:
    """MPU's n(b) = max(W / b, N(b)): W remaining tokens, N(b) requests with > b/2 left."""
    work = sum(max(0, p.remaining) for p in queue)
    big = sum(1 for p in queue if p.remaining > budget / 2)
    return max(work / budget, big)


def mpu_budget(queue: Sequence[Pending], ctx: PlanContext) -> int:
    """The largest b in {M, M/2, M/4, ..., b_min} whose n(b) feeds the ring (≥ R).

    If even b_min cannot feed the ring, b_min: the most waves the work can make. One
    stage (``ctx.stages == 1``) has no pipeline to fill: always M, since smaller waves
    would only pay more per token (each chunk re-reads its prefix, each wave its weights).
    """
    budget = ctx.budget
    if ctx.stages == 1:
        return budget
    while budget > ctx.min_budget:
        if estimated_waves(queue, budget) >= ctx.ring:
            return budget
        budget = max(ctx.min_budget, budget // 2)
    return budget


def mpu(queue: Sequence[Pending], wave_id: int, ctx: PlanContext) -> Wave | None:
    """Maximum Pipeline Utilization (the paper's planner): halve the budget to feed the ring."""
    return fill(queue, wave_id, mpu_budget(queue, ctx))


PLANNERS: dict[str, Planner] = {"static": static, "mpu": mpu}
