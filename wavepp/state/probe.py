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
from wavepp.state.guarantees import Guarantee, guarantees
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
    """Largest k ≤ limit with blocks 0..k-1 cached.

    Walks the tree node by node (:func:`_walk`): two map look-ups per node on the path
    plus bisections over tuples, where a gallop over the index would cost 2·log2(k)
    look-ups in a map of every cached block.
    """
    return _walk(cache, hashes, limit)[0]


def _walk(cache: StageCache, hashes: Sequence[BlockHash], limit: int | None):
    """(the attention hit k, the node holding block k-1, or None when k = 0).

    Inside a node the chain is compared with the node's own hashes. Hashes are chained,
    so block i of the chain equals block i of a node iff the whole prefix through i does:
    "equal at i" holds up to the point L where the chain leaves the node and never after
    (a monotone predicate). The cache can hold the chain past L only in a child attached
    exactly at L, so the walk first bisects the node's sorted attach points (a few
    children, not the node's length) for the last one the chain reaches, looks that child
    up, and bisects block by block only in the node where the chain ends.
    """
    n = len(hashes) if limit is None else min(limit, len(hashes))
    if n <= 0:
        return 0, None
    index, nodes = cache.index, cache.nodes
    node_id = index.get(hashes[0])
    if node_id is None:
        return 0, None
    pos, node = 0, nodes[node_id]  # hashes[pos] is a block of node
    while True:
        own, off = node.hashes, node.depth
        end = min(off + len(own), n)  # the chain positions this node can match
        if hashes[end - 1] == own[end - 1 - off]:
            pos = end  # the whole rest of the node matches
        else:  # equal at pos, different at top: the chain leaves in between
            top = end - 1
            atts = node.attaches
            i = bisect.bisect_right(atts, pos - off)
            j = bisect.bisect_left(atts, top - off + 1)
            branch = False
            while i < j:  # the last attach point a whose block before it still matches
                m = (i + j) // 2
                k = off + atts[m] - 1
                if hashes[k] == own[k - off]:
                    pos, branch, i = k, True, m + 1
                else:
                    top, j = k, m
            if branch and hashes[pos + 1] != own[pos + 1 - off]:  # left exactly there
                node_id = index.get(hashes[pos + 1])
                if node_id is not None:  # into the child attached at pos + 1
                    pos, node = pos + 1, nodes[node_id]
                    continue
                return pos + 1, node
            lo, hi = pos, top  # the chain ends in this node: bisect for where
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if hashes[mid] == own[mid - off]:
                    lo = mid
                else:
                    hi = mid
            return lo + 1, node
        if pos == n:
            return n, node
        node_id = index.get(hashes[pos])  # a child attached at the node's end, or nothing
        if node_id is None:
            return pos, node
        node = nodes[node_id]


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
        point, node = _walk(cache, hashes, point)
        if node is None:
            return 0
    else:
        node = cache.nodes[node_id]
    return _floor_from(cache, node, point)


def _floor_from(cache: StageCache, node, point: int) -> int:
    """The snapshot floor at or below ``point``, from the node holding block point-1."""
    nodes, marks = cache.nodes, cache.snapshot_marks
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


@guarantees(Guarantee.PLAIN_PROBE)
def probe(cache: StageCache, hashes: Sequence[BlockHash], limit: int | None = None) -> int:
    """The stage's local reuse point in blocks (attention hit, clamped to a snapshot)."""
    point, node = _walk(cache, hashes, limit)
    if cache.has_recurrent and node is not None:
        point = _floor_from(cache, node, point)
    return point


@guarantees(Guarantee.PLAIN_PROBE)
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
