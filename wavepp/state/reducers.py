"""The admission reducers (DESIGN §4). Each is a pure function of a ``StageCache``.

Life of a request on one stage::

    lease -> [reconcile ...] -> escrow -> materialize -> [reserve_snapshots] -> publish ...
          -> release                      any time: cancel

None of them mutates its input; each returns a new value (and, where the runtime must
act on it, a small effect record). Costs are per call, not per block, except where
blocks really enter or leave the index (publish, eviction).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from wavepp.state._txn import _Txn
from wavepp.state.cache import Claim, Snapshot, StageCache
from wavepp.state.errors import StateError, UnknownRequest
from wavepp.state.guarantees import Guarantee, guarantees
from wavepp.state.ids import ROOT, BlockHash, RequestId, SlotId
from wavepp.state.probe import attention_hit, snapshot_floor


@attrs.frozen
class Materialized:
    """What materialization did; the executor writes the suffix KV into ``slots``."""

    slots: tuple[SlotId, ...]  # new slots for the request, in block order
    evicted: tuple[BlockHash, ...]  # blocks (and their snapshots) dropped to make room


@attrs.frozen
class SnapshotReservation:
    """Snapshot-pool slots reserved for one chunk; the executor saves the recurrent state
    after ``points[i]`` blocks into ``slots[i]``. Points that got no slot are left out."""

    points: tuple[int, ...]  # block counts k, ascending
    slots: tuple[SlotId, ...]  # snapshot-pool slot for each point, same order


def _claim(cache: StageCache, request_id: RequestId) -> Claim:
    claim = cache.claims.get(request_id)
    if claim is None:
        raise UnknownRequest(f"stage holds nothing for request {request_id!r}")
    return claim


def can_ever_fit(cache: StageCache, num_blocks: int) -> bool:
    """Whether a prompt of ``num_blocks`` blocks could ever run on this stage."""
    return num_blocks <= cache.capacity


def lease(
    cache: StageCache, request_id: RequestId, hashes: Sequence[BlockHash], point: int
) -> tuple[StageCache, int]:
    """Protect blocks ``0..actual-1`` of the request's chain; returns ``actual ≤ point``.

    ``actual`` is lower than ``point`` when blocks were evicted since the probe, when
    protecting them would leave current escrows unbacked, or (recurrent stages) when
    no snapshot sits at the lower point. Costs one pin, whatever the prefix length.
    """
    if request_id in cache.claims:
        raise StateError(f"request {request_id!r} already holds a lease on this stage")
    if not 0 <= point <= len(hashes):
        raise StateError(f"lease point {point} outside the prompt's 0..{len(hashes)} blocks")
    actual = attention_hit(cache, hashes, point)
    txn = _Txn(cache)
    already = txn.protected_prefix(hashes, actual)
    actual = min(actual, already + cache.num_backable)  # never unback an escrow
    if cache.has_recurrent:
        actual = snapshot_floor(cache, hashes, actual)
    tip, tip_len = txn.locate(hashes, actual)
    if tip_len:
        txn.add_pin(tip, tip_len)
        txn.touch(tip)
    resume = _resume_block(cache, hashes, actual)
    if resume is not None:
        txn.pin_snapshot(resume, +1)
    txn.claims[request_id] = Claim(
        point=actual,
        tip=tip,
        tip_len=tip_len,
        num_published=0,
        num_escrowed=0,
        pending_slots=(),
        resume=resume,
    )
    return txn.finish(), actual


def _resume_block(cache: StageCache, hashes: Sequence[BlockHash], point: int) -> BlockHash | None:
    """The snapshot a lease at ``point`` pins: recurrent stages, point > 0."""
    return hashes[point - 1] if cache.has_recurrent and point > 0 else None


@guarantees(Guarantee.RECONCILE_ONLY_FREES)
def reconcile(
    cache: StageCache, request_id: RequestId, hashes: Sequence[BlockHash], point: int
) -> tuple[StageCache, int]:
    """Roll a richer lease back to the common ``point``; returns the new lease point.

    Never raises a point: a stage leasing less than ``point`` keeps its lease. A
    recurrent stage lands on the last snapshot at or below ``point``, which may be
    lower still; the protocol then runs another MIN round (see ``agree``).
    """
    claim = _claim(cache, request_id)
    if claim.num_published or claim.num_escrowed or claim.pending_slots:
        raise StateError(
            f"request {request_id!r} is past admission (escrowed {claim.num_escrowed}, "
            f"published {claim.num_published}); only a bare lease can be reconciled"
        )
    if point >= claim.point:
        return cache, claim.point
    target = max(point, 0)
    if cache.has_recurrent:
        target = snapshot_floor(cache, hashes, target)
    txn = _Txn(cache)
    tip, tip_len = txn.locate(hashes, target)
    txn.move_hold(claim, tip, tip_len)
    resume = _resume_block(cache, hashes, target)
    if resume is not None:
        txn.pin_snapshot(resume, +1)
    if claim.resume is not None:
        txn.pin_snapshot(claim.resume, -1)
    txn.claims[request_id] = attrs.evolve(
        claim, point=target, tip=tip, tip_len=tip_len, resume=resume
    )
    return txn.finish(), target


def agree(points: Iterable[int]) -> int:
    """The common point of one consensus round: the MIN over every stage's point."""
    return min(points)


