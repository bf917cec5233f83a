"""Capabilities as data: the runtime's fast paths follow what a policy's functions
declare (``wavepp.policy.Guarantee``), never which function they are.

A wrapper of a default that only observes it (``functools.wraps``, or a module function
declaring the default's guarantees) takes exactly the default's paths; a function that
declares nothing takes the general one; the checker rejects a false declaration.
"""

import asyncio
import functools
from collections.abc import Sequence

import attrs
import pytest

from examples.policies.lfu import POLICY as LFU_POLICY
from examples.policies.smallest_fit import smallest_first
from wavepp import state
from wavepp.checker import Violation, admission_machine
from wavepp.checker.guarantees import check_escrow_order, keeping_promises
from wavepp.policy import (
    DEFAULT,
    FCFS,
    EscrowOrder,
    Guarantee,
    always,
    arrival_order,
    for_rung,
    guarantees,
    guarantees_of,
)
from wavepp.rounds import ProtocolError
from wavepp.rounds.admission import (
    Offer,
    RoundMode,
    StageBook,
    candidates,
    round_over,
    run_round,
    settle,
    spare_room,
    worth_offering,
)
from wavepp.state import block_hashes, empty_cache

B = 2


def offer(rid: str, *blocks: int) -> Offer:
    tokens = [t for b in blocks for t in (b, b)] + [9]
    return Offer(rid, len(tokens), block_hashes(tokens, B), (len(tokens) - 1) // B)


class Calls:
    """Counts the calls of every function it wraps, by name."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def logged(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            self.counts[fn.__name__] = self.counts.get(fn.__name__, 0) + 1
            return fn(*args, **kwargs)

        return wrapper

    def plain(self, fn):
        """The same wrapper without ``functools.wraps``: it declares nothing."""

        def wrapper(*args, **kwargs):
            self.counts[fn.__name__] = self.counts.get(fn.__name__, 0) + 1
            return fn(*args, **kwargs)

        return wrapper


def wrapped(policy, wrap):
    return attrs.evolve(
        policy,
        name="wrapped",
        probe=wrap(policy.probe),
        reconcile=wrap(policy.reconcile),
        escrow=wrap(policy.escrow),
        escrow_order=EscrowOrder("wrapped", order=wrap(arrival_order), blocks=wrap(always)),
    )


@guarantees(*guarantees_of(state.escrow))
def module_escrow(cache, request_id, num_blocks):
    """What ``--policy pkg.mod:NAME`` naming a function that calls the default looks like."""
    return state.escrow(cache, request_id, num_blocks)


class OneRank:
    """A rounds plane of one rank that records which collectives a round ran."""

    rank, world_size = 0, 1

    def __init__(self) -> None:
        self.collectives: list[tuple[str, int]] = []

    async def broadcast(self, payload):
        return payload

    async def all_min(self, values: Sequence[int]) -> list[int]:
        self.collectives.append(("min", len(values)))
        return list(values)

    async def all_and(self, values: Sequence[int]) -> list[int]:
        self.collectives.append(("and", len(values)))
        return list(values)

    async def all_reduce(self, mins: Sequence[int], ands: Sequence[int]):
        self.collectives.append(("min+and", len(mins), len(ands)))
        return list(mins), list(ands)

    async def gather(self, payload):
        return [payload]


def paths(policy) -> dict:
    """Every branch the runtime takes on the policy's declarations, and what a round
    over a roomy and a full pool did."""
    mode = RoundMode(B, policy=policy)
    roomy = [offer("a", 1, 2), offer("b", 1, 3)]
    full = [offer("x", 4, 5, 6), offer("y", 7, 8, 9), offer("z", 1)]  # 4 blocks each, 2 last
    out = {
        "fcfs": policy.escrow_order.first_come_first_served,
        "escrow_within_room": policy.escrow_within_room,
        "worth_offering": worth_offering(empty_cache(6), full, mode),
        "spare_room": spare_room(empty_cache(64), roomy, mode),
        "r1_swaps_probe": for_rung(policy, linear_probe=True, planner="static").probe
        is state.probe_linear,
    }
    for label, capacity, offers in (("roomy", 64, roomy), ("full", 6, full)):
        plane, book = OneRank(), StageBook(empty_cache(capacity))
        result = asyncio.run(run_round(plane, book, offers, mode))
        out[label] = (plane.collectives, result.admitted, result.points)
    return out


def test_the_defaults_declare_the_guarantees_of_the_fast_paths():
    assert DEFAULT.escrow_order.first_come_first_served and DEFAULT.escrow_within_room
    assert Guarantee.PLAIN_PROBE in guarantees_of(DEFAULT.probe)
    assert Guarantee.PLAIN_PROBE in guarantees_of(state.probe_linear)
    default = paths(DEFAULT)
    assert default["worth_offering"] == 2  # the FCFS trim: z is not offered
    assert default["spare_room"] >= 0 and default["r1_swaps_probe"]
    # one collective: probes, leases, room and the guesses' points and flags (3 each per
    # offer) MIN-ed, the masks AND-ed; no escrow flags' MIN of its own
    assert default["roomy"][0] == [("min+and", 3 * 2 + 1 + 3 * 2, 2)]


def test_a_wrapped_default_takes_exactly_the_defaults_paths():
    calls = Calls()
    policy = wrapped(DEFAULT, calls.logged)
    assert paths(policy) == paths(DEFAULT)
    for name in ("probe", "reconcile", "escrow", "arrival_order", "always"):
        assert calls.counts.get(name, 0) > 0, (name, calls.counts)  # the wrappers ran


def test_a_module_function_declaring_the_defaults_guarantees_takes_its_paths():
    policy = attrs.evolve(DEFAULT, escrow=module_escrow)
    assert paths(policy) == paths(DEFAULT)


def test_functions_that_declare_nothing_take_the_general_paths():
    calls = Calls()
    policy = wrapped(DEFAULT, calls.plain)
    got, default = paths(policy), paths(DEFAULT)
    assert not got["fcfs"] and not got["escrow_within_room"] and not got["r1_swaps_probe"]
    assert got["worth_offering"] == 3 and got["spare_room"] == -1
    assert got["roomy"][0] == [*default["roomy"][0], ("min", 2)]  # the escrow flags' MIN
    # the general paths decide the same: only the work differs
    assert got["roomy"][1:] == default["roomy"][1:] and got["full"][1:] == default["full"][1:]


def test_withdrawing_a_declaration_takes_the_general_path():
    undeclared = guarantees()(functools.wraps(state.escrow)(lambda *a: state.escrow(*a)))
    assert guarantees_of(undeclared) == frozenset()
    assert not attrs.evolve(DEFAULT, escrow=undeclared).escrow_within_room
    with pytest.raises(TypeError, match="not a wavepp Guarantee"):
        guarantees("arrival_order")


def test_the_checker_rejects_an_escrow_order_that_declares_arrival_order_falsely():
    liar = EscrowOrder("liar", order=guarantees(Guarantee.ARRIVAL_ORDER)(smallest_first),
                       blocks=always)  # fmt: skip
    offers = [offer("big", 1, 2, 3), offer("small", 4)]
    cands = candidates(offers, [0, 0], B)
    check_escrow_order(FCFS, cands, FCFS.order(cands))  # the default keeps its word
    with pytest.raises(Violation) as caught:
        check_escrow_order(liar, cands, liar.order(cands))
    assert caught.value.invariant == "guarantees_hold"
    # and the admission machine runs that check in every round
    machine = admission_machine(attrs.evolve(DEFAULT, escrow_order=liar))()
    machine.setup(capacities=[16, 16], recurrent=[False] * 4, snapshot_pools=[None] * 4,
                  eager=False)  # fmt: skip
    with pytest.raises(Violation) as caught:
        machine.admit_new(batch=[[1] * 12 + [9], [0] * 4 + [9]])
    assert caught.value.invariant == "guarantees_hold"


def test_the_checker_rejects_an_escrow_that_declares_room_falsely():
    @guarantees(Guarantee.ESCROW_WITHIN_ROOM)
    def stingy(cache, request_id, num_blocks):
        return cache, num_blocks == 0

    policy = keeping_promises(attrs.evolve(DEFAULT, escrow=stingy))
    assert policy.escrow_within_room  # the checking wrapper keeps the declaration
    cache = empty_cache(16)
    a = offer("a", 1, 2)
    cache, _ = state.lease(cache, "a", a.hashes, 0)
    with pytest.raises(Violation) as caught:
        settle(cache, [a], [0], RoundMode(B, policy=policy))
    assert caught.value.invariant == "guarantees_hold"
    assert "refused 3 blocks with 16 backable" in str(caught.value)


def test_a_round_refuses_a_cache_that_evicts_in_another_order_than_the_policy():
    mode = RoundMode(B, policy=LFU_POLICY)
    with pytest.raises(ProtocolError, match="evicts in order 'lru' but policy 'lfu' names 'lfu'"):
        round_over([empty_cache(16)], [offer("a", 1)], mode)
    _, result = round_over([LFU_POLICY.empty_cache(16)], [offer("a", 1)], mode)
    assert result.admitted == (True,)
