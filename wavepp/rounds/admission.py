"""The admission round (DESIGN §4), one round serving every offered request.

Each step is a pure function of one stage's ``StageCache``; :func:`run_round` strings
them together with four small collectives on the rounds plane, the same on every rank::

    probe        -> MIN   common candidate point p per request
    lease(p)     -> MIN   h: the lowest point any stage could actually protect
    mask(h)      -> AND   the largest point ≤ h every stage serves exactly (snapshots)
    reconcile + escrow -> MIN   admitted iff every stage escrowed; FCFS cut

Points never rise from one step to the next, and every stage ends on the same point
without further rounds (see ``wavepp.state.probe.reuse_mask``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import attrs

from wavepp.rounds.plane import RoundsPlane
from wavepp.state import (
    BlockHash,
    RequestId,
    StageCache,
    block_table,
    cancel,
    escrow,
    lease,
    materialize,
    num_blocks_for,
    point_from_mask,
    probe,
    probe_linear,
    reconcile,
    reuse_mask,
)


@attrs.frozen
class Offer:
    """A request offered to a round, as every rank sees it."""

    request_id: RequestId
    num_tokens: int
    hashes: tuple[BlockHash, ...]  # full blocks of the prompt
    probe_limit: int  # reuse point cap in blocks, so that ≥ 1 token is computed


@attrs.frozen
class Policy:
    """How a rung reserves (DESIGN §8)."""

    block_size: int
    linear_probe: bool = False  # R1: walk block by block instead of gallop + bisect
    eager: bool = False  # R1/R2: allocate and evict at admission, not at first execution
    probe_fn: Callable[[StageCache, Sequence[BlockHash], int | None], int] | None = None
    #  a researcher's own hint probe (same signature as wavepp.state.probe), or None


def blocks_needed(offer: Offer, block_size: int) -> int:
    return num_blocks_for(offer.num_tokens, block_size)


def probe_points(
    cache: StageCache, offers: Sequence[Offer], policy: Policy, timings: list[float] | None = None
) -> list[int]:
    walk = policy.probe_fn or (probe_linear if policy.linear_probe else probe)
    points = []
    for offer in offers:
        t0 = time.perf_counter_ns()
        points.append(walk(cache, offer.hashes, offer.probe_limit))
        if timings is not None:
            timings.append((time.perf_counter_ns() - t0) / 1e3)
    return points


def lease_all(
    cache: StageCache, offers: Sequence[Offer], points: Sequence[int]
) -> tuple[StageCache, list[int]]:
    held = []
    for offer, point in zip(offers, points, strict=True):
        cache, got = lease(cache, offer.request_id, offer.hashes, point)
        held.append(got)
    return cache, held


def serve_masks(
    cache: StageCache, offers: Sequence[Offer], bases: Sequence[int], held: Sequence[int]
) -> list[int]:
    return [reuse_mask(cache, o.hashes, b, h) for o, b, h in zip(offers, bases, held, strict=True)]


def settle(
    cache: StageCache, offers: Sequence[Offer], agreed: Sequence[int], block_size: int
) -> tuple[StageCache, list[int]]:
    """Roll back to the agreed points and escrow each suffix, in FCFS order; 1 where the
    escrow held.

    Every offer of the round holds a lease by now. If a request's escrow fails only
    because later offers' leases protect blocks it could otherwise evict, those later
    offers give their leases up here (and report 0): nobody overtakes the head.
    """
    ok: list[int] = []
    for i, (offer, point) in enumerate(zip(offers, agreed, strict=True)):
        if offer.request_id not in cache.claims:  # gave its lease up for an earlier offer
            ok.append(0)
            continue
        cache, got = reconcile(cache, offer.request_id, offer.hashes, point)
        if got != point:
            raise AssertionError(f"stage cannot serve agreed point {point} of {offer.request_id}")
        need = blocks_needed(offer, block_size) - point
        cache, fits = escrow(cache, offer.request_id, need)
        if not fits:
            for later in offers[i + 1 :]:
                cache = cancel(cache, later.request_id)
            cache, fits = escrow(cache, offer.request_id, need)
        ok.append(1 if fits else 0)
    return cache, ok


def fcfs_cut(flags: Sequence[int]) -> list[bool]:
    """Admit the longest all-successful prefix: nobody overtakes a refused request."""
    admitted, blocked = [], False
    for flag in flags:
        blocked = blocked or not flag
        admitted.append(not blocked)
    return admitted


def commit(
    cache: StageCache, offers: Sequence[Offer], admitted: Sequence[bool], policy: Policy
) -> tuple[StageCache, list[BlockHash]]:
    """Release the refused; for eager rungs, allocate the admitted now."""
    evicted: list[BlockHash] = []
    for offer, ok in zip(offers, admitted, strict=True):
        if not ok:
            cache = cancel(cache, offer.request_id)  # it may have given its lease up already
        elif policy.eager:
            cache, done = materialize(cache, offer.request_id)
            block_table(cache, offer.request_id)  # eager rungs build tables up front
            evicted.extend(done.evicted)
    return cache, evicted


@attrs.frozen
class RoundResult:
    admitted: tuple[bool, ...]
    points: tuple[int, ...]  # agreed reuse points in blocks (meaningful where admitted)
    evicted: tuple[BlockHash, ...]
    seconds: float


class StageBook:
    """A rank's mutable holder of its stage cache, shared by its WAVE and LOOP tasks.

    Both tasks run on one event loop and swap ``cache`` between awaits, so readers see
    whole values only.
    """

    def __init__(self, cache: StageCache) -> None:
        self.cache = cache
        self.probe_us: list[float] = []


async def run_round(
    plane: RoundsPlane, book: StageBook, offers: Sequence[Offer], policy: Policy
) -> RoundResult:
    """One admission round over ``offers``; every rank calls it with the same offers."""
    t0 = time.perf_counter()
    points = probe_points(book.cache, offers, policy, book.probe_us)
    points = await plane.all_min(points)
    book.cache, held = lease_all(book.cache, offers, points)
    bases = await plane.all_min(held)
    masks = serve_masks(book.cache, offers, bases, held)
    masks = await plane.all_and(masks)
    agreed = [point_from_mask(b, m) or 0 for b, m in zip(bases, masks, strict=True)]
    book.cache, ok = settle(book.cache, offers, agreed, policy.block_size)
    flags = await plane.all_min(ok)
    admitted = fcfs_cut(flags)
    book.cache, evicted = commit(book.cache, offers, admitted, policy)
    return RoundResult(tuple(admitted), tuple(agreed), tuple(evicted), time.perf_counter() - t0)
