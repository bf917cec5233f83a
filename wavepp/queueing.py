"""The waiting queue: priority classes, FCFS (or earliest deadline first) inside a class.

An admission round is offered :meth:`WaitingQueue.head` and admits the longest
all-successful prefix of it (``wavepp.rounds.admission.fcfs_cut``): a refused request
blocks everything after it. Ordering the offer by class (higher first), then by
arrival, therefore gives the two priority guarantees:

- a higher class never waits behind a refused lower one (it is offered first);
- a lower class never overtakes a higher class's refused head (it is offered after it,
  so the refusal blocks it).

Inside a class the order is the policy's ``queue_order`` (``wavepp.policy``):

- ``"fcfs"`` (the default): arrival order, deadlines ignored;
- ``"edf"``: earliest deadline first — requests with a deadline by ascending absolute
  deadline (ties by arrival), then the requests without one in arrival order.

Either way the class guarantees above hold; EDF only reorders a class's members.

Plain Python, no torch, no I/O; every operation is O(log classes) or O(limit), apart
from :meth:`remove`, which is O(1) per id (dicts keep insertion order) — and EDF's
requests with a deadline, kept in a sorted list per class: O(log n) to find, O(n) to
insert or remove (a list move, fast for the queue depths a server sees).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Iterator

from wavepp.state import RequestId

__all__ = ["QUEUE_ORDERS", "WaitingQueue"]

QUEUE_ORDERS = ("fcfs", "edf")


class WaitingQueue:
    """Request ids waiting for admission, in admission order.

    Admission order: descending priority class, then inside a class ``order``'s —
    ascending arrival (``push`` order) for ``"fcfs"``; ascending deadline, then the
    deadline-less by arrival, for ``"edf"``. Ids are unique while queued; an id may be
    pushed again once it has left.
    """

    def __init__(self, order: str = "fcfs") -> None:
        if order not in QUEUE_ORDERS:
            raise ValueError(f"queue order {order!r} is not one of {', '.join(QUEUE_ORDERS)}")
        self.order = order
        self._classes: dict[int, dict[RequestId, None]] = {}  # class -> ids in arrival order
        # EDF only: class -> (deadline, arrival, id) ascending, the ids with a deadline
        # (those are then absent from ``_classes``' arrival-ordered dict)
        self._timed: dict[int, list[tuple[float, int, RequestId]]] = {}
        self._order: list[int] = []  # the non-empty classes' keys, ascending
        self._class_of: dict[RequestId, int] = {}
        self._timed_key: dict[RequestId, tuple[float, int, RequestId]] = {}
        self._arrivals = itertools.count()

    def push(self, request_id: RequestId, priority: int = 0,
             deadline: float | None = None) -> None:  # fmt: skip
        """Queue ``request_id`` in its class: at the back (FCFS, or EDF without a
        deadline), or by ``deadline`` (EDF; an absolute time, any clock, the same for
        every request of the queue)."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"priority must be an int, not {type(priority).__name__}")
        if deadline is not None and (isinstance(deadline, bool) or not math.isfinite(deadline)):
            raise ValueError(f"deadline must be a finite time, not {deadline!r}")
        if request_id in self._class_of:
            raise ValueError(f"request {request_id!r} is already queued")
        if priority not in self._classes:
            self._classes[priority] = {}
            self._timed[priority] = []
            bisect.insort(self._order, priority)
        if deadline is not None and self.order == "edf":
            key = (float(deadline), next(self._arrivals), request_id)
            bisect.insort(self._timed[priority], key)
            self._timed_key[request_id] = key
        else:
            self._classes[priority][request_id] = None
        self._class_of[request_id] = priority

    def remove(self, request_id: RequestId) -> bool:
        """Take ``request_id`` out (a cancel); False when it is not queued."""
        priority = self._class_of.pop(request_id, None)
        if priority is None:
            return False
        members, timed = self._classes[priority], self._timed[priority]
        key = self._timed_key.pop(request_id, None)
        if key is None:
            del members[request_id]
        else:
            del timed[bisect.bisect_left(timed, key)]
        if not members and not timed:
            del self._classes[priority], self._timed[priority]
            del self._order[bisect.bisect_left(self._order, priority)]
        return True

    def head(self, limit: int | None = None) -> list[RequestId]:
        """The first ``limit`` ids in admission order (all when ``limit`` is None)."""
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be ≥ 0, not {limit}")
        out: list[RequestId] = []
        for priority in reversed(self._order):
            timed = (key[2] for key in self._timed[priority])
            for request_id in itertools.chain(timed, self._classes[priority]):
                if limit is not None and len(out) >= limit:
                    return out
                out.append(request_id)
        return out

    def pop_admitted(self, request_ids: Iterable[RequestId]) -> list[RequestId]:
        """Remove the ids a round admitted; returns those that were still queued.

        An id that left meanwhile (cancelled while its round ran) is skipped, so a
        round's outcome can be applied after the queue changed under it.
        """
        return [request_id for request_id in request_ids if self.remove(request_id)]

    def priority_of(self, request_id: RequestId) -> int | None:
        """The class ``request_id`` waits in, or None when it is not queued."""
        return self._class_of.get(request_id)

    def depth_by_class(self) -> dict[int, int]:
        """How many ids wait in each non-empty class."""
        return {priority: len(self._classes[priority]) + len(self._timed[priority])
                for priority in self._order}  # fmt: skip

    def __len__(self) -> int:
        return len(self._class_of)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._class_of

    def __iter__(self) -> Iterator[RequestId]:
        return iter(self.head())

    def __repr__(self) -> str:
        return f"WaitingQueue({self.order}, {self.depth_by_class()})"
