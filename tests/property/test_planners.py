"""Planner properties: every admitted token planned once, in order, within the budget."""

import attrs
import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from wavepp.checker import planner_property
from wavepp.plan import PLANNERS, Pending, PlanContext, estimated_waves, fill, mpu_budget

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
            live[i] = live[i].planned_to(chunk.end)
        live = [p for p in live if p.remaining > 0]
        if later:
            live.append(later.pop(0))


@pytest.mark.parametrize("name", sorted(PLANNERS))
def test_every_token_planned_once_in_order_within_budget(name):
    """The planner contract of ``python -m wavepp.checker``, for every built-in planner."""
    planner_property(PLANNERS[name], max_examples=100)()


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


# -- the cost-aware planner (R5) -------------------------------------------------------

from wavepp.plan import CostFit, CostModel, cost_plan, mpu, observe, static  # noqa: E402

models = st.builds(
    CostModel,
    a=st.floats(1e-7, 1e-3),
    c=st.one_of(st.just(0.0), st.floats(1e-12, 1e-7)),
    d=st.floats(0, 1e-2),
)


@settings(max_examples=200, deadline=None)
@given(sizes=queues, data=st.data(), ctx=contexts, arrivals=st.integers(0, 4), model=models)
def test_cost_planner_plans_every_token_once_in_order(sizes, data, ctx, arrivals, model):
    starts = [data.draw(st.integers(0, n - 1)) for n in sizes]

    def planner(queue, wave_id, ctx):
        return cost_plan(queue, wave_id, ctx, model)

    queue, waves = drain(planner, sizes, starts, ctx, arrivals)
    covered = {p.request_id: p.next_token for p in queue}
    for wave in waves:
        assert 0 < wave.num_tokens <= ctx.budget, "never more than M tokens"
        for chunk in wave.chunks:
            assert chunk.start == covered[chunk.request_id]
            covered[chunk.request_id] = chunk.end
    assert covered == {p.request_id: p.num_tokens for p in queue}


@settings(max_examples=200, deadline=None)
@given(sizes=queues, data=st.data(), ctx=contexts, a=st.floats(1e-7, 1e-3))
def test_cost_planner_plans_what_mpu_plans_when_chunks_cost_alike(sizes, data, ctx, a):
    starts = [data.draw(st.integers(0, n - 1)) for n in sizes]
    model = CostModel(a=a, c=0.0, d=0.0)  # every token costs the same, wherever it is

    def planner(queue, wave_id, ctx):
        return cost_plan(queue, wave_id, ctx, model)

    assert drain(planner, sizes, starts, ctx, 2)[1] == drain(mpu, sizes, starts, ctx, 2)[1]


def test_at_the_full_budget_the_cost_planner_fills_as_static_does():
    # The ring is fed at M: fewest waves win, whatever the chunks' prefixes.
    model = CostModel(a=1e-6, c=1e-10, d=1e-2)
    ctx = PlanContext(budget=8192, ring=2, min_budget=512)
    queue = [Pending("fresh", 0, 1000), Pending("deep", 100_000, 140_000)]
    wave = cost_plan(queue, 0, ctx, model)
    assert wave.budget == 8192
    assert wave == static(queue, 0, ctx)
    assert [c.size for c in wave.chunks] == [1000, 7192]


def test_below_the_full_budget_long_prefix_chunks_get_fewer_tokens():
    # Little work left for a ring of 8: the budget halves, and the halved waves take
    # equal time, so a chunk 100K tokens deep gets what is left of the head's time.
    model = CostModel(a=1e-6, c=1e-10, d=1e-4)
    ctx = PlanContext(budget=8192, ring=8, min_budget=512)
    queue = [Pending("fresh", 0, 500), Pending("deep", 100_000, 103_000)]
    wave = cost_plan(queue, 0, ctx, model)
    assert wave.budget < ctx.budget
    fresh, deep = wave.chunks
    assert fresh.size == 500
    assert 0 < deep.size < wave.budget - 500  # static would give it the rest of the budget
    assert model.wave([(c.size, c.start) for c in wave.chunks]) <= (
        model.d + model.chunk(wave.budget, 0) * (1 + 1e-9)
    )


