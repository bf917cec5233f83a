"""The admission round (DESIGN §4), one round serving every offered request.

Each step is a pure function of one stage's ``StageCache`` that calls the reducers only
through the policy in use (:class:`wavepp.policy.Policy`); :func:`run_round` strings
them together with one small collective on the rounds plane (two where the stages'
caches differ under memory pressure), the same on every rank::

    probe, lease(own probe), masks,   -> MIN + AND   per request: p (MIN of the probes),
    [settle at the guessed point]                   the highest probe, h (MIN of the
                                                    leases), the AND of the 63-bit masks of
                                                    the window ending at rank 0's probe
                                                    (sent with the round), and the guesses
                                                    with their escrow flags, in one
                                                    collective (``all_reduce``); the
                                                    window's highest common point is the
                                                    agreed one
    (where that window holds none)     -> AND       63-bit masks of the next windows down
                                                    from h, until one holds a common point
                                                    (point 0 is always served)
    reconcile + escrow, in the escrow order -> MIN  admitted iff every stage escrowed;
                                                    the order's cut (FCFS by default);
                                                    skipped where the first collective
                                                    showed every stage with room for every
                                                    offer's whole prompt (all hold), or
                                                    carried the flags already: every stage
                                                    short of room settled before it at the
                                                    point agreed (``wavepp.rounds.speculate``)

Each stage leases what it probed itself, so probe and lease need no collective between
them; the richer leases roll back to the agreed point before anything is escrowed.
Points never rise from one step to the next, and every stage ends on the same point:
the highest that every stage serves exactly at or below h (see
``wavepp.state.probe.reuse_mask``). The counters (:class:`RoundCounters`) come from the
same MIN, and so does each stage's spare room (:func:`spare_room`). :func:`round_over`
runs the same steps over several caches in one process (collectives as plain MIN/AND):
the oracle, the parity harness and the property suite use it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

import attrs

from wavepp.policy import DEFAULT, EscrowCandidate
from wavepp.policy import Policy as _Rules
from wavepp.rounds import speculate
from wavepp.rounds.errors import ProtocolError
from wavepp.rounds.plane import RoundsPlane
from wavepp.rounds.trace import NO_TRACE
from wavepp.state import (
    MASK_WIDTH,
    BlockHash,
    RequestId,
    StageCache,
    attention_hit,
    block_table,
    num_blocks_for,
    point_from_mask,
    reuse_mask,
)


@attrs.frozen
class Offer:
    """A request offered to a round, as every rank sees it."""

    request_id: RequestId
    num_tokens: int
    hashes: tuple[BlockHash, ...]  # full blocks of the prompt
    probe_limit: int  # reuse point cap in blocks, so that ≥ 1 token is computed
    handoff: str = ""  # where each stage sends its cache band when the request ends ("": none)


@attrs.frozen
class RoundMode:
    """How a rung reserves (DESIGN §8), and the policy whose reducers it calls."""

    block_size: int  # tokens per block
    eager: bool = False  # R1/R2: allocate and evict at admission, not at first execution
    policy: _Rules = DEFAULT  # every decision point; see wavepp.policy


def check_eviction(cache: StageCache, mode: RoundMode) -> None:
    """The victim order is the policy's (``Policy.eviction``); the cache carries it only
    because its victim index is sorted by it (``Policy.empty_cache`` builds it so). A
    cache built apart from the policy would evict in another order than the policy
    names, so a round refuses it."""
    if cache.eviction != mode.policy.eviction:
        raise ProtocolError(
            f"the stage cache evicts in order {cache.eviction.name!r} but policy "
            f"{mode.policy.name!r} names {mode.policy.eviction.name!r}; build the cache "
            "with Policy.empty_cache"
        )


def blocks_needed(offer: Offer, block_size: int) -> int:
    return num_blocks_for(offer.num_tokens, block_size)


def worth_offering(cache: StageCache, offers: Sequence[Offer], mode: RoundMode) -> int:
    """How many of ``offers`` (the queue's head, in arrival order) a round should take.

    Under FCFS (the default escrow order) nothing after a refused offer is admitted, and
    no stage can escrow more than its ``num_backable`` blocks; an offer needs at least its
    blocks beyond its attention hit here (the agreed point is at most this stage's hit).
    So the offers past the first one that cannot fit even then would be probed, leased,
    refused and released for nothing: that is most of a round's work when the pool is
    full and many requests wait. The first offer that cannot fit is still taken, so the
    round refuses it and admission waits for room. An escrow order that does not
    declare FCFS (:attr:`wavepp.policy.EscrowOrder.first_come_first_served`): every offer.
    """
    if not mode.policy.escrow_order.first_come_first_served:
        return len(offers)
    room = cache.num_backable
    for i, offer in enumerate(offers):
        hit = attention_hit(cache, offer.hashes, offer.probe_limit)
        room -= blocks_needed(offer, mode.block_size) - hit
        if room < 0:
            return i + 1
    return len(offers)


def probe_points(
    cache: StageCache, offers: Sequence[Offer], mode: RoundMode, timings: list[float] | None = None
) -> list[int]:
    walk = mode.policy.probe
    points = []
    for offer in offers:
        t0 = time.perf_counter_ns()
        point = walk(cache, offer.hashes, offer.probe_limit)
        if not 0 <= point <= offer.probe_limit:
            raise ProtocolError(
                f"probe {walk.__qualname__} returned point {point} for {offer.request_id!r}; "
                f"it must lie in 0..{offer.probe_limit}"
            )
        points.append(point)
        if timings is not None:
            timings.append((time.perf_counter_ns() - t0) / 1e3)
    return points


def lease_all(
    cache: StageCache, offers: Sequence[Offer], points: Sequence[int], mode: RoundMode | None = None
) -> tuple[StageCache, list[int]]:
    lease = (mode or RoundMode(1)).policy.lease
    held = []
    for offer, point in zip(offers, points, strict=True):
        cache, got = lease(cache, offer.request_id, offer.hashes, point)
        if got > point:
            raise ProtocolError(f"lease raised {offer.request_id!r}'s point {point} to {got}")
        held.append(got)
    return cache, held


def serve_masks(
    cache: StageCache, offers: Sequence[Offer], bases: Sequence[int], held: Sequence[int]
) -> list[int]:
    return [reuse_mask(cache, o.hashes, b, h) for o, b, h in zip(offers, bases, held, strict=True)]


def candidates(
    offers: Sequence[Offer],
    agreed: Sequence[int],
    block_size: int,
    refusals: dict[RequestId, int] | None = None,
) -> list[EscrowCandidate]:
    refusals = refusals or {}
    return [
        EscrowCandidate(
            request_id=offer.request_id,
            position=i,
            point=point,
            need=blocks_needed(offer, block_size) - point,
            waited=refusals.get(offer.request_id, 0),
        )
        for i, (offer, point) in enumerate(zip(offers, agreed, strict=True))
    ]


def attempt_order(mode: RoundMode, cands: Sequence[EscrowCandidate]) -> list[int]:
    """The escrow order's permutation, checked (every rank must compute the same one)."""
    order = [int(i) for i in mode.policy.escrow_order.order(cands)]
    if sorted(order) != list(range(len(cands))):
        raise ProtocolError(
            f"escrow order {mode.policy.escrow_order.name!r} returned {order} for "
            f"{len(cands)} offers; it must be a permutation of their indices"
        )
    return order


def settle(
    cache: StageCache,
    offers: Sequence[Offer],
    agreed: Sequence[int],
    mode: RoundMode | int,
    refusals: dict[RequestId, int] | None = None,
) -> tuple[StageCache, list[int]]:
    """Roll back to the agreed points and escrow each suffix, in the escrow order; 1
    where the escrow held (aligned with ``offers``).

    Every offer of the round holds a lease by now. If a blocking offer's escrow fails
    only because later offers' leases protect blocks it could otherwise evict, those
    later offers give their leases up here (and report 0): nobody overtakes it.
    """
    if isinstance(mode, int):  # the old signature passed the block size
        mode = RoundMode(mode)
    rules = mode.policy
    cands = candidates(offers, agreed, mode.block_size, refusals)
    order = attempt_order(mode, cands)
    ok = [0] * len(offers)
    for j, i in enumerate(order):
        offer, point = offers[i], agreed[i]
        if offer.request_id not in cache.claims:  # gave its lease up for an earlier offer
            continue
        cache, got = rules.reconcile(cache, offer.request_id, offer.hashes, point)
        if got != point:
            raise ProtocolError(
                f"stage cannot serve the agreed point {point} of {offer.request_id!r} "
                f"(reconcile gave {got})"
            )
        need = cands[i].need
        cache, fits = rules.escrow(cache, offer.request_id, need)
        if not fits and rules.escrow_order.blocks(cands[i]):
            for later in order[j + 1 :]:
                cache = rules.cancel(cache, offers[later].request_id)
            cache, fits = rules.escrow(cache, offer.request_id, need)
        ok[i] = 1 if fits else 0
    return cache, ok


def cut(flags: Sequence[int], mode: RoundMode, cands: Sequence[EscrowCandidate]) -> list[bool]:
    """Admit what escrowed on every stage, except what comes after a blocking refusal
    in the escrow order."""
    admitted = [False] * len(flags)
    blocked = False
    for i in attempt_order(mode, cands):
        if flags[i] and not blocked:
            admitted[i] = True
        elif not flags[i] and mode.policy.escrow_order.blocks(cands[i]):
            blocked = True
    return admitted


def fcfs_cut(flags: Sequence[int]) -> list[bool]:
    """Admit the longest all-successful prefix: nobody overtakes a refused request."""
    admitted, blocked = [], False
    for flag in flags:
        blocked = blocked or not flag
        admitted.append(not blocked)
    return admitted


def commit(
    cache: StageCache, offers: Sequence[Offer], admitted: Sequence[bool], mode: RoundMode
) -> tuple[StageCache, list[BlockHash]]:
    """Release the refused; for eager rungs, allocate the admitted now."""
    rules = mode.policy
    evicted: list[BlockHash] = []
    for offer, ok in zip(offers, admitted, strict=True):
        if not ok:
            cache = rules.cancel(cache, offer.request_id)  # it may have given its lease up
        elif mode.eager:
            cache, done = rules.materialize(cache, offer.request_id, None)
            block_table(cache, offer.request_id)  # eager rungs build tables up front
            evicted.extend(done.evicted)
    return cache, evicted


def note_refusals(
    refusals: dict[RequestId, int], offers: Sequence[Offer], admitted: Sequence[bool]
) -> dict[RequestId, int]:
    """Rounds each offer of this round has been refused, for the next round's order.

    Every rank sees the same offers and results, so every rank keeps the same counts.
    A request not offered again (admitted or cancelled) is forgotten.
    """
    return {
        o.request_id: refusals.get(o.request_id, 0) + 1
        for o, ok in zip(offers, admitted, strict=True)
        if not ok
    }


@attrs.frozen
class RoundCounters:
    """How far a round's agreement fell below the stages' own hits, counted over the
    requests it admitted (each request is counted once: in the round that admits it)."""

    disagreements: int = 0  # agreed point below some stage's local reuse point
    rollbacks: int = 0  # the lowest actual lease below the MIN of the probes
    fallbacks: int = 0  # the mask AND found no common point in its first window

    def __add__(self, other: RoundCounters) -> RoundCounters:
        return RoundCounters(self.disagreements + other.disagreements,
                             self.rollbacks + other.rollbacks,
                             self.fallbacks + other.fallbacks)  # fmt: skip

    def to_json(self) -> dict[str, int]:
        return attrs.asdict(self)


def count_round(
    admitted: Sequence[bool], highest: Sequence[int], points: Sequence[int],
    bases: Sequence[int], agreed: Sequence[int], fell_back: Sequence[bool],
) -> RoundCounters:  # fmt: skip
    """The counters of one round: ``highest`` the highest local hit of each offer over
    the stages, ``points`` the MIN of the hits, ``bases`` the MIN of the leases."""
    rows = [i for i, ok in enumerate(admitted) if ok]
    return RoundCounters(
        disagreements=sum(1 for i in rows if agreed[i] < highest[i]),
        rollbacks=sum(1 for i in rows if bases[i] < points[i]),
        fallbacks=sum(1 for i in rows if fell_back[i]),
    )


def first_agreement(bases: Sequence[int], masks: Sequence[int]) -> list[int | None]:
    """The agreed point of each offer from its AND-ed mask over ``bases[i] - 0 ..
    bases[i] - MASK_WIDTH + 1``, or None where that window holds no common point."""
    return [point_from_mask(b, m) for b, m in zip(bases, masks, strict=True)]


def lower_windows(windows: Sequence[int], agreed: Sequence[int | None]) -> list[int]:
    """The offers still without a point, whose windows move one width down.

    A window that reaches 0 always holds a point (every stage serves 0), so a window
    is lowered only while it starts at or above ``MASK_WIDTH`` and this ends."""
    todo = [i for i, p in enumerate(agreed) if p is None]
    for i in todo:
        if windows[i] < MASK_WIDTH:
            raise ProtocolError(f"mask window at {windows[i]} has no common point, yet "
                                "every stage serves point 0")  # fmt: skip
    return todo


def window_tops(offers: Sequence[Offer], anchors: Sequence[int] | None) -> list[int]:
    """Where each offer's first mask window ends: rank 0's own probe point, sent with the
    round (checked against the offer: it comes from a peer), else the probe limit."""
    if anchors is None:
        return [o.probe_limit for o in offers]
    if len(anchors) != len(offers):
        raise ProtocolError(f"round has {len(offers)} offers but {len(anchors)} anchors")
    for offer, top in zip(offers, anchors, strict=True):
        if not 0 <= top <= offer.probe_limit:
            raise ProtocolError(f"anchor {top} of {offer.request_id!r} outside "
                                f"0..{offer.probe_limit}")  # fmt: skip
    return [int(a) for a in anchors]


def window_points(
    tops: Sequence[int], bases: Sequence[int], masks: Sequence[int]
) -> list[int | None]:
    """Each offer's agreed point where its first window settles it, from its mask at
    ``tops[i]`` AND-ed over the stages (bit j: served at ``tops[i] - j``): the highest
    point there that every stage serves (no stage sets a bit above its own lease, so it
    is at or below ``bases[i]``, the lowest lease). None where the window holds no
    common point, or ends below the lowest lease (rank 0's probe moved between the
    broadcast and the round: points above the window were not looked at)."""
    return [point_from_mask(top, mask) if base <= top else None
            for top, base, mask in zip(tops, bases, masks, strict=True)]  # fmt: skip


def next_windows(
    tops: Sequence[int], bases: Sequence[int], found: Sequence[int | None]
) -> dict[int, int]:
    """Where the AND rounds start for the offers the first window left without a point:
    just below that window and at or below the lowest lease."""
    return {
        i: base if base > top else min(base, top - MASK_WIDTH)
        for i, (top, base, point) in enumerate(zip(tops, bases, found, strict=True))
        if point is None
    }


def fell_back(bases: Sequence[int], agreed: Sequence[int]) -> list[bool]:
    """Whether the window of ``MASK_WIDTH`` points at the lowest lease held no common
    point (the round's *fallbacks*)."""
    return [b - a >= MASK_WIDTH for b, a in zip(bases, agreed, strict=True)]


def spare_room(cache: StageCache, offers: Sequence[Offer], mode: RoundMode) -> int:
    """Blocks this stage could still back after escrowing every offer's whole prompt
    (as if nothing were reused), with this round's leases held; -1 where the policy's
    escrow and reconcile do not declare that this suffices
    (:attr:`wavepp.policy.Policy.escrow_within_room`).

    Where the MIN of this over the stages is ≥ 0, every escrow of the round holds on
    every stage: reconciling only lowers leases (frees protection) and each escrow
    needs at most its prompt's blocks. Then the escrow flags need no collective."""
    if not mode.policy.escrow_within_room:
        return -1
    return cache.num_backable - sum(blocks_needed(o, mode.block_size) for o in offers)


@attrs.frozen
class RoundResult:
    admitted: tuple[bool, ...]
    points: tuple[int, ...]  # agreed reuse points in blocks (meaningful where admitted)
    evicted: tuple[BlockHash, ...]
    seconds: float
    counters: RoundCounters = RoundCounters()  # of the admitted offers
    cpu_s: float = 0.0  # this rank's thread CPU in the round's own steps (not the waits)


class _WorkClock:
    """The round's own CPU time on this rank: thread time, paused while a collective is
    awaited (the event loop then runs other tasks, and the wait is the collective's)."""

    def __init__(self, plane: RoundsPlane) -> None:
        self.plane, self.cpu, self._mark = plane, 0.0, time.thread_time()

    async def _wait(self, pending):
        self.cpu += time.thread_time() - self._mark
        try:
            return await pending
        finally:
            self._mark = time.thread_time()

    async def all_min(self, values):
        return await self._wait(self.plane.all_min(values))

    async def all_and(self, values):
        return await self._wait(self.plane.all_and(values))

    async def all_reduce(self, mins, ands):
        return await self._wait(self.plane.all_reduce(mins, ands))

    def stop(self) -> float:
        return self.cpu + time.thread_time() - self._mark


class StageBook:
    """A rank's mutable holder of its stage cache, shared by its WAVE and LOOP tasks.

    Both tasks run on one event loop and swap ``cache`` between awaits, so readers see
    whole values only.
    """

    def __init__(self, cache: StageCache) -> None:
        self.cache = cache
        self.probe_us: deque[float] = deque(maxlen=4096)  # recent hint-probe latencies
        self.refusals: dict[RequestId, int] = {}  # rounds each waiting offer was refused


async def run_round(
    plane: RoundsPlane, book: StageBook, offers: Sequence[Offer], mode: RoundMode,
    anchors: Sequence[int] | None = None,
) -> RoundResult:  # fmt: skip
    """One admission round over ``offers``; every rank calls it with the same offers and
    ``anchors`` (rank 0's probe point of each offer, sent with the round: the first mask
    window ends there; None: at the probe limit, which only costs more AND rounds)."""
    t0 = time.perf_counter()
    trace = getattr(plane, "trace", NO_TRACE)  # a test's stand-in plane may have none
    trace.mark("start")
    check_eviction(book.cache, mode)
    plane = _WorkClock(plane)  # type: ignore[assignment]  # the collectives, timed apart
    n = len(offers)
    tops = window_tops(offers, anchors)
    local = probe_points(book.cache, offers, mode, book.probe_us)
    trace.mark("probed")
    book.cache, held = lease_all(book.cache, offers, local, mode)
    masks = serve_masks(book.cache, offers, tops, held)  # the first mask window's
    room = spare_room(book.cache, offers, mode)
    trace.mark("leased")

    def settle_at(cache: StageCache, at: Sequence[int]) -> tuple[StageCache, list[int]]:
        return settle(cache, offers, at, mode, book.refusals)

    fcfs = mode.policy.escrow_order.first_come_first_served
    mine = speculate.guess(book.cache, tops, held, room, fcfs, settle_at)
    trace.mark("guessed")
    # one collective: the probes' MIN and MAX, the leases' MIN, the spare room's MIN, the
    # guesses' MIN and MAX with their escrow flags, and the first windows' masks AND-ed
    got, masks = await plane.all_reduce(
        [*local, *(-p for p in local), *held, room, *mine.values()], masks
    )
    points, highest, bases = got[:n], [-p for p in got[n : 2 * n]], got[2 * n : 3 * n]
    room, guessed = got[3 * n], got[3 * n + 1 :]
    found = window_points(tops, bases, masks)
    windows = next_windows(tops, bases, found)
    while windows:  # the same on every rank: the masks are AND-ed
        todo = sorted(windows)
        sub = [offers[i] for i in todo]
        masks = serve_masks(book.cache, sub, [windows[i] for i in todo], [held[i] for i in todo])
        masks = await plane.all_and(masks)
        for i, m in zip(todo, masks, strict=True):
            found[i] = point_from_mask(windows[i], m)
        left = lower_windows([windows[i] for i in todo], [found[i] for i in todo])
        windows = {todo[j]: windows[todo[j]] - MASK_WIDTH for j in left}
    agreed = [int(p) for p in found if p is not None]
    trace.mark("min_done")
    flags = None if room >= 0 else speculate.flags_if_guessed(guessed, agreed)
    if flags is not None:  # every stage short of room settled at the agreed points
        ids = [o.request_id for o in offers]
        if mine.settled is None or book.cache is not mine.base:
            trace.mark("resettled")
        book.cache, ok = speculate.adopt(book.cache, mine, agreed, flags, settle_at, ids)
        trace.mark("settled")
    else:
        book.cache, ok = settle_at(book.cache, agreed)
        trace.mark("settled")
        if room >= 0:  # every stage had room for every offer: all escrows held everywhere
            if not all(ok):
                raise ProtocolError("an escrow failed on this stage although every stage "
                                    "had room for every offer's whole prompt")  # fmt: skip
            flags = ok
        else:
            flags = await plane.all_min(ok)
    trace.mark("flags_done")
    admitted = cut(flags, mode, candidates(offers, agreed, mode.block_size, book.refusals))
    book.cache, evicted = commit(book.cache, offers, admitted, mode)
    book.refusals = note_refusals(book.refusals, offers, admitted)
    counters = count_round(admitted, highest, points, bases, agreed, fell_back(bases, agreed))
    trace.mark("end")
    return RoundResult(tuple(admitted), tuple(agreed), tuple(evicted), time.perf_counter() - t0,
                       counters, plane.stop())  # fmt: skip


def round_over(
    caches: Sequence[StageCache],
    offers: Sequence[Offer],
    mode: RoundMode,
    refusals: dict[RequestId, int] | None = None,
    timings: list[float] | None = None,
) -> tuple[list[StageCache], RoundResult]:
    """:func:`run_round` over several stages' caches in one process (MIN and AND over
    a list): the oracle's free decisions, the parity harness, the property suite."""
    t0 = time.perf_counter()
    for cache in caches:
        check_eviction(cache, mode)
    caches = list(caches)
    n = len(offers)
    probed = [probe_points(c, offers, mode, timings) for c in caches]
    points = [min(p[i] for p in probed) for i in range(n)]
    highest = [max(p[i] for p in probed) for i in range(n)]
    held = []
    for s, cache in enumerate(caches):  # each stage leases what it probed
        caches[s], got = lease_all(cache, offers, probed[s], mode)
        held.append(got)
    bases = [min(h[i] for h in held) for i in range(n)]
    agreed, fell_back = agree_over(caches, offers, bases, held)
    flags = [1] * n
    for s, cache in enumerate(caches):
        caches[s], ok = settle(cache, offers, agreed, mode, refusals)
        flags = [min(f, o) for f, o in zip(flags, ok, strict=True)]
    admitted = cut(flags, mode, candidates(offers, agreed, mode.block_size, refusals))
    evicted: list[BlockHash] = []
    for s, cache in enumerate(caches):
        caches[s], gone = commit(cache, offers, admitted, mode)
        evicted.extend(gone)
    counters = count_round(admitted, highest, points, bases, agreed, fell_back)
    result = RoundResult(tuple(admitted), tuple(agreed), tuple(evicted), time.perf_counter() - t0,
                         counters)  # fmt: skip
    return caches, result


def _and_masks(
    caches: Sequence[StageCache], offers: Sequence[Offer], windows: Sequence[int],
    held: Sequence[Sequence[int]],
) -> list[int]:  # fmt: skip
    masks = [-1] * len(offers)
    for s, cache in enumerate(caches):
        for i, m in enumerate(serve_masks(cache, offers, windows, held[s])):
            masks[i] &= m
    return masks


def agree_over(
    caches: Sequence[StageCache], offers: Sequence[Offer], bases: Sequence[int],
    held: Sequence[Sequence[int]],
) -> tuple[list[int], list[bool]]:  # fmt: skip
    """The mask step of :func:`run_round` over several caches in one process: the
    largest point at or below ``bases[i]`` that every stage serves exactly, the window
    moving down by ``MASK_WIDTH`` while it holds none; and whether the first window
    held none (a fallback). ``held[s][i]``: stage s's lease of offer i."""
    found = first_agreement(bases, _and_masks(caches, offers, bases, held))
    fell_back = [p is None for p in found]
    windows = list(bases)
    while todo := lower_windows(windows, found):
        for i in todo:
            windows[i] -= MASK_WIDTH
        sub = [offers[i] for i in todo]
        masks = _and_masks(caches, sub, [windows[i] for i in todo],
                           [[h[i] for i in todo] for h in held])  # fmt: skip
        for i, m in zip(todo, masks, strict=True):
            found[i] = point_from_mask(windows[i], m)
    return [int(p) for p in found if p is not None], fell_back
