"""In-flight prefix sharing: which waiting request waits for whose blocks (DESIGN §4b).

A request whose leading blocks are being computed by a *producer* — a request already
admitted (or offered earlier in the same round) and not ended — is not offered to a
round until the producer's chunk covering those blocks has completed on every stage;
the round then finds them cached like any others. This module is the bookkeeping, a
value like the stage cache: pure functions return a new :class:`InFlight`.

Rules the functions keep (``check`` verifies them; the property suite drives them):

- **no cycle**: a waiter is never a producer and a producer never waits, so every wait
  is one edge from a queued request to a live producer;
- **no dangling wait**: ending a producer (done, cancelled, failed, refused) drops every
  wait on it, so its waiters fall back to computing the prefix themselves;
- **bounded**: every wait carries a deadline (the caller's estimate of what recomputing
  the shared blocks would cost); after it the waiter may go — unless the producer's
  chunk covering the shared blocks is already in the pipeline: waves run in order on
  every stage, so that chunk leaves the last stage before anything planned now could,
  and waiting for it is never slower than recomputing;
- **balanced**: once every request has ended, nothing is left.

Blocks are chained hashes, so "block k-1 of the waiter is held by producer X" means the
waiter shares X's whole prefix of k blocks; ``holders`` is therefore prefix-closed
along every chain and :func:`shared_prefix` finds k by gallop + bisect.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import immutables

from wavepp.state.errors import InvariantError
from wavepp.state.ids import BlockHash, RequestId
from wavepp.state.probe import longest_prefix

__all__ = [
    "InFlight",
    "Producer",
    "Wait",
    "add_producer",
    "can_go",
    "check",
    "deadline",
    "empty_inflight",
    "end",
    "extend",
    "junctions",
    "progress",
    "sent",
    "shared_prefix",
    "start_wait",
    "stop_wait",
]


@attrs.frozen
class Producer:
    """A request whose blocks other requests may wait for."""

    hashes: tuple[BlockHash, ...]  # its full blocks, in chain order
    done: int  # blocks 0..done-1 are published on every stage (its lease point at
    #            admission, then the end of each chunk that left the last stage; while
    #            only offered, rank 0's estimate of what is published: see add_producer)
    admitted: bool  # False while it is only offered to the round under way
    sent: int = 0  # blocks 0..sent-1 are published or in chunks sent into the pipeline


@attrs.frozen
class Wait:
    """A queued request waiting for a producer's blocks."""

    producer: RequestId
    point: int  # blocks it shares with the producer; it may go once producer.done ≥ point
    deadline: float  # clock value after which it goes anyway (recomputing costs no more)


@attrs.frozen
class InFlight:
    producers: immutables.Map[RequestId, Producer]
    holders: immutables.Map[BlockHash, tuple[RequestId, ...]]  # block -> live producers
    #                                     holding it, oldest first (prefix-closed per chain)
    waits: immutables.Map[RequestId, Wait]  # waiter -> what it waits for


def empty_inflight() -> InFlight:
    return InFlight(immutables.Map(), immutables.Map(), immutables.Map())


def add_producer(
    fl: InFlight, rid: RequestId, hashes: Sequence[BlockHash], done: int = 0, admitted: bool = True
) -> InFlight:
    """``rid`` computes ``hashes[done:]`` (it was offered or admitted).

    An offer's ``done`` is rank 0's estimate of its blocks already published everywhere
    (cached there, and computed by no live producer), so that siblings offered after it
    in the same round do not wait for blocks nobody computes. Admitting an offer replaces
    the estimate with the agreed point; an admitted producer's done only rises."""
    if rid in fl.waits:
        raise InvariantError(f"{rid!r} waits for {fl.waits[rid].producer!r}; it cannot produce")
    old = fl.producers.get(rid)
    if old is not None:
        if old.admitted:
            top = max(old.done, done)
            new = Producer(old.hashes, top, True, max(old.sent, top))
        else:
            new = Producer(old.hashes, done, admitted, done)
        return attrs.evolve(fl, producers=fl.producers.set(rid, new))
    hashes = tuple(hashes)
    with fl.holders.mutate() as holders:
        for block in hashes:
            holders[block] = (*holders.get(block, ()), rid)
        holders = holders.finish()
    producers = fl.producers.set(rid, Producer(hashes, done, admitted, done))
    return attrs.evolve(fl, producers=producers, holders=holders)


def progress(fl: InFlight, rid: RequestId, done: int) -> InFlight:
    """Blocks 0..done-1 of producer ``rid`` are now published on every stage."""
    old = fl.producers.get(rid)
    if old is None or done <= old.done:
        return fl
    done = min(done, len(old.hashes))
    new = Producer(old.hashes, done, old.admitted, max(old.sent, done))
    return attrs.evolve(fl, producers=fl.producers.set(rid, new))


def sent(fl: InFlight, rid: RequestId, upto: int) -> InFlight:
    """A chunk of producer ``rid`` covering blocks up to ``upto`` entered the pipeline."""
    old = fl.producers.get(rid)
    if old is None or upto <= old.sent:
        return fl
    new = attrs.evolve(old, sent=min(upto, len(old.hashes)))
    return attrs.evolve(fl, producers=fl.producers.set(rid, new))