def test_a_large_per_wave_cost_keeps_waves_large():
    # Memory-bound waves: 8 ms whatever the size, 0.25 us a token. MPU halves to 1,024 to
    # feed a ring of 8 with 13K tokens of work; eight times the waves cost eight times the
    # weight reads, so the cost planner keeps waves four times larger.
    queue = [Pending(f"r{i}", 0, 820) for i in range(16)]
    ctx = PlanContext(budget=8192, ring=8, min_budget=512)
    assert mpu(queue, 0, ctx).budget == 1024
    assert cost_plan(queue, 0, ctx, CostModel(a=2.5e-7, c=0.0, d=8e-3)).budget == 4096


@settings(max_examples=200, deadline=None)
@given(sizes=queues, data=st.data(), ctx=contexts, model=models,
       floor=st.floats(0, 1e-2))  # fmt: skip
def test_with_the_ring_fed_a_per_wave_cost_keeps_full_waves(sizes, data, ctx, model, floor):
    """Where the full budget already feeds every stage (n(M) ≥ P), smaller waves only add
    per-wave cost (d > 0): the cost planner plans budget M, as static does — whatever
    the chunks' prefixes (attention work does not depend on how a request is chunked)."""
    from wavepp.plan.cost import choose_budget

    starts = [data.draw(st.integers(0, n - 1)) for n in sizes]
    queue = [Pending(f"r{i}", s, n) for i, (n, s) in enumerate(zip(sizes, starts, strict=True))]
    model = CostModel(model.a, model.c, model.d, floor)
    if estimated_waves(queue, ctx.budget) >= max(ctx.ring / 2, 1.0) and model.d >= 1e-5:
        assert choose_budget(queue, ctx, model) == ctx.budget


def test_waves_at_the_floor_measure_the_per_wave_cost():
    # The prior puts 256-token waves at the 8 ms floor; measured at 20 ms, they say the
    # runtime costs 12 ms a wave, and the fit learns d from them.
    prior = CostModel(a=1e-6, c=0.0, d=5e-4, floor=8e-3)
    fit = CostFit(prior=prior, weight=1.0)
    for _ in range(50):
        fit = observe(fit, [(256, 0)], 20e-3)
    assert fit.model().d == pytest.approx(12e-3, rel=0.1)
    assert fit.model().a == prior.a  # nothing learned about tokens


def test_fit_recovers_coefficients_from_measured_waves():
    truth = CostModel(a=2e-6, c=3e-11, d=1e-3)
    fit = CostFit(prior=CostModel(a=1e-6, c=1e-11, d=5e-4), weight=1.0)
    shapes = [(512, 0), (4096, 0), (2048, 50_000), (8192, 120_000), (1024, 9000)]
    assert fit.model() == fit.prior  # before any measurement: the prior
    for tokens, prefix in shapes * 20:  # a hundred measured waves
        fit = observe(fit, [(tokens, prefix)], truth.wave([(tokens, prefix)]))
    got = fit.model()
    assert got.a == pytest.approx(truth.a, rel=0.05)
    assert got.c == pytest.approx(truth.c, rel=0.05)


def test_waves_in_flight_keep_the_pipeline_fed():
    # A short queue at P = 4: on an empty pipeline the cost planner halves to feed it;
    # with three waves already in the stages after this one, one full wave feeds it.
    model = CostModel(a=1e-6, c=0.0, d=1e-4)
    queue = [Pending(f"r{i}", 0, 8192) for i in range(2)]
    empty = PlanContext(budget=16384, ring=8, min_budget=512, stages=4)
    assert cost_plan(queue, 0, empty, model).budget < 16384
    busy = PlanContext(budget=16384, ring=8, min_budget=512, stages=4, in_flight=3)
    assert cost_plan(queue, 0, busy, model).budget == 16384


