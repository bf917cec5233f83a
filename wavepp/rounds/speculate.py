"""Escrow flags that travel with the agreement: a round under memory pressure in one
collective instead of two (DESIGN §4, steps 2-4).

A round's escrow flags are needed only where some stage may lack room for the offers
(:func:`wavepp.rounds.admission.spare_room` < 0). Then, before the agreement's
collective, each such stage settles (reconciles and escrows, :func:`settle`) at its
*guess* of the agreed points — ``min(window top, its own lease)`` per offer, which is the
agreed point whenever the stages hold the same prefix — and sends, with its probes and
leases, its guesses and the flags it got. Stages with room for every offer's whole
prompt send a wildcard: every escrow holds there, wherever the point lands. After the
collective every rank sees the lowest and highest guess of each offer; where every
guess was the agreed point, the flags' MIN already travelled and the round needs no
second collective. Otherwise (the stages' caches differ, a guess could not be settled)
every rank settles again at the agreed points and the flags' MIN runs as before: the
same decisions, one collective later.

The round waits on the collective while the stage's LOOP task may change its cache
(materializations, publishes, releases). Where it did, the stage settles again at the
agreed points on the cache it has now; the LOOP only ever adds room, so under
first-come-first-served every offer whose flag held keeps its escrow
(:func:`adopt` checks it). Only escrow orders that declare first come, first served
speculate (:attr:`wavepp.policy.EscrowOrder.first_come_first_served`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from wavepp.rounds.errors import ProtocolError
from wavepp.state import RequestId, StageCache, StateError

WILDCARD = 1 << 62  # a guess the MIN passes over: this stage has room for everything
NO_GUESS = -1  # a guess that could not be settled: no agreed point equals it


@attrs.frozen
class Guess:
    """One stage's speculation: its guessed points, what settling there gave, and the
    cache it settled from."""

    points: tuple[int, ...]  # per offer; WILDCARD or NO_GUESS where it guessed nothing
    ok: tuple[int, ...]  # the escrow flags at those points (1 under a wildcard)
    base: StageCache | None = None  # the cache settled from (None: nothing settled)
    settled: StageCache | None = None  # and after settling

    def values(self) -> list[int]:
        """What it adds to the agreement's MIN: the guesses, their negations (the MIN of
        which is minus the highest guess) and the flags."""
        negated = [p if p == WILDCARD else -p for p in self.points]
        return [*self.points, *negated, *self.ok]


Settle = Callable[[StageCache, Sequence[int]], tuple[StageCache, list[int]]]


def guess(
    cache: StageCache, tops: Sequence[int], held: Sequence[int], room: int, fcfs: bool,
    settle: Settle,
) -> Guess:  # fmt: skip
    """This stage's guess for a round whose offers' windows end at ``tops``, with its
    own leases ``held`` and spare ``room``; ``settle(cache, points)`` as the round does."""
    n = len(held)
    if room >= 0:
        return Guess((WILDCARD,) * n, (1,) * n)
    if not fcfs:
        return Guess((NO_GUESS,) * n, (1,) * n)
    points = [min(t, h) for t, h in zip(tops, held, strict=True)]
    try:
        settled, ok = settle(cache, points)
    except (ProtocolError, StateError):  # this stage cannot serve its own guess
        return Guess((NO_GUESS,) * n, (1,) * n)
    return Guess(tuple(points), tuple(ok), cache, settled)


def flags_if_guessed(reduced: Sequence[int], agreed: Sequence[int]) -> list[int] | None:
    """The escrow flags' MIN from the agreement's collective (``reduced``: the MIN of
    :meth:`Guess.values` over the stages), if every stage short of room guessed every
    agreed point; else None."""
    n = len(agreed)
    lowest, negated, flags = reduced[:n], reduced[n : 2 * n], reduced[2 * n : 3 * n]
    for low, neg, point in zip(lowest, negated, agreed, strict=True):
        if low == WILDCARD:  # every stage had room for everything (not asked then)
            return None
        if not low == -neg == point:
            return None
    return list(flags)


def adopt(
    current: StageCache, mine: Guess, agreed: Sequence[int], flags: Sequence[int],
    settle: Settle, offers_ids: Sequence[RequestId],
) -> tuple[StageCache, list[int]]:  # fmt: skip
    """This stage's cache and flags once the guesses held: what it settled before the
    collective if its cache did not move meanwhile, else a settle at the agreed points on
    the cache it has now, which must keep every escrow the flags admit."""
    if mine.settled is not None and current is mine.base:
        return mine.settled, list(mine.ok)
    cache, ok = settle(current, agreed)
    for rid, flag, held in zip(offers_ids, flags, ok, strict=True):
        if flag and not held:
            raise ProtocolError(
                f"the escrow of {rid!r} held on every stage before the round's collective "
                "but not on this one after it (its cache lost room meanwhile)"
            )
    return cache, ok
