"""The cost-aware planner (R5, beyond the paper; DESIGN §5).

MPU sizes waves by token count, but a chunk's time grows with its attention prefix::

    time(wave) ≈ d + max(floor, Σ_chunks a·t + c·t·(p + t/2))   (t tokens after a prefix p)

``floor`` is the roofline's flat part: a wave streams the stage's weights however few
tokens it holds (MoE experts make it large).

This planner chooses the wave budget b among MPU's halvings by predicted throughput —
busy stages times tokens per predicted second at the admitted work's mean cost per
token, so a large per-wave cost (memory-bound MoE weights, launches, the runtime's own
per-wave overhead as fitted) is weighed against an under-fed ring; with the ring fed it
plans full waves, as static does. At the full budget M it fills exactly as static
does: attention work does not depend on how a request is chunked, so once every stage
is busy fewer waves are never slower, and waves of equal time buy nothing. Below M —
waves halved to feed the ring —
it turns b into a *time* budget, the predicted time of b tokens at the head chunk's
prefix, and fills the wave first come first served until the predicted time reaches it
(never more than M tokens): chunks deep into long prompts get fewer tokens,
short-prefix chunks more, so the waves that keep the stages in step take equal time.
Where a token's cost depends on neither its prefix nor its wave (c = d = floor = 0) it
plans exactly what MPU plans.

One request with the pipeline to itself (a prompt at c = 1, the last of a run) is
planned for its completion time instead (:func:`lone_chunk`): equal-time chunks, as
many as the per-wave cost against the drain says, so low load has no latency floor.

The coefficients are fitted online from measured stage times (:func:`observe`), by
ridge regression toward the executor's prior (``prior_cost``: FLOPs at a nominal rate,
never a simulator's own cost function); waves at the floor measure d alone.

Tuning cells. The rules of :func:`choose_budget` that were chosen by measuring — counting
waves in flight and waiting work, the waiting work only where the admitted work lasts
until it comes — were chosen on the three cells of the ``smoke`` preset
(``benchmarks.matrix``; Qwen3-Next-80B on H200, P = 4, SIMULATED): ``cold-8k``
c = 16, ``seeded-8k`` c = 16, ``short-suffix-8k`` c = 32.
Judge R5 elsewhere: the ``paper-cells`` preset and the conversation workload were not
used to choose them (docs/benchmarks.md).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

import attrs
import numpy as np

from wavepp.plan.planners import Pending, PlanContext, fill, mpu_budget
from wavepp.plan.wave import Chunk, Wave

PRIOR_WEIGHT = 4.0  # the prior's strength in the online fit, in observed waves


@attrs.frozen
class CostModel:
    """Predicted seconds of one stage's wave: ``d + max(floor, Σ a·t + c·t·(p + t/2))``."""

    a: float  # seconds per token, prefix-free part (GEMMs)
    c: float  # seconds per token per token of attention prefix
    d: float  # seconds per wave (launch, transport)
    floor: float = 0.0  # least compute-or-memory time of any wave (weights read once)

    def chunk(self, tokens: int, prefix: int) -> float:
        return self.a * tokens + self.c * tokens * (prefix + tokens / 2)

    def wave(self, chunks: Sequence[tuple[int, int]]) -> float:
        """chunks: (tokens, prefix) pairs."""
        return self.d + max(self.floor, sum(self.chunk(t, p) for t, p in chunks))

    def largest_chunk(self, prefix: int, seconds: float) -> int:
        """Most tokens t with chunk(t, prefix) ≤ seconds."""
        if seconds <= 0:
            return 0
        if self.c <= 0:
            return int(seconds / self.a) if self.a > 0 else 2**62
        # c/2 t² + (a + c p) t - seconds = 0, then fix the float rounding by a token
        half, lin = self.c / 2, self.a + self.c * prefix
        t = max(0, int((-lin + math.sqrt(lin * lin + 4 * half * seconds)) / (2 * half)))
        limit = seconds * (1 + 1e-12)
        while self.chunk(t + 1, prefix) <= limit:
            t += 1
        while t > 0 and self.chunk(t, prefix) > limit:
            t -= 1
        return t


@attrs.frozen
class CostFit:
    """Online least squares for (a, c, d), regularized toward a prior (a value)."""

    prior: CostModel
    weight: float  # strength of the prior, in observations
    xtx: tuple[tuple[float, ...], ...] = ((0.0,) * 3,) * 3
    xty: tuple[float, ...] = (0.0, 0.0, 0.0)
    count: int = 0

    def model(self) -> CostModel:
        if self.count == 0:
            return self.prior
        p = np.array([self.prior.a, self.prior.c, self.prior.d])
        scale = np.maximum(np.abs(p), 1e-12)  # fit relative to the prior's magnitudes
        xtx = np.array(self.xtx) * np.outer(scale, scale)
        xty = np.array(self.xty) * scale
        reg = self.weight * np.diag(np.diag(xtx) / max(self.count, 1) + 1e-12)
        theta = np.linalg.solve(xtx + reg, xty + reg @ np.ones(3)) * scale
        a, c, d = (max(float(v), 0.0) for v in theta)
        return CostModel(a if a > 0 else self.prior.a, c, d, self.prior.floor)


