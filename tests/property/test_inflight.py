"""In-flight prefix sharing (DESIGN §4b): the dependency value under random lives.

A state machine drives ``wavepp.state.inflight`` the way rank 0's admitter does —
requests arrive with prefixes branching off each other at arbitrary blocks, are held
back for a producer or offered, admitted or refused, make progress, are cancelled or
fail or finish, while a clock runs — against a plain model of who is live. After every
step: no cycle (waiters never produce), no wait on an ended producer, the holders
index exact, a wait past its deadline or on published blocks releases, and old values
never change. When everything has ended nothing is left.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

from wavepp.state import RequestId, empty_inflight, inflight


class InFlightMachine(RuleBasedStateMachine):
    snapshots = Bundle("snapshots")

    def __init__(self) -> None:
        super().__init__()
        self.fl = empty_inflight()
        self.now = 0.0
        self.paths: dict[RequestId, tuple[int, ...]] = {}
        self.queued: set[RequestId] = set()
        self.offered: dict[RequestId, int] = {}  # in the round under way -> published
        self.admitted: dict[RequestId, list[int]] = {}  # -> [published everywhere, sent]
        self.next_id = 0
        self.next_block = 1
        self.kept: list[tuple[object, object]] = []

    # -- arrivals: a prefix of an earlier request, then new blocks --------------------

    @rule(data=st.data(), fresh=st.integers(0, 6))
    def arrive(self, data, fresh: int) -> None:
        base: tuple[int, ...] = ()
        if self.paths:
            parent = data.draw(st.sampled_from(sorted(self.paths)))
            path = self.paths[parent]
            base = path[: data.draw(st.integers(0, len(path)))]
        blocks = tuple(range(self.next_block, self.next_block + fresh))
        self.next_block += fresh
        rid = RequestId(f"r{self.next_id}")
        self.next_id += 1
        self.paths[rid] = base + blocks
        self.queued.add(rid)

    # -- the admitter's decisions ----------------------------------------------------

    @precondition(lambda self: self.queued)
    @rule(data=st.data(), cached=st.integers(0, 4), budget=st.floats(0.0, 5.0))
    def offer_or_hold_back(self, data, cached: int, budget: float) -> None:
        """What ``Admitter._offers`` does with one queued request."""
        rid = data.draw(st.sampled_from(sorted(self.queued)))
        if rid in self.fl.waits:
            if not inflight.can_go(self.fl, rid, self.now):
                return
            self.fl = inflight.stop_wait(self.fl, rid)
        hashes = self.paths[rid]
        local = min(cached, len(hashes))
        producer, shared = inflight.shared_prefix(self.fl, hashes)
        if producer is not None:
            assert producer in self.offered or producer in self.admitted
            assert hashes[:shared] == self.paths[producer][:shared]
            assert shared == len(hashes) or hashes[shared] not in self.fl.holders
        if (producer is not None and shared > local and budget > 0
                and self.fl.producers[producer].done < shared):  # fmt: skip
            self.fl = inflight.start_wait(self.fl, rid, producer, shared, self.now + budget)
            return
        self.queued.discard(rid)
        # What rank 0 holds and no live producer still computes counts as published
        # (``Admitter._published``): siblings later in the round do not wait for it.
        published = local
        if producer is not None and shared > self.fl.producers[producer].done:
            published = min(local, self.fl.producers[producer].done)
        self.offered[rid] = published
        self.fl = inflight.add_producer(self.fl, rid, hashes, published, admitted=False)

    @precondition(lambda self: self.offered)
    @rule(data=st.data(), point=st.integers(0, 8))
    def round_outcome(self, data, point: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.offered)))
        del self.offered[rid]
        if data.draw(st.booleans(), label="admitted"):
            point = min(point, len(self.paths[rid]))
            self.admitted[rid] = [point, point]
            self.fl = inflight.add_producer(self.fl, rid, self.paths[rid], done=point)
            # the agreed point replaces rank 0's estimate, even where it is lower
            assert self.fl.producers[rid].done == self.fl.producers[rid].sent == point
        else:  # refused: back to the queue; its waiters fall back
            self.fl = inflight.end(self.fl, rid)
            self.queued.add(rid)

    @precondition(lambda self: self.admitted)
    @rule(data=st.data(), blocks=st.integers(1, 5))
    def chunk_sent(self, data, blocks: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.admitted)))
        upto = min(self.admitted[rid][1] + blocks, len(self.paths[rid]))
        self.admitted[rid][1] = upto
        self.fl = inflight.sent(self.fl, rid, upto)

    @precondition(lambda self: self.admitted)
    @rule(data=st.data())
    def chunk_left_last_stage(self, data) -> None:
        """The oldest chunk in flight comes back: everything sent is published."""
        rid = data.draw(st.sampled_from(sorted(self.admitted)))
        done = self.admitted[rid][1]
        self.admitted[rid][0] = done
        self.fl = inflight.progress(self.fl, rid, done)
        assert self.fl.producers[rid].done >= done
        for waiter, wait in self.fl.waits.items():  # covering chunks back: they may go
            if wait.producer == rid and wait.point <= done:
                assert inflight.can_go(self.fl, waiter, self.now)

    @precondition(lambda self: self.admitted or self.queued)
    @rule(data=st.data())
    def request_ends(self, data) -> None:
        """Done, cancelled or failed: the same for the dependency value."""
        rid = data.draw(st.sampled_from(sorted(self.admitted.keys() | self.queued)))
        waiters = {w for w, wait in self.fl.waits.items() if wait.producer == rid}
        self.admitted.pop(rid, None)
        self.queued.discard(rid)
        self.fl = inflight.end(self.fl, rid)
        for waiter in waiters:  # nobody waits on a request that ended
            assert waiter not in self.fl.waits
            assert inflight.can_go(self.fl, waiter, self.now)

    @rule(dt=st.floats(0.0, 3.0))
    def clock(self, dt: float) -> None:
        self.now += dt

    @precondition(lambda self: self.fl.waits)
    @rule(data=st.data(), by=st.floats(-2.0, 2.0))
    def revise_estimate(self, data, by: float) -> None:
        """A better estimate moves a deadline later, never earlier."""
        waiter = data.draw(st.sampled_from(sorted(self.fl.waits)))
        old = self.fl.waits[waiter].deadline
        self.fl = inflight.extend(self.fl, waiter, old + by)
        assert self.fl.waits[waiter].deadline == max(old, old + by)

    @rule(target=snapshots)
    def keep(self):
        value = self.fl
        copy = (dict(value.producers), dict(value.holders), dict(value.waits))
        return value, copy

    @rule(kept=snapshots)
    def old_value_unchanged(self, kept) -> None:
        value, copy = kept
        assert (dict(value.producers), dict(value.holders), dict(value.waits)) == copy

    # -- invariants ------------------------------------------------------------------

    @invariant()
    def rules_hold(self) -> None:
        inflight.check(self.fl)  # no cycle, no dangling wait, exact holders index
        assert set(self.fl.producers) == self.offered.keys() | self.admitted.keys()
        assert set(self.fl.waits) <= self.queued

    @invariant()
    def waits_are_bounded(self) -> None:
        """A waiter goes at its deadline unless the covering chunk is in the pipeline
        (then it goes when that chunk is back, which is sooner than recomputing)."""
        for waiter, wait in self.fl.waits.items():
            producer = self.fl.producers[wait.producer]
            estimate = self.offered.get(wait.producer, 0)
            done, sent = self.admitted.get(wait.producer, [estimate, estimate])
            assert (producer.done, producer.sent) == (done, sent)
            on_its_way = sent >= wait.point
            assert inflight.can_go(self.fl, waiter, wait.deadline) == (
                not on_its_way or done >= wait.point
            )
            assert inflight.can_go(self.fl, waiter, self.now) == (
                done >= wait.point or (not on_its_way and self.now >= wait.deadline)
            )
            expected = None if on_its_way else wait.deadline
            assert inflight.deadline(self.fl, waiter) == expected

    def teardown(self) -> None:
        for rid in sorted(self.offered.keys() | self.admitted.keys() | self.queued):
            self.fl = inflight.end(self.fl, rid)
        assert not self.fl.producers and not self.fl.holders and not self.fl.waits


TestInFlight = InFlightMachine.TestCase
TestInFlight.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_junctions_are_the_waiters_branch_points() -> None:
    fl = inflight.add_producer(empty_inflight(), RequestId("p"), (1, 2, 3, 4, 5, 6))
    fl = inflight.start_wait(fl, RequestId("a"), RequestId("p"), 2, 10.0)
    fl = inflight.start_wait(fl, RequestId("b"), RequestId("p"), 5, 10.0)
    assert inflight.junctions(fl, RequestId("p"), 0, 4) == (2,)
    assert inflight.junctions(fl, RequestId("p"), 2, 6) == (2, 5)
    assert inflight.shared_prefix(fl, (1, 2, 3, 9)) == ("p", 3)
    assert inflight.shared_prefix(fl, (9,)) == (None, 0)
