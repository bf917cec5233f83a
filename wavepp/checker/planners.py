"""The planner's contract as a Hypothesis property, for any planner (DESIGN §5).

A planner is run to exhaustion over random queues (reuse points, arrivals between
waves) and random contexts that carry the online measurements a runtime passes (a
fitted cost model, recent wave times). Every token of every admitted request must be
planned exactly once, in order, within the budget.
"""

from __future__ import annotations

from collections.abc import Sequence

import hypothesis.strategies as st
from hypothesis import Phase, given, settings

from wavepp.checker.invariants import check, violated
from wavepp.plan import CostModel, Pending, PlanContext, Planner, Wave

queues = st.lists(st.integers(1, 40_000), min_size=1, max_size=12)
cost_models = st.builds(
    CostModel,
    a=st.floats(1e-7, 1e-3),
    c=st.one_of(st.just(0.0), st.floats(1e-12, 1e-7)),
    d=st.floats(0, 1e-2),
)
contexts = st.builds(
    lambda m, ring, lo, model, seconds: PlanContext(
        budget=2**m, ring=ring, min_budget=2 ** min(lo, m), cost_model=model,
        wave_seconds=tuple(seconds),
    ),
    st.integers(6, 15),
    st.integers(1, 16),
    st.integers(4, 10),
    cost_models,
    st.lists(st.floats(1e-4, 1.0), max_size=4),
)  # fmt: skip


def drain(
    planner: Planner,
    sizes: Sequence[int],
    starts: Sequence[int],
    ctx: PlanContext,
    arrivals: int,
) -> tuple[list[Pending], list[Wave]]:
    """Run a planner to exhaustion, admitting more requests between waves, checking
    each wave as it comes (a planner must not loop on empty waves)."""
    queue = [Pending(f"r{i}", s, n) for i, (n, s) in enumerate(zip(sizes, starts, strict=True))]
    live, waves = list(queue[: arrivals or len(queue)]), []
    later = list(queue[len(live) :])
    covered = {p.request_id: p.next_token for p in queue}
    while True:
        try:
            wave = planner(live, len(waves), ctx)
        except Exception as error:
            raise violated(
                "no_unexpected_error", f"planner raised {type(error).__name__}: {error}"
            ) from error
        if wave is None:
            if not later:
                return queue, waves
            live.append(later.pop(0))
            continue
        check(
            0 < wave.num_tokens <= wave.budget <= ctx.budget,
            "plan_within_budget",
            f"{wave} holds {wave.num_tokens} tokens at budget {wave.budget}; M = {ctx.budget}",
        )
        waves.append(wave)
        by_id = {p.request_id: i for i, p in enumerate(live)}
        for chunk in wave.chunks:
            i = by_id.get(chunk.request_id)
            check(
                i is not None and chunk.start == covered[chunk.request_id] and chunk.size >= 1
                and chunk.end <= chunk.num_tokens,
                "plan_in_order",
                f"{chunk} in {wave}; the request's next token is "
                f"{covered.get(chunk.request_id)}",
            )  # fmt: skip
            covered[chunk.request_id] = chunk.end
            live[i] = live[i].planned_to(chunk.end)  # type: ignore[index]
        live = [p for p in live if p.remaining > 0]
        if later:
            live.append(later.pop(0))


def planner_property(planner: Planner, max_examples: int, derandomize: bool = False):
    """A Hypothesis test function that checks ``planner``; call it to run."""

    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=derandomize,
        phases=(Phase.explicit, Phase.generate, Phase.shrink),
    )
    @given(sizes=queues, data=st.data(), ctx=contexts, arrivals=st.integers(0, 4))
    def planner_plans_every_token_once_in_order(sizes, data, ctx, arrivals):
        starts = [data.draw(st.integers(0, n - 1)) for n in sizes]  # reuse points, in tokens
        queue, waves = drain(planner, sizes, starts, ctx, arrivals)
        covered = {p.request_id: p.next_token for p in queue}
        for wave in waves:
            for chunk in wave.chunks:
                covered[chunk.request_id] = chunk.end
        want = {p.request_id: p.num_tokens for p in queue}
        check(
            covered == want,
            "plan_covers_every_token",
            f"planned up to {covered}, the prompts end at {want}",
        )

    return planner_plans_every_token_once_in_order
