"""The agreed reuse point when stages hold different blocks and snapshots (issue 15).

Stages with different pools and snapshot placements (some attention-only) are filled
by one earlier prompt each, then a round offers a prompt sharing it. The spec:
- the agreed point is served exactly by every stage (its blocks cached, a snapshot
  there on recurrent stages) and never rises: agreed ≤ lowest lease ≤ MIN of probes;
- it is the *best* such point: no higher point at or below the lowest lease is served
  by every stage, however far below the first mask window it lies (no fallback to 0);
- ``run_round`` over a plane of in-process ranks makes exactly ``round_over``'s
  decisions, counters included, and leaves each stage's claims as ``round_over`` does,
  whether the escrow flags travelled with the agreement (every stage short of room
  guessed the agreed points) or in a collective of their own.
"""

from __future__ import annotations

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wavepp.rounds.admission import (
    Offer,
    RoundMode,
    StageBook,
    lease_all,
    round_over,
    run_round,
    window_tops,
)
from wavepp.rounds.errors import ProtocolError
from wavepp.state import (
    MASK_WIDTH,
    block_hashes,
    empty_cache,
    materialize,
    publish,
    release,
    reserve_snapshots,
)

B = 2  # tokens per block
MODE = RoundMode(B)


def _offer(rid: str, tokens: list[int]) -> Offer:
    return Offer(rid, len(tokens), block_hashes(tokens, B), (len(tokens) - 1) // B)


def _stage(capacity: int, recurrent: bool, doc: list[int], snaps: list[int], keep: int):
    """A stage that computed ``doc``'s first ``keep`` blocks, with snapshots at ``snaps``."""
    cache = empty_cache(capacity, has_recurrent=recurrent)
    o = _offer("doc", [*doc[: keep * B], 1])
    caches, res = round_over([cache], [o], MODE)
    assert res.admitted == (True,)
    cache, _ = materialize(caches[0], "doc")
    points = [k for k in snaps if 0 < k <= keep] if recurrent else []
    cache, _ = reserve_snapshots(cache, "doc", o.hashes, points)
    cache = publish(cache, "doc", o.hashes, keep)
    return release(cache, "doc")


def _serves(cache, hashes, k: int) -> bool:
    blocks = all(h in cache.index for h in hashes[:k])
    snap = k == 0 or not cache.has_recurrent or hashes[k - 1] in cache.snapshots
    return blocks and snap


stages = st.lists(
    st.tuples(
        st.booleans(),  # recurrent
        st.lists(st.integers(1, 3 * MASK_WIDTH + 10), max_size=6),  # snapshot points
        st.integers(0, 3 * MASK_WIDTH + 10),  # blocks kept
    ),
    min_size=1,
    max_size=4,
)


def _setup(spec, length):
    doc = [(i * 7) % 5 for i in range((length + 1) * B)]
    caches = [_stage(length + 8, rec, doc, snaps, min(keep, length)) for rec, snaps, keep in spec]
    return caches, _offer("q", [*doc[: length * B], 3, 3, 3])


@settings(max_examples=60, deadline=None)
@given(spec=stages, length=st.integers(1, 3 * MASK_WIDTH + 10))
def test_agreed_point_is_served_everywhere_and_the_best_below_the_lowest_lease(spec, length):
    caches, offer = _setup(spec, length)
    probes = [MODE.policy.probe(c, offer.hashes, offer.probe_limit) for c in caches]
    after, result = round_over(caches, [offer], MODE)
    assert result.admitted == (True,)
    point = result.points[0]
    assert point <= min(probes)  # never rises
    for cache in caches:  # before the round and after it: the same blocks serve it
        assert _serves(cache, offer.hashes, point)
    served = [k for k in range(min(probes) + 1) if all(_serves(c, offer.hashes, k) for c in caches)]
    best = max(served)
    assert point == best
    # each stage leases what it probed itself
    base = min(lease_all(c, [offer], [p], MODE)[1][0] for c, p in zip(caches, probes, strict=True))
    assert point <= base <= min(probes)
    counters = result.counters
    assert counters.disagreements == (1 if point < max(probes) else 0)
    assert counters.rollbacks == (1 if base < min(probes) else 0)
    # a fallback: the best point lies more than one window below the lowest lease
    assert counters.fallbacks == (1 if base - point >= MASK_WIDTH else 0)
    for cache in after:
        assert cache.claims["q"].point == point


def test_a_window_without_a_common_point_moves_down_instead_of_dropping_all_reuse():
    # Stage 0 has snapshots at 90 and 10, stage 1 at 100, 80 and 10: the probes (and
    # each stage's lease of its own probe) say 90 and 100, and no point in 90 .. 28
    # serves both: the old mask step gave 0; the next window down finds 10. Nothing
    # was rolled back: each stage protected what it probed.
    doc = [(i * 7) % 5 for i in range(121 * B)]
    caches = [_stage(200, True, doc, [90, 10], 120), _stage(200, True, doc, [100, 80, 10], 120)]
    offer = _offer("q", [*doc[: 120 * B], 3])
    _, result = round_over(caches, [offer], MODE)
    assert result.admitted == (True,) and result.points == (10,)
    assert result.counters.to_json() == {"disagreements": 1, "rollbacks": 0, "fallbacks": 1}


def _band(col) -> int:
    out = -1
    for v in col:
        out &= v
    return out


class _Plane:
    """In-process ranks: every collective waits for all ranks' values."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.collectives = 0
        self.pending: list[tuple[int, list[int]]] = []
        self.done = anyio.Event()
        self.result: list[int] = []

    def rank(self, r: int) -> _Rank:
        return _Rank(self, r)

    async def reduce(self, r: int, values, ops) -> list[int]:
        """``ops(i)``: the operation reducing column ``i``."""
        self.pending.append((r, list(values)))
        done = self.done
        if len(self.pending) == self.world:
            rows = [v for _, v in self.pending]
            assert len({len(v) for v in rows}) == 1, "ranks issued different collectives"
            self.result = [ops(i)(col) for i, col in enumerate(zip(*rows, strict=True))]
            self.pending, self.done = [], anyio.Event()
            self.collectives += 1
            done.set()
        await done.wait()
        return list(self.result)


class _Rank:
    def __init__(self, plane: _Plane, rank: int) -> None:
        self.plane, self.rank, self.world_size = plane, rank, plane.world

    async def all_min(self, values):
        return await self.plane.reduce(self.rank, values, lambda i: min)

    async def all_and(self, values):
        return await self.plane.reduce(self.rank, values, lambda i: _band)

    async def all_reduce(self, mins, ands):
        """MIN and AND in one collective, as the planes do."""
        split = len(mins)
        got = await self.plane.reduce(self.rank, [*mins, *ands],
                                      lambda i: min if i < split else _band)  # fmt: skip
        return got[:split], got[split:]


def _run_round_on_every_rank(caches, offers, anchors):
    """``run_round`` on one in-process rank per cache; the results and the plane (with
    each rank's book, ``plane.books``)."""
    plane = _Plane(len(caches))
    books = [StageBook(c) for c in caches]
    results = [None] * len(caches)

    async def one(r: int) -> None:
        results[r] = await run_round(plane.rank(r), books[r], offers, MODE, anchors)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for r in range(len(caches)):
                tg.start_soon(one, r)

    anyio.run(main)
    plane.books = books
    return results, plane


@settings(max_examples=40, deadline=None)
@given(spec=stages, length=st.integers(1, 3 * MASK_WIDTH + 10), data=st.data())
def test_run_round_makes_round_over_decisions(spec, length, data):
    caches, offer = _setup(spec, length)
    _, expected = round_over(caches, [offer], MODE)
    # The first mask window ends at rank 0's probe as sent with the round; any anchor
    # in 0..limit (rank 0's cache may move between its broadcast and the round, or the
    # round may carry none) must reach the same decisions, in more AND rounds at most.
    own = MODE.policy.probe(caches[0], offer.hashes, offer.probe_limit)
    anchor = data.draw(st.one_of(st.just(own), st.none(), st.integers(0, offer.probe_limit)))
    results, _ = _run_round_on_every_rank(caches, [offer], None if anchor is None else [anchor])
    for res in results:
        assert res.admitted == expected.admitted and res.points == expected.points
        assert res.counters == expected.counters


def test_escrow_flags_travel_with_the_agreement_when_the_stages_guessed_it():
    # Stages that cached 120 blocks of a document; the offer shares them all (121
    # blocks, 1 to escrow). With room for its whole prompt on every stage, the round is
    # one all-reduce. Where one stage's pool could not hold it all, that stage settles
    # at its guess (120: the window's top, its own lease) before the all-reduce, and the
    # flags ride in it: still one. Where the stages hold different prefixes (one kept
    # 100 blocks), the short stage's guess (120) is not the agreed point (100): the
    # flags' MIN runs on its own. The decisions are the same every time.
    doc = [(i * 7) % 5 for i in range(121 * B)]
    offer = _offer("q", [*doc[: 120 * B], 3])
    for small, kept, collectives, point in ((400, 120, 1, 120), (200, 120, 1, 120),
                                            (200, 100, 2, 100)):  # fmt: skip
        caches = [_stage(small, False, doc, [], 120), _stage(400, False, doc, [], kept)]
        after, expected = round_over(caches, [offer], MODE)
        results, plane = _run_round_on_every_rank(caches, [offer], [120])
        assert plane.collectives == collectives
        assert expected.admitted == (True,) and expected.points == (point,)
        assert all(r.admitted == expected.admitted and r.points == (point,) for r in results)
        assert [b.cache.claims for b in plane.books] == [c.claims for c in after]


@settings(max_examples=80, deadline=None)
@given(
    spec=st.lists(st.tuples(st.booleans(), st.integers(0, 24), st.integers(2, 40)),
                  min_size=2, max_size=4),  # (recurrent, blocks kept, pool beyond them)
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=5),
    data=st.data(),
)  # fmt: skip
def test_many_offers_on_tight_pools_make_round_over_decisions(spec, lengths, data):
    # Pools from barely enough to roomy, stages holding different prefixes, several
    # offers sharing the document: escrows fail and cut the FCFS prefix, guesses hold
    # or miss. run_round decides as round_over does and leaves the same claims.
    doc = [(i * 7) % 5 for i in range(64 * B)]
    caches = [_stage(keep + 1 + extra, rec, doc, [4, 8, 16], keep) for rec, keep, extra in spec]
    offers = [_offer(f"q{i}", [*doc[: n * B], 3, i]) for i, n in enumerate(lengths)]
    after, expected = round_over(caches, offers, MODE)
    own = [MODE.policy.probe(caches[0], o.hashes, o.probe_limit) for o in offers]
    anchors = data.draw(st.one_of(st.just(own), st.none()))
    results, plane = _run_round_on_every_rank(caches, offers, anchors)
    for res in results:
        assert res.admitted == expected.admitted and res.points == expected.points
        assert res.counters == expected.counters
    assert [b.cache.claims for b in plane.books] == [c.claims for c in after]
    assert [b.cache.num_escrowed for b in plane.books] == [c.num_escrowed for c in after]


def test_a_stage_whose_cache_gains_room_during_the_collective_keeps_the_decision():
    # Both stages hold "other"'s escrow of 15 blocks; "q" needs 12 more, which fit
    # neither pool, so each stage settles at its guess before the all-reduce (q
    # refused) and the flags travel with it. While rank 1 waits, its LOOP ends "other"
    # (its escrow goes): rank 1 settles again on the cache it has now, where q would
    # fit, and still refuses it with everyone; nothing leaks.
    doc = [(i * 7) % 5 for i in range(40 * B)]
    caches = [_stage(30, False, doc, [], 10) for _ in range(2)]
    other = _offer("other", [100 + i for i in range(15 * B)])
    caches, res = round_over(caches, [other], MODE)
    assert res.admitted == (True,)
    offer = _offer("q", [*doc[: 22 * B], 3])
    plane = _Plane(2)
    books = [StageBook(c) for c in caches]
    results = [None, None]

    class Ending(_Rank):
        async def all_reduce(self, mins, ands):
            books[1].cache = release(books[1].cache, "other")  # the LOOP, meanwhile
            return await super().all_reduce(mins, ands)

    async def one(r: int) -> None:
        rank = Ending(plane, r) if r == 1 else plane.rank(r)
        results[r] = await run_round(rank, books[r], [offer], MODE, [10])

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for r in range(2):
                tg.start_soon(one, r)

    anyio.run(main)
    assert plane.collectives == 1
    assert [r.admitted for r in results] == [(False,), (False,)]
    assert ["q" not in b.cache.claims for b in books] == [True, True]
    assert books[0].cache.num_escrowed == 15 and books[1].cache.num_escrowed == 0


def test_anchors_from_rank_0_are_checked_before_use():
    offer = _offer("q", list(range(20)))
    assert window_tops([offer], None) == [offer.probe_limit]
    assert window_tops([offer], [3]) == [3]
    for bad in ([offer.probe_limit + 1], [-1], [1, 2]):
        with pytest.raises(ProtocolError):
            window_tops([offer], bad)
