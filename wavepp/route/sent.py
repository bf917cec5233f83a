"""What the router has sent to one replica: prompts in flight, and prompts it answered
recently whose blocks the replica's KV events have not confirmed yet.

A replica announces a block once every stage holds it, so between a prompt's answer and
its events reaching the router (and, for a prompt still computing, until its last chunk)
the index does not show what the replica has. The router knows, because it sent the
prompt: a prefix in flight is one the replica will hold (a replica makes a request wait for
a prefix an admitted one is computing rather than compute it twice), and a prefix answered
a moment ago is one it holds. Both count as cached until the events confirm them (the index
holds the whole prompt: from then on the index says when it goes) or, after
``memory_s``, have not (evicted already, or never announced: the index is believed).

Memory is bounded: at most ``memory_blocks`` block hashes of answered prompts, the oldest
forgotten first. Block hashes are chained, so a prompt's blocks held here are a run from its
first block and a binary search finds how many.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Sequence

import attrs

SETTLE_CHECKS = 8  # answered prompts checked against the index per routing decision


@attrs.frozen
class MemoryOptions:
    # seconds an answered prompt counts as cached while the events have not confirmed it
    memory_s: float = 10.0
    # block hashes of answered prompts kept per replica (the oldest prompts forgotten first)
    memory_blocks: int = 1 << 18

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.memory_s < 1e6:
            raise ValueError(f"memory_s must be in [0, 1e6) seconds, got {self.memory_s:g}")
        if self.memory_blocks < 0:
            raise ValueError(f"memory_blocks must be ≥ 0, got {self.memory_blocks}")


@attrs.define(eq=False)
class _Answered:
    hashes: tuple[int, ...]  # the prompt's chained block hashes, full blocks
    at: float  # when its answer came, on the router's monotonic clock


def _depth(table: collections.Counter[int], hashes: Sequence[int], limit: int) -> int:
    """Leading blocks of ``hashes`` (at most ``limit``) in ``table`` (prefix-closed)."""
    low, high = 0, min(limit, len(hashes))
    while low < high:
        mid = (low + high + 1) // 2
        if table[hashes[mid - 1]] > 0:
            low = mid
        else:
            high = mid - 1
    return low


def _remove(table: collections.Counter[int], hashes: Sequence[int]) -> None:
    table.subtract(hashes)
    for h in hashes:
        if table[h] <= 0:
            del table[h]


class SentPrefixes:
    """One replica's prompts in flight and answered-not-yet-confirmed, by block hash."""

    def __init__(self, options: MemoryOptions | None = None) -> None:
        self.options = options or MemoryOptions()
        self.in_flight: collections.Counter[int] = collections.Counter()
        self.answered: collections.Counter[int] = collections.Counter()
        self._answered: collections.deque[_Answered] = collections.deque()  # oldest first
        self._num_answered_blocks = 0

    def fly(self, hashes: Sequence[int]) -> None:
        self.in_flight.update(hashes)

    def land(self, hashes: Sequence[int], done: bool, now: float) -> None:
        """A prompt in flight ended; ``done``: answered (its blocks are now cached there)."""
        _remove(self.in_flight, hashes)
        if not done or not hashes or self.options.memory_s <= 0:
            return
        if len(hashes) > self.options.memory_blocks:
            return
        self._answered.append(_Answered(tuple(hashes), now))
        self.answered.update(hashes)
        self._num_answered_blocks += len(hashes)
        while self._num_answered_blocks > self.options.memory_blocks:
            self._forget(self._answered.popleft())

    def settle(self, now: float, confirmed: Callable[[Sequence[int]], bool] | None) -> None:
        """Forget answered prompts past ``memory_s`` and (a few a call, oldest first) those
        the events confirm (``confirmed(hashes)``: the index holds the whole prompt)."""
        horizon = now - self.options.memory_s
        while self._answered and self._answered[0].at < horizon:
            self._forget(self._answered.popleft())
        if confirmed is None:
            return
        for entry in list(itertools.islice(self._answered, SETTLE_CHECKS)):
            if confirmed(entry.hashes):
                self._answered.remove(entry)
                self._forget(entry)

    def _forget(self, entry: _Answered) -> None:
        _remove(self.answered, entry.hashes)
        self._num_answered_blocks -= len(entry.hashes)

    def in_flight_blocks(self, hashes: Sequence[int], limit: int) -> int:
        return _depth(self.in_flight, hashes, limit) if self.in_flight else 0

    def answered_blocks(self, hashes: Sequence[int], limit: int) -> int:
        return _depth(self.answered, hashes, limit) if self.answered else 0

    @property
    def num_answered(self) -> int:
        """Answered prompts remembered (not yet confirmed nor past ``memory_s``)."""
        return len(self._answered)
