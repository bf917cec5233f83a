"""The policy record: selection, overrides, the escrow order, typed protocol errors."""

import attrs
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from examples.policies import smallest_fit
from wavepp import state
from wavepp.plan import PLANNERS, PlanContext, cost, mpu
from wavepp.plan.cost import NoCostModel
from wavepp.policy import (
    DEFAULT,
    FCFS,
    ChunkSpan,
    EscrowOrder,
    PolicyError,
    every_interval_and_end,
    for_run,
    for_rung,
    load_policy,
    with_overrides,
)
from wavepp.rounds import ProtocolError
from wavepp.rounds.admission import (
    Offer,
    RoundMode,
    round_over,
    settle,
    worth_offering,
)
from wavepp.state import block_hashes, empty_cache

B = 2


def offer(rid, *blocks):
    tokens = [t for b in blocks for t in (b, b)] + [9]
    return Offer(rid, len(tokens), block_hashes(tokens, B), (len(tokens) - 1) // B)


def test_load_policy_by_name_and_dotted_path():
    assert load_policy("default") is DEFAULT
    lfu = load_policy("examples.policies.lfu:POLICY")
    assert lfu.eviction.name == "lfu" and lfu.escrow is state.escrow
    with pytest.raises(PolicyError, match="has no 'NOPE'"):
        load_policy("examples.policies.lfu:NOPE")
    with pytest.raises(PolicyError, match="names a Eviction, not a wavepp Policy"):
        load_policy("examples.policies.lfu:LFU")
    with pytest.raises(PolicyError, match="not built in"):
        load_policy("lfu")


def test_single_fields_are_overridden_and_described():
    policy = with_overrides(
        DEFAULT, planner="mpu", probe="linear", eviction="examples.policies.lfu:LFU"
    )
    assert policy.planner is mpu and policy.probe is state.probe_linear
    assert policy.eviction.name == "lfu"
    described = policy.describe()
    assert described["eviction"] == "lfu" and described["escrow_order"] == "fcfs"
    assert described["planner"] == "wavepp.plan.planners:mpu"
    assert DEFAULT.describe()["planner"] == "rung default"
    with pytest.raises(PolicyError, match="planner 'fastest' is not built in"):
        with_overrides(DEFAULT, planner="fastest")


def test_the_rung_fills_what_the_policy_leaves_open():
    r1 = for_rung(DEFAULT, linear_probe=True, planner="static")
    assert r1.probe is state.probe_linear and r1.planner is PLANNERS["static"]
    own = attrs.evolve(DEFAULT, planner=mpu, probe=state.probe)
    r5 = for_rung(own, linear_probe=False, planner="cost")
    assert r5.planner is mpu  # the policy's own planner wins over the rung's
    assert for_rung(DEFAULT, linear_probe=False, planner="cost").planner is cost


def test_command_line_fields_win_over_the_rungs():
    r1 = for_run("default", linear_probe=True, rung_planner="static", probe="gallop")
    assert r1.probe is state.probe  # --rung R1 --probe gallop gallops
    assert for_run("default", linear_probe=True, rung_planner="static").probe is state.probe_linear
    r5 = for_run("default", linear_probe=False, rung_planner="cost", planner="mpu")
    assert r5.planner is mpu


def test_the_cost_planner_needs_the_runtime_fit():
    with pytest.raises(NoCostModel, match=r"needs PlanContext\.cost_model"):
        cost([], 0, PlanContext(budget=64, ring=2, min_budget=16))


def test_policy_builds_caches_with_its_eviction_order():
    lfu = load_policy("examples.policies.lfu:POLICY")
    assert lfu.empty_cache(8).eviction is lfu.eviction
    assert DEFAULT.empty_cache(8, snapshot_capacity=3).snapshot_capacity == 3


def test_default_placement_every_interval_and_the_request_end():
    cache = empty_cache(8, has_recurrent=True)
    hashes = tuple(range(1, 12))
    span = ChunkSpan("r", hashes, held=3, end_blocks=9, ends_request=True, interval=4)
    assert every_interval_and_end(cache, span) == (4, 8, 9)
    tail = ChunkSpan("r", hashes, 9, 9, True, 4, starts_at_held=True)
    assert every_interval_and_end(cache, tail) == (9,)  # a partial tail still snapshots
    assert every_interval_and_end(cache, attrs.evolve(tail, starts_at_held=False)) == ()
    assert every_interval_and_end(empty_cache(8), span) == ()


def _full_pool():
    """A pool of 6 blocks, 3 of them materialized for a running request: 3 backable."""
    cache = empty_cache(6)
    cached = offer("old", 1, 2)
    cache, _ = state.lease(cache, "old", cached.hashes, 0)
    cache, _ = state.escrow(cache, "old", 3)
    return state.materialize(cache, "old")[0]


def test_fcfs_refuses_everyone_after_a_refused_request():
    big, small = offer("big", 1, 2, 3, 4), offer("small", 5)  # need 5 and 2 blocks
    _, result = round_over([_full_pool()], [big, small], RoundMode(B))
    assert result.admitted == (False, False)


def test_smallest_fit_admits_the_small_one_and_the_aging_bound_blocks():
    big, small = offer("big", 1, 2, 3, 4), offer("small", 5)
    mode = RoundMode(B, policy=smallest_fit.POLICY)
    _, result = round_over([_full_pool()], [big, small], mode)
    assert result.admitted == (False, True)
    aged = {"big": smallest_fit.AGING_BOUND}
    _, result = round_over([_full_pool()], [big, small], mode, refusals=aged)
    assert result.admitted == (False, False)  # big waited long enough: nobody overtakes


def test_an_escrow_order_that_is_no_permutation_is_a_protocol_error():
    broken = EscrowOrder("dup", order=lambda cands: [0] * len(cands), blocks=FCFS.blocks)
    mode = RoundMode(B, policy=attrs.evolve(DEFAULT, escrow_order=broken))
    with pytest.raises(ProtocolError, match=r"returned \[0, 0\] for 2 offers"):
        round_over([empty_cache(16)], [offer("a", 1), offer("b", 2)], mode)


def test_settle_raises_a_typed_error_when_a_stage_cannot_serve_the_agreed_point():
    cache = empty_cache(16)
    a = offer("a", 1, 2)
    cache, _ = state.lease(cache, "a", a.hashes, 0)
    lying = attrs.evolve(DEFAULT, reconcile=lambda c, rid, h, p: (c, p + 1))
    with pytest.raises(ProtocolError, match="cannot serve the agreed point 0 of 'a'"):
        settle(cache, [a], [0], RoundMode(B, policy=lying))


@settings(max_examples=60, deadline=None)
@example(capacities=[5], warm=[2, 1, 1], asks=[[1, 1], [1], [1], [2, 1, 1]])
@given(
    capacities=st.lists(st.integers(4, 24), min_size=1, max_size=3),
    warm=st.lists(st.integers(1, 6), max_size=6),
    asks=st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=6), min_size=1, max_size=8),
)
def test_offers_past_the_fcfs_cut_would_never_be_admitted(capacities, warm, asks):
    """A round over the head the admitter offers (``worth_offering`` on stage 0's cache)
    loses nothing: it admits every head offer a round over every waiting request admits,
    and that round admits nothing past the head. (It may admit more of the head: in the
    longer round a later offer's lease can pin blocks an earlier offer's escrow would
    have counted as evictable — capacities [5], a 3-block seed path, asks [[1, 1], [1],
    [1], [2, 1, 1]]: the full round refuses r1, the head round admits it.)"""
    caches = [empty_cache(c) for c in capacities]
    seed = offer("seed", *warm) if warm else None
    for s, cache in enumerate(caches):  # a cached path some offers share
        if seed is not None and len(seed.hashes) <= capacities[s]:
            cache, _ = state.lease(cache, "seed", seed.hashes, 0)
            cache, _ = state.escrow(cache, "seed", len(seed.hashes))
            cache, _ = state.materialize(cache, "seed")
            cache = state.publish(cache, "seed", seed.hashes, len(seed.hashes))
            caches[s] = state.release(cache, "seed")
    offers = [offer(f"r{i}", *blocks) for i, blocks in enumerate(asks)]
    mode = RoundMode(B)
    _, everyone = round_over(caches, offers, mode)
    k = worth_offering(caches[0], offers, mode)
    assert 1 <= k <= len(offers)
    _, head = round_over(caches, offers[:k], mode)
    assert all(h or not e for e, h in zip(everyone.admitted[:k], head.admitted, strict=True))
    assert not any(everyone.admitted[k:])