@guarantees(Guarantee.ESCROW_WITHIN_ROOM)
def escrow(cache: StageCache, request_id: RequestId, num_blocks: int) -> tuple[StageCache, bool]:
    """Reserve ``num_blocks`` for the suffix; no slot is taken and no victim chosen.

    Succeeds iff every escrow stays backed by free or evictable blocks, which is what
    makes :func:`materialize` of an admitted request unable to fail.
    """
    claim = _claim(cache, request_id)
    if num_blocks < 0:
        raise StateError(f"cannot escrow {num_blocks} blocks")
    if num_blocks > cache.num_backable:
        return cache, False
    txn = _Txn(cache)
    txn.claims[request_id] = attrs.evolve(claim, num_escrowed=claim.num_escrowed + num_blocks)
    txn.num_escrowed += num_blocks
    return txn.finish(), True


def materialize(
    cache: StageCache, request_id: RequestId, num_blocks: int | None = None
) -> tuple[StageCache, Materialized]:
    """Turn escrow into slots: free ones first, then LRU unprotected leaf tails."""
    claim = _claim(cache, request_id)
    count = claim.num_escrowed if num_blocks is None else num_blocks
    if not 0 <= count <= claim.num_escrowed:
        raise StateError(
            f"request {request_id!r} has {claim.num_escrowed} escrowed blocks; "
            f"cannot materialize {count}"
        )
    txn = _Txn(cache)
    slots = txn.take_free(count)
    evicted: list[BlockHash] = []
    if len(slots) < count:
        more, evicted = txn.evict(count - len(slots))
        # Victims come deepest block first; in ascending order a request reusing a
        # victim's run of slots holds it as one run again (a handoff reads it in place).
        slots.extend(sorted(more))
    txn.num_allocated += count
    txn.num_escrowed -= count
    txn.claims[request_id] = attrs.evolve(
        claim,
        num_escrowed=claim.num_escrowed - count,
        pending_slots=claim.pending_slots + tuple(slots),
    )
    return txn.finish(), Materialized(slots=tuple(slots), evicted=tuple(evicted))


def reserve_snapshots(
    cache: StageCache, request_id: RequestId, hashes: Sequence[BlockHash], points: Iterable[int]
) -> tuple[StageCache, SnapshotReservation]:
    """Reserve snapshot-pool slots for the block counts a chunk will save a snapshot at.

    Call it right before running the chunk. Free slots first, else the least recently
    used snapshot that no claim pins; a point with no slot left is skipped (snapshots
    only cost reuse), and so is one whose snapshot is already cached or reserved.
    :func:`publish` records the reserved snapshots with their slots.
    """
    claim = _claim(cache, request_id)
    wanted = sorted(set(points))
    held = claim.held()
    if wanted and not (max(held, 1) <= wanted[0] and wanted[-1] <= len(hashes)):
        raise StateError(
            f"snapshot points {wanted} of request {request_id!r} outside its blocks "
            f"[{max(held, 1)}, {len(hashes)}] (k = {held}: the state a chunk resumes from)"
        )
    reserved = {k for k, _ in claim.pending_snapshots}
    wanted = [k for k in wanted if k not in reserved and hashes[k - 1] not in cache.snapshots]
    if not wanted:
        return cache, SnapshotReservation((), ())
    txn = _Txn(cache)
    got: list[tuple[int, SlotId]] = []
    for k in wanted:
        slot = txn.take_snapshot_slot()
        if slot is None:
            break  # every slot holds a pinned or reserved snapshot
        got.append((k, slot))
    if not got:
        return cache, SnapshotReservation((), ())
    txn.num_snapshot_pending += len(got)
    txn.claims[request_id] = attrs.evolve(
        claim, pending_snapshots=tuple(sorted(claim.pending_snapshots + tuple(got)))
    )
    return txn.finish(), SnapshotReservation(
        tuple(k for k, _ in got), tuple(slot for _, slot in got)
    )


def resume_slot(cache: StageCache, hashes: Sequence[BlockHash], point: int) -> SlotId | None:
    """The snapshot-pool slot of the snapshot after ``point`` blocks, or None."""
    if point <= 0:
        return None
    snap = cache.snapshots.get(hashes[point - 1])
    return None if snap is None else snap.slot


