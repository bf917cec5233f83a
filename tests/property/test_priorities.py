"""Priority classes in the waiting queue, as a Hypothesis state machine.

Random pushes (class, size), cancels, admission rounds and finishes run against
``WaitingQueue`` and a plain reference (a list sorted by class, then arrival). An
admission round is simulated the way the real one decides: the queue's head is
offered, each offer escrows its size from a shared capacity in order (a refusal is
an offer that does not fit), and ``fcfs_cut`` admits the longest all-successful
prefix. After each round the three guarantees are checked:

- FCFS inside a class: no request is admitted while an earlier arrival of its class
  is still waiting;
- a higher class never waits behind a refused lower one: every offer left out sits
  after a refused offer of a class at least as high as its own;
- a lower class never overtakes a higher class's refused head: no admitted request
  has a lower class than any offer that was refused or left out.
"""

from __future__ import annotations

import subprocess
import sys

import hypothesis.strategies as st
import pytest
from hypothesis import event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from wavepp.queueing import WaitingQueue
from wavepp.rounds.admission import fcfs_cut

CAPACITY = 10
classes = st.integers(-2, 2)
sizes = st.integers(1, CAPACITY)


class PriorityMachine(RuleBasedStateMachine):
    @initialize()
    def start(self):
        self.queue = WaitingQueue()
        self.reference: list[tuple[int, int, str]] = []  # (class, arrival, id)
        self.size: dict[str, int] = {}
        self.running: dict[str, int] = {}  # id -> size held
        self.arrival = 0
        self.admitted_log: list[str] = []

    def free(self) -> int:
        return CAPACITY - sum(self.running.values())

    def expected_order(self) -> list[str]:
        return [rid for _, _, rid in sorted(self.reference, key=lambda r: (-r[0], r[1]))]

    @rule(priority=classes, size=sizes)
    def push(self, priority, size):
        rid = f"r{self.arrival}"
        self.queue.push(rid, priority)
        self.reference.append((priority, self.arrival, rid))
        self.size[rid] = size
        self.arrival += 1

    @precondition(lambda self: self.reference)
    @rule(data=st.data())
    def cancel_queued(self, data):
        _, _, rid = data.draw(st.sampled_from(self.reference))
        assert self.queue.remove(rid)
        self.reference = [r for r in self.reference if r[2] != rid]
        assert rid not in self.queue
        assert not self.queue.remove(rid)

    @rule(rid=st.text(min_size=1, max_size=3))
    def cancel_unknown(self, rid):
        known = any(r[2] == rid for r in self.reference)
        assert self.queue.remove(rid) == known
        self.reference = [r for r in self.reference if r[2] != rid]

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        del self.running[rid]

    @rule(limit=st.one_of(st.none(), st.integers(0, 6)), cancel_during=st.booleans())
    def admission_round(self, limit, cancel_during):
        offered = self.queue.head(limit)
        assert offered == self.expected_order()[: len(offered)]
        free, flags = self.free(), []
        for rid in offered:
            fits = self.size[rid] <= free
            free -= self.size[rid] if fits else 0
            flags.append(int(fits))
        admitted_flags = fcfs_cut(flags)
        admitted = [rid for rid, ok in zip(offered, admitted_flags, strict=True) if ok]
        left_out = [rid for rid, ok in zip(offered, admitted_flags, strict=True) if not ok]
        cls = {rid: p for p, _, rid in self.reference}
        arrival = {rid: a for _, a, rid in self.reference}
        event(f"round admitted {len(admitted)} of {len(offered)}")

        # FCFS inside a class: an admitted request has no earlier waiting arrival of its class.
        for rid in admitted:
            earlier = [
                r for p, a, r in self.reference
                if p == cls[rid] and a < arrival[rid] and r not in admitted
            ]  # fmt: skip
            assert not earlier, f"{rid} admitted before {earlier} of its class"
        # A higher class never waits behind a refused lower one.
        if left_out:
            head_refused = left_out[0]
            assert flags[offered.index(head_refused)] == 0
            for rid in left_out:
                assert cls[rid] <= cls[head_refused], (
                    f"{rid} (class {cls[rid]}) waits behind refused {head_refused} "
                    f"(class {cls[head_refused]})"
                )
        # A lower class never overtakes a higher class's waiting head.
        waiting = [r for r in self.reference if r[2] not in admitted]
        if waiting and admitted:
            top_waiting = max(p for p, _, _ in waiting)
            assert min(cls[r] for r in admitted) >= top_waiting, (
                f"admitted class {min(cls[r] for r in admitted)} while class {top_waiting} waits"
            )

        if cancel_during and admitted:
            # A cancel that lands while the round runs: the queue skips it on pop.
            gone = admitted[-1]
            assert self.queue.remove(gone)
            self.reference = [r for r in self.reference if r[2] != gone]
            admitted = admitted[:-1]
            popped = self.queue.pop_admitted([*admitted, gone])
        else:
            popped = self.queue.pop_admitted(admitted)
        assert popped == admitted
        for rid in admitted:
            self.running[rid] = self.size[rid]
            self.admitted_log.append(rid)
        self.reference = [r for r in self.reference if r[2] not in admitted]

    @invariant()
    def matches_reference(self):
        if not hasattr(self, "queue"):
            return
        order = self.expected_order()
        assert list(self.queue) == order
        assert len(self.queue) == len(order)
        assert all(rid in self.queue for rid in order)
        assert all(rid not in self.queue for rid in self.running)
        depth: dict[int, int] = {}
        for p, _, _ in self.reference:
            depth[p] = depth.get(p, 0) + 1
        assert self.queue.depth_by_class() == dict(sorted(depth.items()))

    @invariant()
    def capacity_respected(self):
        if hasattr(self, "queue"):
            assert self.free() >= 0


PriorityMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestPriorities = PriorityMachine.TestCase


def test_exact_admission_order():
    queue = WaitingQueue()
    for rid, priority in [("a", 0), ("b", 1), ("c", 0), ("d", 2), ("e", 1), ("f", -1)]:
        queue.push(rid, priority)
    assert queue.head() == ["d", "b", "e", "a", "c", "f"]
    assert queue.head(3) == ["d", "b", "e"]
    assert queue.head(0) == []
    # A refused class-1 head ("b") blocks the class-0 requests behind it.
    flags = [1, 0, 1, 1, 1, 1]
    admitted = [r for r, ok in zip(queue.head(), fcfs_cut(flags), strict=True) if ok]
    assert admitted == ["d"]
    assert queue.pop_admitted(admitted) == ["d"]
    assert queue.head() == ["b", "e", "a", "c", "f"]


def test_bad_pushes_say_why():
    queue = WaitingQueue()
    queue.push("a")
    with pytest.raises(ValueError, match="already queued"):
        queue.push("a", 3)
    with pytest.raises(TypeError, match="priority must be an int"):
        queue.push("b", 1.5)
    with pytest.raises(TypeError, match="priority must be an int"):
        queue.push("b", True)
    with pytest.raises(ValueError, match="limit must be"):
        queue.head(-1)
    assert list(queue) == ["a"]
    queue.remove("a")
    queue.push("a", 5)  # an id may come back once it left
    assert queue.priority_of("a") == 5


def test_queue_does_not_import_torch():
    code = "import sys, wavepp.queueing; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