def test_requests_about_to_be_admitted_keep_the_pipeline_fed():
    # A run's first request is admitted a round before the rest: alone, on an empty
    # pipeline, the cost planner would halve it; with fifteen more waiting for the
    # round under way, it plans the full wave static plans.
    model = CostModel(a=1e-6, c=0.0, d=1e-4)
    queue = [Pending("r0", 0, 8192)]
    alone = PlanContext(budget=8192, ring=8, min_budget=512, stages=4)
    assert cost_plan(queue, 0, alone, model).budget < 8192
    waiting = tuple(Pending(f"r{i}", 0, 8192) for i in range(1, 16))
    soon = attrs.evolve(alone, waiting=waiting)
    assert cost_plan(queue, 0, soon, model) == fill(queue, 0, 8192)
    # a little waiting work does not stop the halving where the ring would run dry
    few = attrs.evolve(alone, waiting=(Pending("r1", 7000, 8192),))
    assert cost_plan(queue, 0, few, model).budget < 8192
    # nor does waiting work that comes only after the admitted work is done (a round
    # slower than the wave: 10 ms against 8192 * 1e-6 + 1e-4 s)
    late = attrs.evolve(soon, waiting_after_s=0.010)
    assert cost_plan(queue, 0, late, model).budget < 8192


def flow_shop_s(times, stages):
    """Completion of waves taking ``times`` on each of ``stages`` identical stages."""
    done = [0.0] * stages
    for t in times:
        for s in range(stages):
            done[s] = max(done[s], done[s - 1] if s else 0.0) + t
    return done[-1]


def run_alone(planner, request, ctx, model):
    """A lone request planned to its end: its waves' predicted times."""
    waves = drain(planner, [request.num_tokens], [request.next_token], ctx, 0)[1]
    return [model.wave([(c.size, c.start) for c in wave.chunks]) for wave in waves]


def test_a_lone_long_prompt_gets_equal_time_chunks_and_finishes_sooner():
    # One cold 131K prompt at P = 4: static chunks of 8,192 grow dearer down the prompt
    # and the pipeline drains on the dearest; the cost planner's chunks take equal time.
    model = CostModel(a=1.8e-6, c=1.2e-10, d=5e-4, floor=8e-3)
    ctx = PlanContext(budget=8192, ring=8, min_budget=64, stages=4)
    request = Pending("r0", 0, 131_072)
    mine = run_alone(lambda q, i, c: cost_plan(q, i, c, model), request, ctx, model)
    theirs = run_alone(static, request, ctx, model)
    assert max(mine[:-1]) <= min(mine[:-1]) * 1.5  # equal time, but for the M cap early on
    assert max(theirs) > 5 * min(theirs)
    assert flow_shop_s(mine, 4) < 0.92 * flow_shop_s(theirs, 4)
    # a cached prefix: the chunks are sized for the suffix's own work
    deep = run_alone(lambda q, i, c: cost_plan(q, i, c, model), Pending("r1", 100_000, 131_072),
                     ctx, model)  # fmt: skip
    assert 1 < len(deep) < len(mine)


@settings(max_examples=200, deadline=None)
@given(size=st.integers(1, 200_000), start=st.floats(0, 0.99), ctx=contexts, model=models,
       floor=st.floats(0, 1e-2))  # fmt: skip
def test_a_lone_request_finishes_no_later_than_with_mpu(size, start, ctx, model, floor):
    """Alone in the pipeline, the cost planner's plan completes (by its own cost model,
    waves flowing through P identical stages) no later than MPU's, up to a wave's cost."""
    model = CostModel(model.a, model.c, max(model.d, 1e-6), floor)
    ctx = attrs.evolve(ctx, stages=max(ctx.ring // 2, 2))
    request = Pending("r0", int(start * size), size)
    mine = run_alone(lambda q, i, c: cost_plan(q, i, c, model), request, ctx, model)
    theirs = run_alone(mpu, request, ctx, model)
    slack = model.d + max(model.floor, model.chunk(ctx.min_budget, size))
    assert flow_shop_s(mine, ctx.stages) <= flow_shop_s(theirs, ctx.stages) + slack


def test_the_lone_request_rule_waits_while_others_run_or_wait():
    # Others in flight (a closed loop brings a request as each ends) or waiting: the
    # throughput rule plans, as before.
    model = CostModel(a=1.8e-6, c=1.2e-10, d=5e-4, floor=8e-3)
    alone = PlanContext(budget=8192, ring=8, min_budget=64, stages=4)
    queue = [Pending("r0", 60_000, 131_072)]
    assert cost_plan(queue, 0, alone, model).num_tokens < 8192
    for busy in (attrs.evolve(alone, running=3, in_flight=6),
                 attrs.evolve(alone, waiting=(Pending("r1", 0, 131_072),))):  # fmt: skip
        assert cost_plan(queue, 0, busy, model) == fill(queue, 0, 8192)
