"""Deadlines in the waiting queue: EDF inside a priority class, as a Hypothesis state machine.

Random pushes (class, deadline or none, size), cancels, admission rounds and finishes
run against ``WaitingQueue(order)`` and a plain reference: a list sorted by the order's
key — ``(-class, arrival)`` for FCFS; ``(-class, has no deadline, deadline, arrival)``
for EDF. Rounds are simulated as the real one decides (the head is offered, each offer
escrows its size in order, ``fcfs_cut`` admits the longest all-successful prefix), and
after each round:

- the offer is the reference's head, so EDF (earliest deadline first, ties by arrival,
  then the deadline-less by arrival) holds inside every class, and FCFS ignores deadlines;
- classes stay strict: no admitted request has a lower class than one still waiting, and
  every offer left out sits behind a refused offer of a class at least as high;
- inside a class under EDF, no request is admitted while one of its class with an earlier
  deadline (or any deadline, when it has none) still waits.
"""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
from hypothesis import event, given, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from wavepp.queueing import WaitingQueue
from wavepp.rounds.admission import fcfs_cut

CAPACITY = 10
classes = st.integers(-1, 1)
sizes = st.integers(1, CAPACITY)
# few distinct values, so equal deadlines (ties by arrival) come up often
deadlines = st.one_of(st.none(), st.integers(0, 6).map(float))


def reference_key(order: str):
    def key(row: tuple[int, float | None, int, str]):
        priority, deadline, arrival, _ = row
        if order == "fcfs":
            return (-priority, arrival)
        return (-priority, deadline is None, deadline or 0.0, arrival)

    return key


class DeadlineMachine(RuleBasedStateMachine):
    @initialize(order=st.sampled_from(["fcfs", "edf"]))
    def start(self, order):
        self.order = order
        self.queue = WaitingQueue(order)
        self.reference: list[tuple[int, float | None, int, str]] = []  # class, due, arrival, id
        self.size: dict[str, int] = {}
        self.running: dict[str, int] = {}
        self.arrival = 0

    def expected_order(self) -> list[str]:
        return [row[3] for row in sorted(self.reference, key=reference_key(self.order))]

    def free(self) -> int:
        return CAPACITY - sum(self.running.values())

    @rule(priority=classes, deadline=deadlines, size=sizes)
    def push(self, priority, deadline, size):
        rid = f"r{self.arrival}"
        self.queue.push(rid, priority, deadline)
        self.reference.append((priority, deadline, self.arrival, rid))
        self.size[rid] = size
        self.arrival += 1
        event(f"{self.order}: deadline {'none' if deadline is None else 'set'}")

    @precondition(lambda self: self.reference)
    @rule(data=st.data())
    def cancel_queued(self, data):
        row = data.draw(st.sampled_from(self.reference))
        assert self.queue.remove(row[3])
        self.reference.remove(row)
        assert row[3] not in self.queue
        assert not self.queue.remove(row[3])

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        del self.running[data.draw(st.sampled_from(sorted(self.running)))]

    @rule(limit=st.one_of(st.none(), st.integers(0, 6)))
    def admission_round(self, limit):
        offered = self.queue.head(limit)
        assert offered == self.expected_order()[: len(offered)]
        free, flags = self.free(), []
        for rid in offered:
            fits = self.size[rid] <= free
            free -= self.size[rid] if fits else 0
            flags.append(int(fits))
        cut = fcfs_cut(flags)
        admitted = [rid for rid, ok in zip(offered, cut, strict=True) if ok]
        left_out = [rid for rid, ok in zip(offered, cut, strict=True) if not ok]
        row_of = {row[3]: row for row in self.reference}
        waiting = [row for row in self.reference if row[3] not in admitted]
        # classes stay strict
        if waiting and admitted:
            assert min(row_of[r][0] for r in admitted) >= max(row[0] for row in waiting)
        if left_out:
            refused = left_out[0]
            assert flags[offered.index(refused)] == 0
            assert all(row_of[r][0] <= row_of[refused][0] for r in left_out)
        # EDF inside a class: nobody overtakes an earlier deadline of its class
        if self.order == "edf":
            for rid in admitted:
                cls, due, _, _ = row_of[rid]
                earlier = [row[3] for row in waiting if row[0] == cls and row[1] is not None
                           and (due is None or row[1] < due)]  # fmt: skip
                assert not earlier, f"{rid} (due {due}) admitted before {earlier}"
        assert self.queue.pop_admitted(admitted) == admitted
        for rid in admitted:
            self.running[rid] = self.size[rid]
        self.reference = waiting

    @invariant()
    def matches_reference(self):
        if not hasattr(self, "queue"):
            return
        order = self.expected_order()
        assert list(self.queue) == order
        assert len(self.queue) == len(order)
        depth: dict[int, int] = {}
        for row in self.reference:
            depth[row[0]] = depth.get(row[0], 0) + 1
        assert self.queue.depth_by_class() == dict(sorted(depth.items()))
        assert all(self.queue.priority_of(row[3]) == row[0] for row in self.reference)


DeadlineMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestDeadlines = DeadlineMachine.TestCase


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(classes, deadlines), max_size=30))
def test_without_deadlines_edf_is_fcfs(rows):
    """A queue where no request carries a deadline orders the same under both orders."""
    fcfs, edf = WaitingQueue("fcfs"), WaitingQueue("edf")
    for i, (priority, _) in enumerate(rows):
        fcfs.push(f"r{i}", priority)
        edf.push(f"r{i}", priority)
    assert fcfs.head() == edf.head()


def test_exact_edf_order():
    queue = WaitingQueue("edf")
    for rid, priority, due in [("a", 0, None), ("b", 0, 5.0), ("c", 1, None), ("d", 0, 2.0),
                               ("e", 1, 9.0), ("f", 0, 5.0), ("g", 0, None)]:  # fmt: skip
        queue.push(rid, priority, due)
    # class 1 first (deadline e, then c); class 0: d (2), b and f (5, by arrival), a, g
    assert queue.head() == ["e", "c", "d", "b", "f", "a", "g"]
    assert queue.remove("b") and queue.head(3) == ["e", "c", "d"]
    assert queue.head() == ["e", "c", "d", "f", "a", "g"]
    fcfs = WaitingQueue("fcfs")
    for rid, due in [("a", None), ("b", 5.0), ("d", 2.0)]:
        fcfs.push(rid, 0, due)
    assert fcfs.head() == ["a", "b", "d"]  # FCFS ignores deadlines


def test_bad_orders_and_deadlines_say_why():
    with pytest.raises(ValueError, match="queue order 'lifo' is not one of fcfs, edf"):
        WaitingQueue("lifo")
    queue = WaitingQueue("edf")
    for bad in (math.inf, math.nan, -math.inf):
        with pytest.raises(ValueError, match="deadline must be a finite time"):
            queue.push("a", 0, bad)
    assert len(queue) == 0
    queue.push("a", 0, 1.0)
    with pytest.raises(ValueError, match="already queued"):
        queue.push("a", 0, None)
    assert queue.remove("a") and not queue and queue.depth_by_class() == {}
