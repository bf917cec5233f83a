"""Planner properties: every admitted token planned once, in order, within the budget."""

import hypothesis.strategies as st
from hypothesis import given, settings

from wavepp.plan import PLANNERS, Pending, PlanContext, estimated_waves, mpu_budget

queues = st.lists(st.integers(1, 40_000), min_size=1, max_size=12)
contexts = st.builds(
    lambda m, ring, lo: PlanContext(budget=2**m, ring=ring, min_budget=2 ** min(lo, m)),
    st.integers(6, 15),
    st.integers(1, 16),
    st.integers(4, 10),
)


def drain(planner, sizes, starts, ctx, arrivals):
    """Run a planner to exhaustion, admitting more requests between waves."""
    queue = [Pending(f"r{i}", s, n) for i, (n, s) in enumerate(zip(sizes, starts, strict=True))]
    live, waves = queue[: arrivals or len(queue)], []
    later = queue[len(live) :]
    while True:
        wave = planner(live, len(waves), ctx)
        if wave is None:
            if not later:
                return queue, waves
            live.append(later.pop(0))
            continue
        waves.append(wave)
        for chunk in wave.chunks:
            i = next(k for k, p in enumerate(live) if p.request_id == chunk.request_id)
            live[i] = Pending(chunk.request_id, chunk.end, chunk.num_tokens)
        live = [p for p in live if p.remaining > 0]
        if later:
            live.append(later.pop(0))


@settings(max_examples=200, deadline=None)
@given(
    name=st.sampled_from(sorted(PLANNERS)),
    sizes=queues,
    data=st.data(),
    ctx=contexts,
    arrivals=st.integers(0, 4),
)
def test_every_token_planned_once_in_order_within_budget(name, sizes, data, ctx, arrivals):
    starts = [data.draw(st.integers(0, n - 1)) for n in sizes]  # the reuse point, in tokens
    queue, waves = drain(PLANNERS[name], sizes, starts, ctx, arrivals)
    covered = {p.request_id: p.next_token for p in queue}
    for wave in waves:
        assert 0 < wave.num_tokens <= wave.budget <= ctx.budget
        assert wave.budget >= min(ctx.min_budget, ctx.budget)
        for chunk in wave.chunks:
            assert chunk.start == covered[chunk.request_id], "chunks are consecutive, in order"
            assert chunk.size >= 1
            covered[chunk.request_id] = chunk.end
    assert covered == {p.request_id: p.num_tokens for p in queue}, "every token planned"


@settings(max_examples=200, deadline=None)
@given(sizes=queues, ctx=contexts)
def test_mpu_picks_the_largest_halving_that_feeds_the_ring(sizes, ctx):
    queue = [Pending(f"r{i}", 0, n) for i, n in enumerate(sizes)]
    b = mpu_budget(queue, ctx)
    candidates = []
    size = ctx.budget
    while size > ctx.min_budget:
        candidates.append(size)
        size //= 2
    candidates.append(max(size, ctx.min_budget))
    feeding = [c for c in candidates if estimated_waves(queue, c) >= ctx.ring]
    assert b == (max(feeding) if feeding else candidates[-1])
