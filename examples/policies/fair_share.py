"""A planner: MPU's budget, split evenly among the admitted requests (first come first
served for what is left), so every running request advances in every wave. It reads
the runtime's measurements like any planner: with a fitted cost model it caps the
budget at what the most recent wave took, so wave times stay level."""

from collections.abc import Sequence

import attrs

from wavepp.plan import Chunk, Pending, PlanContext, Wave, mpu_budget
from wavepp.policy import DEFAULT


def fair_share(queue: Sequence[Pending], wave_id: int, ctx: PlanContext) -> Wave | None:
    live = [p for p in queue if p.remaining > 0]
    if not live:
        return None
    budget = mpu_budget(live, ctx)
    if ctx.cost_model is not None and ctx.wave_seconds and ctx.cost_model.a > 0:
        level = int(ctx.wave_seconds[-1] / ctx.cost_model.a)  # tokens the last wave's time buys
        budget = max(ctx.min_budget, min(budget, level)) if level > 0 else budget
    budget = min(budget, ctx.budget)
    share = max(1, budget // len(live))
    sizes = {p.request_id: min(p.remaining, share) for p in live}
    room = budget - sum(sizes.values())
    for p in live:  # what is left, first come first served
        if room <= 0:
            break
        more = min(p.remaining - sizes[p.request_id], room)
        sizes[p.request_id] += more
        room -= more
    chunks, used = [], 0
    for p in live:
        size = min(sizes[p.request_id], budget - used)
        if size <= 0:
            break
        chunks.append(Chunk(p.request_id, p.next_token, p.next_token + size, p.num_tokens))
        used += size
    return Wave(wave_id, budget, tuple(chunks))


POLICY = attrs.evolve(DEFAULT, name="fair-share", planner=fair_share)
