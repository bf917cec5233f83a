"""The hint probe: a stage's local reuse point, read-only (DESIGN §4 step 1).

Probing pins and reserves nothing, so a request cancelled after its probe leaves
nothing to undo. The gallop + bisect walk is exact because the cached set is
prefix-closed along every chain (leaf-first eviction keeps it so): if block i of a
chain is cached, so are blocks 0..i-1.
"""

from __future__ import annotations

import bisect
from collections.abc import Container, Sequence

from wavepp.state.cache import StageCache
from wavepp.state.ids import BlockHash


def longest_prefix(
    members: Container[BlockHash], hashes: Sequence[BlockHash], limit: int | None = None
) -> int:
    """Largest k ≤ limit with blocks 0..k-1 all in ``members``, in O(log k) look-ups.

    Exact when ``members`` is prefix-closed along every chain (if block i is in, so are
    blocks 0..i-1): a cache under leaf-first eviction, the blocks of live requests.
    """
    n = len(hashes) if limit is None else min(limit, len(hashes))
    if n == 0 or hashes[0] not in members:
        return 0
    # Gallop: prefixes of 1, 2, 4, ... blocks until one is missing.
    lo, size = 1, 2  # lo: a prefix length known present
    while size <= n and hashes[size - 1] in members:
        lo, size = size, size * 2
    hi = min(size, n + 1)  # a prefix length known missing (or n + 1)
    # Bisect: invariant lo present, hi missing.
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if hashes[mid - 1] in members:
            lo = mid
        else:
            hi = mid
    return lo


def attention_hit(cache: StageCache, hashes: Sequence[BlockHash], limit: int | None = None) -> int:
    """Largest k ≤ limit with blocks 0..k-1 cached, in O(log k) index look-ups."""
    return longest_prefix(cache.index, hashes, limit)


def snapshot_floor(cache: StageCache, hashes: Sequence[BlockHash], point: int) -> int:
    """Largest k ≤ point with a recurrent snapshot after k blocks (0 always has one).

    A bisection of the snapshot positions of each tree node on the path, from the node
    holding block point-1 up towards the root until one has a snapshot low enough:
    O(nodes walked × log snapshots), where the scan of :func:`snapshot_floor_linear`
    costs one look-up per block. Nodes on a path are its branch points, so the walk is
    short; exact, because every snapshot sits on a cached block (the property suite
    checks both agree).
    """
    point = min(point, len(hashes))
    if point <= 0:
        return 0
    node_id = cache.index.get(hashes[point - 1])
    if node_id is None:  # no snapshot beyond the cached blocks
        point = attention_hit(cache, hashes, point)
        if point == 0:
            return 0
        node_id = cache.index[hashes[point - 1]]
    nodes, marks = cache.nodes, cache.snapshot_marks
    node = nodes[node_id]
    limit = point  # snapshots at k ≤ limit lie on the path
    while True:
        ks = marks.get(node.node_id)
        if ks:
            i = bisect.bisect_right(ks, limit)
            if i:
                return ks[i - 1]
        if node.parent is None:
            return 0
        limit = node.depth  # the parent's blocks before this node's first one
        node = nodes[node.parent]


def snapshot_floor_linear(cache: StageCache, hashes: Sequence[BlockHash], point: int) -> int:
    """The same answer as :func:`snapshot_floor` by scanning back block by block."""
    snapshots = cache.snapshots
    for k in range(min(point, len(hashes)), 0, -1):
        if hashes[k - 1] in snapshots:
            return k
    return 0


def probe(cache: StageCache, hashes: Sequence[BlockHash], limit: int | None = None) -> int:
    """The stage's local reuse point in blocks (attention hit, clamped to a snapshot)."""
    point = attention_hit(cache, hashes, limit)
    if cache.has_recurrent:
        point = snapshot_floor(cache, hashes, point)
    return point


def probe_linear(cache: StageCache, hashes: Sequence[BlockHash], limit: int | None = None) -> int:
    """The same answer as :func:`probe` by walking block by block (the R1 baseline)."""
    index = cache.index
    n = len(hashes) if limit is None else min(limit, len(hashes))
    point = 0
    while point < n and hashes[point] in index:
        point += 1
    if cache.has_recurrent:
        point = snapshot_floor_linear(cache, hashes, point)
    return point


MASK_WIDTH = 63
"""Points one reuse-mask round can agree on: ``base - 62 .. base`` (fits an int64)."""


def reuse_mask(cache: StageCache, hashes: Sequence[BlockHash], base: int, held: int) -> int:
    """Bit i set iff this stage can start the request at ``base - i`` (i < MASK_WIDTH).

    ``held`` is the stage's lease point: every point at or below it is cached and
    protected, so only snapshots (recurrent stages) restrict which ones it can serve.
    An all-rank AND of these masks finds the largest point every stage serves exactly,
    in one collective, however the stages' snapshots differ.
    """
    mask = 0
    for i in range(min(MASK_WIDTH, base + 1)):
        k = base - i
        if k <= held and (k == 0 or not cache.has_recurrent or hashes[k - 1] in cache.snapshots):
            mask |= 1 << i
    return mask


def point_from_mask(base: int, mask: int) -> int | None:
    """The largest common point of an AND-ed mask, or None if the window has none."""
    if mask == 0:
        return None
    lowest = (mask & -mask).bit_length() - 1
    return base - lowest
