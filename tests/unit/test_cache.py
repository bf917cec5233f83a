"""Exact expected values for the state core: eviction order, leases, snapshots."""

import pytest

from wavepp.state import (
    StateError,
    UnknownRequest,
    audit,
    block_hashes,
    block_table,
    cancel,
    empty_cache,
    escrow,
    lease,
    materialize,
    probe,
    publish,
    reconcile,
    release,
    usage,
)

B = 2  # tokens per block


def prompt(*blocks: int) -> tuple[int, ...]:
    return block_hashes([t for b in blocks for t in (b, b)], B)


def run(cache, rid, hashes, point=None, snapshots=()):
    """Admit and run one whole request at its best point; returns (cache, point)."""
    cache, got = lease(cache, rid, hashes, probe(cache, hashes) if point is None else point)
    cache, ok = escrow(cache, rid, len(hashes) - got)
    assert ok
    cache, _ = materialize(cache, rid)
    cache = publish(cache, rid, hashes, len(hashes), snapshots)
    audit(cache)
    return cache, got


def test_lru_eviction_order_is_exact_and_leaf_first():
    cache = empty_cache(6)
    a, b = prompt(1, 2, 3), prompt(1, 2, 4)  # share blocks 0-1
    cache, _ = run(cache, "a", a)
    cache = release(cache, "a")
    cache, got = run(cache, "b", b)
    assert got == 2
    cache = release(cache, "b")
    # Free slots: 6 - 4 cached = 2. Ask for 4: the 2 free, then the LRU leaf a[2], then
    # the next leaf is b[2] (a's node is gone; the shared head still has child b).
    c = prompt(5, 6, 7, 8)
    cache, got = lease(cache, "c", c, 0)
    cache, ok = escrow(cache, "c", 4)
    assert ok
    cache, done = materialize(cache, "c")
    assert done.evicted == (a[2], b[2])
    assert len(set(done.slots)) == 4 and set(done.slots) <= set(range(6))
    assert probe(cache, a) == 2 and probe(cache, b) == 2
    audit(cache)
    cache = cancel(cache, "c")
    assert usage(cache).balanced


def test_slots_taken_by_eviction_come_in_ascending_order():
    """Victims are evicted deepest block first, but a request gets their slots in
    ascending order, so a run of slots stays one run (a handoff sends it in place)."""
    cache = empty_cache(8)
    a = prompt(1, 2, 3, 4, 5, 6, 7, 8)
    cache, _ = run(cache, "a", a)
    a_slots = block_table(cache, "a")
    assert sorted(a_slots) == list(range(8))
    cache = release(cache, "a")  # the pool full of a's cached blocks
    c = prompt(11, 12, 13, 14, 15, 16)
    cache, _ = lease(cache, "c", c, 0)
    cache, ok = escrow(cache, "c", 6)
    assert ok
    cache, done = materialize(cache, "c")
    assert done.evicted == tuple(reversed(a[2:]))  # deepest first
    assert done.slots == tuple(sorted(a_slots[2:]))
    audit(cache)


def test_eviction_never_crosses_a_lease():
    cache = empty_cache(4)
    a = prompt(1, 2, 3, 4)
    cache, _ = run(cache, "a", a)
    cache = release(cache, "a")  # a's 4 blocks cached, unprotected, pool full
    cache, got = lease(cache, "x", a, 2)  # protect a[0:2] only
    assert got == 2
    cache, got_y = lease(cache, "y", prompt(9, 9), 0)
    cache, ok = escrow(cache, "y", 3)  # only 2 blocks are evictable
    assert not ok and got_y == 0
    cache, ok = escrow(cache, "y", 2)
    assert ok
    cache, done = materialize(cache, "y")
    assert done.evicted == (a[3], a[2])  # tail first, and never the leased a[0:2]
    assert probe(cache, a) == 2
    audit(cache)


def test_lease_is_clamped_so_escrows_stay_backed():
    cache = empty_cache(4)
    a = prompt(1, 2, 3)
    cache, _ = run(cache, "a", a)
    cache = release(cache, "a")  # 3 unprotected blocks, 1 free slot
    cache, _ = lease(cache, "y", prompt(7, 7, 7), 0)
    cache, ok = escrow(cache, "y", 3)  # backed by 1 free + 2 of a's blocks
    assert ok and cache.num_backable == 1
    cache, got = lease(cache, "x", a, 3)  # protecting 3 would unback y's escrow
    assert got == 1
    audit(cache)
    cache, _ = materialize(cache, "y")  # still cannot fail
    audit(cache)


def test_a_block_cached_meanwhile_is_shared_and_the_slot_returns():
    cache = empty_cache(8)
    a = prompt(1, 2)
    for rid in ("a1", "a2"):
        cache, _ = lease(cache, rid, a, 0)
        cache, ok = escrow(cache, rid, 2)
        assert ok
        cache, _ = materialize(cache, rid)
    assert cache.num_free == 4
    cache = publish(cache, "a1", a, 2)
    cache = publish(cache, "a2", a, 2)  # same blocks: shared, a2's slots freed
    assert cache.num_cached == 2 and cache.num_free == 6
    assert block_table(cache, "a2") == block_table(cache, "a1")
    audit(cache)
    cache = release(release(cache, "a1"), "a2")
    assert usage(cache).balanced


def test_snapshot_clamping_on_recurrent_stages():
    cache = empty_cache(16, has_recurrent=True)
    a = prompt(1, 2, 3, 4, 5, 6)
    cache, _ = run(cache, "a", a, snapshots=[2, 4])
    cache = release(cache, "a")
    assert probe(cache, a) == 4  # 6 blocks cached, last snapshot at 4
    assert probe(cache, prompt(1, 2, 3)) == 2
    assert probe(cache, prompt(1, 9)) == 0  # hit 1, no snapshot at 1
    plain = empty_cache(16)
    plain, _ = run(plain, "a", a)
    assert probe(plain, prompt(1, 2, 3)) == 3


def test_reconcile_rolls_back_and_never_raises():
    cache = empty_cache(8, has_recurrent=True)
    a = prompt(1, 2, 3, 4)
    cache, _ = run(cache, "a", a, snapshots=[2, 4])
    cache = release(cache, "a")
    cache, got = lease(cache, "b", a, 4)
    assert got == 4
    same, point = reconcile(cache, "b", a, 5)
    assert same is cache and point == 4
    cache, point = reconcile(cache, "b", a, 3)
    assert point == 2  # no snapshot at 3: the last one below
    assert cache.num_protected == 2
    audit(cache)


def test_errors_give_the_numbers():
    cache = empty_cache(4)
    a = prompt(1, 2)
    with pytest.raises(UnknownRequest, match="holds nothing for request 'zz'"):
        release(cache, "zz")
    cache, _ = lease(cache, "a", a, 0)
    with pytest.raises(StateError, match=r"lease point 3 outside the prompt's 0\.\.2 blocks"):
        lease(cache, "b", a, 3)
    with pytest.raises(StateError, match="needs 2 materialized slots; it has 0"):
        publish(cache, "a", a, 2)
    with pytest.raises(StateError, match="has 0 escrowed blocks; cannot materialize 1"):
        materialize(cache, "a", 1)
    with pytest.raises(ValueError, match="positive pool capacity, got 0"):
        empty_cache(0)