def observe(fit: CostFit, chunks: Sequence[tuple[int, int]], seconds: float) -> CostFit:
    """Add one measured wave: its (tokens, prefix) chunks and its stage time.

    A wave the prior puts at the floor says nothing about a and c, only about the
    per-wave cost: it counts as a measurement of d alone (``seconds - floor``)."""
    prior = fit.prior
    tokens = sum(t for t, _ in chunks)
    attention = sum(t * (p + t / 2) for t, p in chunks)
    if prior.a * tokens + prior.c * attention <= prior.floor:
        x = np.array([0.0, 0.0, 1.0])
        seconds = max(seconds - prior.floor, 0.0)
    else:
        x = np.array([tokens, attention, 1.0], dtype=float)
    xtx = np.array(fit.xtx) + np.outer(x, x)
    xty = np.array(fit.xty) + x * seconds
    return attrs.evolve(
        fit,
        xtx=tuple(tuple(row) for row in xtx.tolist()),
        xty=tuple(xty.tolist()),
        count=fit.count + 1,
    )


def candidate_budgets(ctx: PlanContext) -> list[int]:
    """M, M/2, M/4, ... down to b_min: the budgets MPU chooses among."""
    out, budget = [], ctx.budget
    while budget > ctx.min_budget:
        out.append(budget)
        budget = max(ctx.min_budget, budget // 2)
    out.append(budget)
    return out


def mean_token_seconds(queue: Sequence[Pending], model: CostModel) -> float:
    """Predicted seconds per token of the admitted work, however it is chunked.

    A request's attention work, ``c·r·(p + r/2)`` for its r remaining tokens after p,
    is the same whether it runs as one chunk or many (the chunks' prefixes grow), so
    only this mean — not the head chunk's prefix — is fair to every budget."""
    work = sum(max(0, p.remaining) for p in queue)
    if work == 0:
        return model.a
    return sum(model.chunk(p.remaining, p.next_token) for p in queue if p.remaining > 0) / work


def choose_budget(queue: Sequence[Pending], ctx: PlanContext, model: CostModel) -> int:
    """The budget with the best predicted steady throughput.

    With n(b) waves of work (MPU's estimate) and ``ctx.in_flight`` waves already in the
    pipeline, ``min(1, (n(b) + in_flight)/P)`` of the P stages stay busy, each wave
    taking ``t(b) = d + max(floor, b·s)`` with s the mean seconds per token of the
    admitted work: throughput(b) = ``min(1, (n(b) + in_flight)/P) * b / t(b)``. Waves
    in flight keep the stages after this one busy, and so do requests about to be
    admitted (``ctx.waiting``: in the round under way or the next) where the admitted
    work lasts until they come (``ctx.waiting_after_s``, a round's recent time):
    counting them, the planner halves only where the pipeline would really run dry, not
    whenever the admitted queue is short (smoke cells, medians of 3: counting neither,
    it planned 38 waves a stage where static planned 32, and lost 4% to it; counting
    waves in flight, 34 and 1.2% — the two extra waves came from halving a run's first
    request, admitted a round before the rest). Counting waiting work that comes only
    after the admitted work is done looked costly on ``seeded-8k``, where a round
    outlasts a wave of short suffixes (one smoke run: R5 988K tok/s against 1.12M in
    the two runs before). The
    per-wave cost (d, the weight-streaming floor) favours fewer, larger waves; an idle
    stage favours more, smaller ones; where the ring is fed by every budget, M wins and
    this plans what static plans. Ties go to MPU's own choice, so where waves cost
    nothing beyond their tokens (d = floor = 0) this is exactly MPU.
    """
    stages = max(ctx.ring / 2, 1.0)
    per_token = mean_token_seconds(queue, model)
    left = sorted(p.remaining for p in queue if p.remaining > 0)
    soon = sorted(p.remaining for p in ctx.waiting if p.remaining > 0)
    work = sum(left)

    def waves(remaining: list[int], total: int, b: int) -> float:  # MPU's n(b), sorted
        return max(total / b, len(remaining) - bisect.bisect_right(remaining, b / 2))

    def rate(b: int) -> float:  # tokens per second of one busy stage
        tokens = min(b, work)  # a wave holds no more than the work left
        return tokens / max(model.d + max(model.floor, tokens * per_token), 1e-30)

    def fed(b: int) -> float:  # waves that keep the stages busy at budget b
        admitted = waves(left, work, b)
        # the waiting work feeds them only if the admitted work lasts until it comes
        lasts = admitted * (model.d + max(model.floor, min(b, work) * per_token))
        later = waves(soon, sum(soon), b) if lasts >= ctx.waiting_after_s else 0.0
        return admitted + later + ctx.in_flight

    scores = {b: min(1.0, fed(b) / stages) * rate(b) for b in candidate_budgets(ctx)}
    best = max(scores.values())
    tied = [b for b, v in scores.items() if v >= best * (1 - 1e-9)]
    if len(tied) == 1:
        return tied[0]
    mpu_choice = mpu_budget(queue, ctx)
    return mpu_choice if mpu_choice in tied else max(tied)


def lone_chunk(queue: Sequence[Pending], ctx: PlanContext, model: CostModel) -> int | None:
    """Tokens of the next chunk of a request that has the pipeline to itself, sized for
    its completion time; None where this rule does not apply.

    With nothing else admitted, waiting or in the pipeline, the request's waves are all
    the pipeline will run until it ends: its last chunk is the drain. Waves taking
    ``w_i`` on every stage finish after ``Σ w_i + (P-1)·max w_i`` (a flow shop: the
    critical path crosses the longest wave on every stage). Σ w_i is the request's own
    work W plus d a wave, however it is chunked (attention work does not depend on the
    chunking), so the best chunks take equal time u and ``W·d/u + (P-1)·u`` is least
    at ``u = sqrt(W·d/(P-1))`` — or at the floor where that is below it (a wave costs
    the floor however little it computes). W is the request's work from where it was
    admitted, so every chunk gets the same u: equal-*time* chunks, which shrink as the
    prefix grows. Equal-*token* chunks (static, MPU) end on the dearest chunks, and
    their drain is long on long prompts.

    Applies to one live request with nothing waiting and no other request in flight, at
    P ≥ 2 and with a per-wave cost (d > 0; without one, ever smaller chunks would look
    free — there the throughput rule plans, as MPU would)."""
    stages = ctx.stages or max(ctx.ring // 2, 1)
    alone = len(queue) == 1 and not ctx.waiting and not ctx.running
    if not alone or stages < 2 or model.d <= 0:
        return None
    head = queue[0]
    first = head.first_token
    work = model.chunk(head.num_tokens - first, first)
    target = max(model.floor, math.sqrt(work * model.d / (stages - 1)))
    size = model.largest_chunk(head.next_token, target)
    if model.chunk(size, head.next_token) < model.floor:
        size += 1  # a wave under the floor pays for compute it does not do
    return max(min(head.remaining, ctx.min_budget), min(size, head.remaining, ctx.budget))


def cost_plan(
    queue: Sequence[Pending], wave_id: int, ctx: PlanContext, model: CostModel
) -> Wave | None:
    """Pick the budget by predicted throughput; at M, fill as static does; below it,
    fill the wave up to the time that budget takes at the head chunk's prefix (never
    more than M tokens)."""
    live = [p for p in queue if p.remaining > 0]
    if not live:
        return None
    alone = lone_chunk(live, ctx, model)
    if alone is not None:
        head = live[0]
        chunk = Chunk(head.request_id, head.next_token, head.next_token + alone, head.num_tokens)
        return Wave(wave_id, alone, (chunk,))
    budget = choose_budget(live, ctx, model)
    if budget == ctx.budget:
        return fill(live, wave_id, budget)
    target = max(model.floor, model.chunk(budget, live[0].next_token))
    chunks: list[Chunk] = []
    spent, used = 0.0, 0
    for item in live:
        if used == ctx.budget:
            break
        if model.c <= 0:  # prefix-free cost: time is proportional to tokens
            fits = budget - used
        else:
            fits = model.largest_chunk(item.next_token, target - spent)
        size = min(item.remaining, ctx.budget - used, fits)
        if size <= 0:
            if chunks:
                break
            size = min(item.remaining, budget)  # a wave is never empty
        chunks.append(
            Chunk(item.request_id, item.next_token, item.next_token + size, item.num_tokens)
        )
        spent += model.chunk(size, item.next_token)
        used += size
    return Wave(wave_id, max(budget, used), tuple(chunks))


class NoCostModel(ValueError):
    """The cost planner ran without a cost model in its context."""


def cost(queue: Sequence[Pending], wave_id: int, ctx: PlanContext) -> Wave | None:
    """The cost-aware planner as an ordinary :data:`~wavepp.plan.Planner`: plans with the
    runtime's online fit, ``ctx.cost_model``."""
    if ctx.cost_model is None:
        raise NoCostModel(
            "the cost planner needs PlanContext.cost_model (the runtime's online fit of "
            "stage time); this runtime passed none"
        )
    return cost_plan(queue, wave_id, ctx, ctx.cost_model)