def end(fl: InFlight, rid: RequestId) -> InFlight:
    """``rid`` left: as a producer (finished, cancelled, failed, refused by a round) its
    waiters are released; as a waiter its wait is dropped. Unknown ids are a no-op."""
    waits = fl.waits.delete(rid) if rid in fl.waits else fl.waits
    producer = fl.producers.get(rid)
    if producer is None:
        return attrs.evolve(fl, waits=waits) if waits is not fl.waits else fl
    with fl.holders.mutate() as holders:
        for block in producer.hashes:
            left = tuple(r for r in holders.get(block, ()) if r != rid)
            if left:
                holders[block] = left
            elif block in holders:
                del holders[block]
        holders = holders.finish()
    with waits.mutate() as edit:
        for waiter, wait in waits.items():
            if wait.producer == rid:
                del edit[waiter]
        waits = edit.finish()
    return InFlight(fl.producers.delete(rid), holders, waits)


def shared_prefix(
    fl: InFlight, hashes: Sequence[BlockHash], limit: int | None = None
) -> tuple[RequestId | None, int]:
    """The longest k ≤ limit with blocks 0..k-1 held by a live producer, and the holder
    of block k-1 that has published most of it; ``(None, 0)`` when none holds block 0."""
    holders = fl.holders
    lo = longest_prefix(holders, hashes, limit)
    if lo == 0:
        return None, 0
    best = max(holders[hashes[lo - 1]], key=lambda r: fl.producers[r].done)
    return best, lo


def start_wait(fl: InFlight, waiter: RequestId, producer: RequestId, point: int,
               deadline: float) -> InFlight:  # fmt: skip
    """``waiter`` (queued, not a producer) waits for ``producer``'s first ``point`` blocks."""
    if waiter in fl.producers:
        raise InvariantError(f"{waiter!r} is a producer; waiting would risk a cycle")
    if producer not in fl.producers:
        raise InvariantError(f"{waiter!r} cannot wait for {producer!r}: not a live producer")
    if waiter in fl.waits:
        raise InvariantError(f"{waiter!r} already waits for {fl.waits[waiter].producer!r}")
    return attrs.evolve(fl, waits=fl.waits.set(waiter, Wait(producer, point, deadline)))


def extend(fl: InFlight, waiter: RequestId, deadline: float) -> InFlight:
    """Move ``waiter``'s deadline later (a better estimate of recomputing); never earlier."""
    wait = fl.waits.get(waiter)
    if wait is None or deadline <= wait.deadline:
        return fl
    return attrs.evolve(fl, waits=fl.waits.set(waiter, attrs.evolve(wait, deadline=deadline)))


def stop_wait(fl: InFlight, waiter: RequestId) -> InFlight:
    return attrs.evolve(fl, waits=fl.waits.delete(waiter)) if waiter in fl.waits else fl


def can_go(fl: InFlight, waiter: RequestId, now: float) -> bool:
    """Whether ``waiter`` may be offered: no wait, its blocks are published everywhere,
    its producer is gone, or its deadline passed before the covering chunk was sent."""
    wait = fl.waits.get(waiter)
    if wait is None:
        return True
    producer = fl.producers.get(wait.producer)
    if producer is None or producer.done >= wait.point:
        return True
    return producer.sent < wait.point and now >= wait.deadline


def deadline(fl: InFlight, waiter: RequestId) -> float | None:
    """When ``waiter`` may go whatever its producer does, or None: no wait, or the
    covering chunk is in the pipeline (it goes when that chunk comes back)."""
    wait = fl.waits.get(waiter)
    if wait is None:
        return None
    producer = fl.producers.get(wait.producer)
    if producer is None or producer.sent >= wait.point:
        return None
    return wait.deadline


def junctions(fl: InFlight, producer: RequestId, lo: int, hi: int) -> tuple[int, ...]:
    """Points in ``[lo, hi]`` where requests waiting for ``producer`` leave its path:
    a hybrid stage saves a snapshot there so they can resume from it."""
    points = {w.point for w in fl.waits.values() if w.producer == producer and lo <= w.point <= hi}
    return tuple(sorted(points))


def check(fl: InFlight) -> None:
    """Raise :class:`InvariantError` unless the value keeps the module's rules."""
    for waiter, wait in fl.waits.items():
        if waiter in fl.producers:
            raise InvariantError(f"cycle risk: {waiter!r} both waits and produces")
        if wait.producer not in fl.producers:
            raise InvariantError(f"{waiter!r} waits for {wait.producer!r}, which has ended")
        if wait.point > len(fl.producers[wait.producer].hashes):
            raise InvariantError(f"{waiter!r} waits for blocks {wait.producer!r} never computes")
    expected: dict[BlockHash, list[RequestId]] = {}
    for rid, producer in fl.producers.items():
        if not 0 <= producer.done <= producer.sent <= len(producer.hashes):
            raise InvariantError(f"{rid!r}: done {producer.done}, sent {producer.sent} of "
                                 f"{len(producer.hashes)}")  # fmt: skip
        for block in producer.hashes:
            expected.setdefault(block, []).append(rid)
    if {b: set(r) for b, r in expected.items()} != {b: set(r) for b, r in fl.holders.items()}:
        raise InvariantError("holders index does not match the producers' blocks")
