"""The snapshot floor's search equals the linear scan on random recurrent caches.

Caches are built by the reducers themselves: requests whose prefixes branch off each
other at arbitrary blocks lease, escrow, materialize (evicting), reserve snapshots at
random points in a small snapshot pool (evicting snapshots), publish chunk by chunk and
release. Then every path and every point is asked for its floor both ways, and for its
attention hit and probe both ways (node walk against gallop and linear walk).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from wavepp import state
from wavepp.state import RequestId


@st.composite
def lives(draw):
    """Request paths (a trie of block ids) and, per request, its chunk ends and the
    snapshot points each chunk asks for."""
    paths: list[tuple[int, ...]] = []
    next_block = 1
    out = []
    for _ in range(draw(st.integers(1, 10))):
        base: tuple[int, ...] = ()
        if paths:
            parent = draw(st.sampled_from(paths))
            base = parent[: draw(st.integers(0, len(parent)))]
        fresh = draw(st.integers(1, 12))
        path = base + tuple(range(next_block, next_block + fresh))
        next_block += fresh
        paths.append(path)
        cuts = sorted(set(draw(st.lists(st.integers(1, len(path)), max_size=3))) | {len(path)})
        asks = [draw(st.lists(st.integers(0, len(path)), max_size=4)) for _ in cuts]
        out.append((path, cuts, asks))
    return out


@settings(max_examples=300, deadline=None)
@given(lives(), st.integers(8, 40), st.integers(0, 12))
def test_floor_search_equals_linear_scan(requests, capacity, snapshot_capacity) -> None:
    cache = state.empty_cache(capacity, has_recurrent=True, snapshot_capacity=snapshot_capacity)
    for i, (path, cuts, asks) in enumerate(requests):
        if len(path) > capacity:
            continue
        rid = RequestId(f"r{i}")
        cache, point = state.lease(cache, rid, path, state.probe(cache, path))
        cache, ok = state.escrow(cache, rid, len(path) - point)
        if not ok:
            cache = state.cancel(cache, rid)
            continue
        held = point
        for end, ask in zip(cuts, asks, strict=True):
            if end <= held:
                continue
            cache, _ = state.materialize(cache, rid, end - held)
            points = [k for k in ask if held < k <= end]
            cache, _ = state.reserve_snapshots(cache, rid, path, points)
            cache = state.publish(cache, rid, path, end)
            held = end
        cache = state.release(cache, rid)
        state.audit(cache)  # snapshot_marks included
        for other, _, _ in requests:
            for k in range(len(other) + 1):
                searched = state.snapshot_floor(cache, other, k)
                assert searched == state.snapshot_floor_linear(cache, other, k)
                # The node walk of the attention hit against the gallop over the index.
                hit = state.attention_hit(cache, other, k)
                assert hit == state.longest_prefix(cache.index, other, k)
                assert state.probe(cache, other, k) == state.probe_linear(cache, other, k)