def publish(
    cache: StageCache,
    request_id: RequestId,
    hashes: Sequence[BlockHash],
    end: int,
    snapshot_points: Iterable[int] = (),
) -> StageCache:
    """Computed blocks ``held..end-1`` enter the cache, referenced by the request.

    They take the request's first pending slots. A block that another request has
    cached meanwhile is shared instead and the request's slot goes back to the pool.
    The snapshots reserved for points in ``(held, end]`` (:func:`reserve_snapshots`)
    enter the cache with their slots; ``snapshot_points`` may name more points in that
    range, which are reserved here (the form of callers that do not reserve first).
    A snapshot already cached for the same block wins and the new slot goes back.
    """
    claim = _claim(cache, request_id)
    start = claim.held()
    count = end - start
    if not start <= end <= len(hashes):
        raise StateError(
            f"request {request_id!r} holds {start} blocks; cannot publish up to {end} "
            f"of its {len(hashes)} full blocks"
        )
    if count > len(claim.pending_slots):
        raise StateError(
            f"publishing {count} blocks of request {request_id!r} needs {count} "
            f"materialized slots; it has {len(claim.pending_slots)}"
        )
    points = sorted(set(snapshot_points))
    if points and not (max(start, 1) <= points[0] and points[-1] <= end):
        raise StateError(
            f"snapshot points {points} outside the published range [{max(start, 1)}, {end}]"
        )
    if count == 0:
        return _record_snapshots(cache, request_id, hashes, end)
    if points:
        cache, _ = reserve_snapshots(cache, request_id, hashes, points)
        claim = cache.claims[request_id]
    txn = _Txn(cache)
    present = max(start, attention_hit(cache, hashes, end))  # shared by another request
    tip, tip_len = txn.locate(hashes, present) if present > start else (claim.tip, claim.tip_len)
    slots = claim.pending_slots[:count]
    txn.give_free(slots[: present - start])
    if present < end:
        tip = txn.insert_after(tip, tip_len, present, hashes[present:end], slots[present - start :])
        tip_len = end - txn.node(tip).depth
    txn.move_hold(claim, tip, tip_len)
    txn.touch(tip)
    txn.num_allocated -= count
    done = _put_snapshots(txn, claim, hashes, end)
    txn.claims[request_id] = attrs.evolve(
        claim,
        tip=tip,
        tip_len=tip_len,
        num_published=claim.num_published + count,
        pending_slots=claim.pending_slots[count:],
        pending_snapshots=claim.pending_snapshots[done:],
    )
    return txn.finish()


def _put_snapshots(txn: _Txn, claim: Claim, hashes: Sequence[BlockHash], end: int) -> int:
    """Record the claim's reserved snapshots at points ≤ end; returns how many."""
    done = [(k, slot) for k, slot in claim.pending_snapshots if k <= end]
    for k, slot in done:
        block = hashes[k - 1]
        if block in txn.snapshots:
            txn.give_snapshot_slots([slot])  # cached meanwhile: keep the older copy
        else:
            txn.put_snapshot(block, Snapshot(k=k, slot=slot, recency=txn.clock, pins=0))
    txn.num_snapshot_pending -= len(done)
    return len(done)


def _record_snapshots(
    cache: StageCache, request_id: RequestId, hashes: Sequence[BlockHash], end: int
) -> StageCache:
    """A chunk that published no block (a partial tail) may still leave a snapshot."""
    claim = cache.claims[request_id]
    if not any(k <= end for k, _ in claim.pending_snapshots):
        return cache
    txn = _Txn(cache)
    done = _put_snapshots(txn, claim, hashes, end)
    txn.claims[request_id] = attrs.evolve(claim, pending_snapshots=claim.pending_snapshots[done:])
    return txn.finish()


def release(cache: StageCache, request_id: RequestId) -> StageCache:
    """The request is done here: drop its hold, escrow and unpublished slots.

    Its published blocks stay cached and become evictable once nobody holds them.
    """
    claim = _claim(cache, request_id)
    txn = _Txn(cache)
    if claim.tip_len:
        txn.touch(claim.tip)
        txn.remove_pin(claim.tip, claim.tip_len)
    txn.give_free(claim.pending_slots)
    txn.num_allocated -= len(claim.pending_slots)
    txn.num_escrowed -= claim.num_escrowed
    if claim.resume is not None:
        txn.pin_snapshot(claim.resume, -1)
    txn.give_snapshot_slots(slot for _, slot in claim.pending_snapshots)
    txn.num_snapshot_pending -= len(claim.pending_snapshots)
    del txn.claims[request_id]
    return txn.finish()


def cancel(cache: StageCache, request_id: RequestId) -> StageCache:
    """Like :func:`release`, at any point of a request's life, and a no-op if it held nothing."""
    if request_id not in cache.claims:
        return cache
    return release(cache, request_id)


def block_table(cache: StageCache, request_id: RequestId) -> tuple[SlotId, ...]:
    """Slots of the request's blocks in position order: held prefix, then pending."""
    claim = _claim(cache, request_id)
    pieces: list[tuple[SlotId, ...]] = [claim.pending_slots]
    node_id, keep = claim.tip, claim.tip_len
    while node_id != ROOT:
        node = cache.nodes[node_id]
        pieces.append(node.slots[:keep])
        node_id, keep = node.parent, node.attach  # type: ignore[assignment]
    out: tuple[SlotId, ...] = ()
    for piece in reversed(pieces):
        out += piece
    return out
