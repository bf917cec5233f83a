"""Exact expected values for the snapshot pool and the victim order (issue 9 items 4, 5)."""

import pytest

from wavepp.state import (
    StateError,
    audit,
    block_hashes,
    empty_cache,
    escrow,
    lease,
    lru_key,
    materialize,
    probe,
    publish,
    release,
    reserve_snapshots,
    resume_slot,
    usage,
)

B = 2  # tokens per block


def prompt(*blocks: int) -> tuple[int, ...]:
    return block_hashes([t for b in blocks for t in (b, b)], B)


def start(cache, rid, hashes, point=None):
    cache, got = lease(cache, rid, hashes, probe(cache, hashes) if point is None else point)
    cache, ok = escrow(cache, rid, len(hashes) - got)
    assert ok
    cache, _ = materialize(cache, rid)
    return cache, got


def test_reserve_takes_free_slots_then_publish_records_them():
    cache = empty_cache(16, has_recurrent=True, snapshot_capacity=3)
    a = prompt(1, 2, 3, 4)
    cache, _ = start(cache, "a", a)
    cache, got = reserve_snapshots(cache, "a", a, [2, 4])
    assert got.points == (2, 4) and len(set(got.slots)) == 2
    assert cache.num_snapshot_free == 1 and cache.num_snapshot_pending == 2
    audit(cache)
    cache = publish(cache, "a", a, 4)
    assert {s.k: s.slot for s in cache.snapshots.values()} == dict(
        zip((2, 4), got.slots, strict=True)
    )
    assert resume_slot(cache, a, 4) == got.slots[1] and resume_slot(cache, a, 3) is None
    cache = release(cache, "a")
    assert usage(cache).balanced and usage(cache).num_snapshots == 2
    audit(cache)


def test_full_pool_evicts_the_least_recently_used_unpinned_snapshot():
    cache = empty_cache(32, has_recurrent=True, snapshot_capacity=2)
    a, b = prompt(1, 2), prompt(3, 4)
    for rid, hashes in (("a", a), ("b", b)):
        cache, _ = start(cache, rid, hashes)
        cache = publish(cache, rid, hashes, 2, [2])
        cache = release(cache, rid)
    assert probe(cache, a) == 2 and probe(cache, b) == 2
    c = prompt(5, 6)
    cache, _ = start(cache, "c", c)
    cache, got = reserve_snapshots(cache, "c", c, [2])
    assert got.points == (2,)
    assert probe(cache, a) == 0  # a's snapshot was the least recently used: gone
    assert probe(cache, b) == 2
    assert a[1] in cache.index  # its block stays cached; only reuse is lost
    audit(cache)


def test_a_snapshot_at_a_lease_point_is_never_evicted_and_points_are_skipped():
    cache = empty_cache(32, has_recurrent=True, snapshot_capacity=1)
    a = prompt(1, 2)
    cache, _ = start(cache, "a", a)
    cache = publish(cache, "a", a, 2, [2])
    cache = release(cache, "a")
    longer = prompt(1, 2, 7, 8)
    cache, got = lease(cache, "x", longer, 2)  # resumes from a's snapshot: pinned
    assert got == 2 and cache.snapshots[a[1]].pins == 1
    cache, ok = escrow(cache, "x", 2)
    assert ok
    cache, _ = materialize(cache, "x")
    cache, reserved = reserve_snapshots(cache, "x", longer, [4])
    assert reserved.points == () and reserved.slots == ()  # no slot: skipped, not failed
    assert a[1] in cache.snapshots
    cache = publish(cache, "x", longer, 4)
    cache = release(cache, "x")
    assert cache.snapshots[a[1]].pins == 0 and usage(cache).balanced
    audit(cache)


def test_evicting_a_block_frees_its_snapshot_slot():
    cache = empty_cache(2, has_recurrent=True, snapshot_capacity=2)
    a = prompt(1, 2)
    cache, _ = start(cache, "a", a)
    cache = publish(cache, "a", a, 2, [1, 2])
    cache = release(cache, "a")
    assert cache.num_snapshot_free == 0
    b = prompt(3)
    cache, _ = lease(cache, "b", b, 0)
    cache, _ = escrow(cache, "b", 1)
    cache, done = materialize(cache, "b")
    assert done.evicted == (a[1],)
    assert a[1] not in cache.snapshots and cache.num_snapshot_free == 1
    audit(cache)


def test_release_returns_reserved_but_unpublished_snapshot_slots():
    cache = empty_cache(8, has_recurrent=True, snapshot_capacity=2)
    a = prompt(1, 2)
    cache, _ = start(cache, "a", a)
    cache, got = reserve_snapshots(cache, "a", a, [1, 2])
    assert len(got.slots) == 2 and cache.num_snapshot_free == 0
    cache = release(cache, "a")  # cancelled mid-chunk
    assert cache.num_snapshot_free == 2 and usage(cache).balanced
    audit(cache)


def test_a_partial_tail_chunk_leaves_the_request_end_snapshot():
    cache = empty_cache(8, has_recurrent=True)
    a = prompt(1, 2)
    cache, _ = start(cache, "a", a)
    cache = publish(cache, "a", a, 2)  # both blocks, no snapshot yet
    cache, got = reserve_snapshots(cache, "a", a, [2])  # the tail chunk resumes at 2
    assert got.points == (2,)
    cache = publish(cache, "a", a, 2)  # publishes no block, records the snapshot
    assert a[1] in cache.snapshots and cache.num_snapshot_pending == 0
    audit(release(cache, "a"))


def test_reserve_rejects_points_outside_the_request():
    cache = empty_cache(8, has_recurrent=True)
    a = prompt(1, 2)
    cache, _ = start(cache, "a", a)
    with pytest.raises(StateError, match=r"outside its blocks \[1, 2\]"):
        reserve_snapshots(cache, "a", a, [3])


def test_victim_order_is_kept_sorted_as_nodes_change():
    cache = empty_cache(12)
    hashes = [prompt(1, 2), prompt(1, 3), prompt(4, 5)]
    for i, h in enumerate(hashes):
        cache, _ = start(cache, f"r{i}", h)
        cache = publish(cache, f"r{i}", h, len(h))
        cache = release(cache, f"r{i}")
    keys = [key for key, _ in cache.victims]
    assert keys == sorted(keys) and len(cache.victims) == 3  # three evictable tails
    head = cache.nodes[cache.victims[0][1]]
    assert lru_key(head) == min(lru_key(cache.nodes[n]) for _, n in cache.victims)
    cache, _ = lease(cache, "x", hashes[2], 2)  # protects one tail: it leaves the order
    assert len(cache.victims) == 2
    audit(cache)
