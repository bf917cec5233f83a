"""The waiting queue: priority classes, FCFS by arrival inside a class.

An admission round is offered :meth:`WaitingQueue.head` and admits the longest
all-successful prefix of it (``wavepp.rounds.admission.fcfs_cut``): a refused request
blocks everything after it. Ordering the offer by class (higher first), then by
arrival, therefore gives the two priority guarantees:

- a higher class never waits behind a refused lower one (it is offered first);
- a lower class never overtakes a higher class's refused head (it is offered after it,
  so the refusal blocks it).

Plain Python, no torch, no I/O; every operation is O(log classes) or O(limit), apart
from :meth:`remove`, which is O(1) per id (dicts keep insertion order).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator

from wavepp.state import RequestId

__all__ = ["WaitingQueue"]


class WaitingQueue:
    """Request ids waiting for admission, in admission order.

    Admission order: descending priority class, then ascending arrival (``push`` order).
    Ids are unique while queued; an id may be pushed again once it has left.
    """

    def __init__(self) -> None:
        self._classes: dict[int, dict[RequestId, None]] = {}  # class -> ids in arrival order
        self._order: list[int] = []  # the non-empty classes' keys, ascending
        self._class_of: dict[RequestId, int] = {}

    def push(self, request_id: RequestId, priority: int = 0) -> None:
        """Queue ``request_id`` at the back of its class."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"priority must be an int, not {type(priority).__name__}")
        if request_id in self._class_of:
            raise ValueError(f"request {request_id!r} is already queued")
        members = self._classes.get(priority)
        if members is None:
            members = self._classes[priority] = {}
            bisect.insort(self._order, priority)
        members[request_id] = None
        self._class_of[request_id] = priority

    def remove(self, request_id: RequestId) -> bool:
        """Take ``request_id`` out (a cancel); False when it is not queued."""
        priority = self._class_of.pop(request_id, None)
        if priority is None:
            return False
        members = self._classes[priority]
        del members[request_id]
        if not members:
            del self._classes[priority]
            del self._order[bisect.bisect_left(self._order, priority)]
        return True

    def head(self, limit: int | None = None) -> list[RequestId]:
        """The first ``limit`` ids in admission order (all when ``limit`` is None)."""
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be ≥ 0, not {limit}")
        out: list[RequestId] = []
        for priority in reversed(self._order):
            for request_id in self._classes[priority]:
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
        return {priority: len(self._classes[priority]) for priority in self._order}

    def __len__(self) -> int:
        return len(self._class_of)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._class_of

    def __iter__(self) -> Iterator[RequestId]:
        return iter(self.head())

    def __repr__(self) -> str:
        return f"WaitingQueue({self.depth_by_class()})"
