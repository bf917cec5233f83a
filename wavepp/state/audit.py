"""Recompute a stage's accounting from scratch and compare (tests and end-of-run checks)."""

from __future__ import annotations

from collections import Counter

import attrs

from wavepp.state.cache import StageCache
from wavepp.state.errors import InvariantError
from wavepp.state.ids import ROOT, NodeId


@attrs.frozen
class Usage:
    """What a stage holds; all-zero holds after every request has ended."""

    num_leases: int  # requests with a lease (possibly at point 0)
    num_escrowed: int  # escrowed blocks
    num_referenced: int  # blocks published and still held by requests
    num_pending: int  # materialized slots not yet published
    num_cached: int
    num_free: int
    capacity: int
    num_snapshots: int = 0  # snapshots cached in the snapshot pool
    num_snapshot_pending: int = 0  # snapshot slots reserved and not yet published
    num_snapshot_pinned: int = 0  # snapshots some claim resumes from
    num_snapshot_free: int = 0
    snapshot_capacity: int = 0

    @property
    def balanced(self) -> bool:
        """No holds of any kind and every slot (KV or snapshot) either free or cached."""
        return (
            self.num_leases == 0
            and self.num_escrowed == 0
            and self.num_referenced == 0
            and self.num_pending == 0
            and self.num_free + self.num_cached == self.capacity
            and self.num_snapshot_pending == 0
            and self.num_snapshot_pinned == 0
            and self.num_snapshot_free + self.num_snapshots == self.snapshot_capacity
        )


def usage(cache: StageCache) -> Usage:
    claims = list(cache.claims.values())
    return Usage(
        num_leases=len(claims),
        num_escrowed=sum(c.num_escrowed for c in claims),
        num_referenced=sum(c.num_published for c in claims),
        num_pending=sum(len(c.pending_slots) for c in claims),
        num_cached=cache.num_cached,
        num_free=cache.num_free,
        capacity=cache.capacity,
        num_snapshots=len(cache.snapshots),
        num_snapshot_pending=sum(len(c.pending_snapshots) for c in claims),
        num_snapshot_pinned=sum(1 for s in cache.snapshots.values() if s.pins),
        num_snapshot_free=cache.num_snapshot_free,
        snapshot_capacity=cache.snapshot_capacity,
    )


def audit(cache: StageCache) -> None:
    """Raise ``InvariantError`` naming the first broken invariant. O(cache size)."""

    def fail(message: str) -> None:
        raise InvariantError(message)

    nodes = dict(cache.nodes.items())
    root = nodes.get(ROOT)
    if root is None or root.hashes:
        fail("the root node is missing or holds blocks")
    index_seen: dict[int, NodeId] = {}
    slots_seen: Counter[int] = Counter()
    for node in nodes.values():
        if len(node.hashes) != len(node.slots):
            fail(f"node {node.node_id} has {len(node.hashes)} blocks but {len(node.slots)} slots")
        if node.node_id != ROOT:
            if not node.hashes:
                fail(f"node {node.node_id} is empty but still in the tree")
            parent = nodes.get(node.parent)  # type: ignore[arg-type]
            if parent is None or parent.children.get(node.node_id) != node.attach:
                fail(f"node {node.node_id} is not listed as a child of {node.parent}")
            if not (parent.node_id == ROOT or 1 <= node.attach <= len(parent.hashes)):
                fail(f"node {node.node_id} attaches at {node.attach} of {len(parent.hashes)}")
            if node.depth != parent.depth + node.attach:
                fail(f"node {node.node_id} depth {node.depth} != parent's + attach")
        for child in node.children:
            if child not in nodes:
                fail(f"node {node.node_id} lists a missing child {child}")
        if node.attaches != tuple(sorted(node.children.values())):
            fail(f"node {node.node_id}'s attach points {node.attaches} are not its children's")
        for block in node.hashes:
            if block in index_seen:
                fail(f"block {block:#x} is cached twice")
            index_seen[block] = node.node_id
        slots_seen.update(node.slots)
    if dict(cache.index.items()) != index_seen:
        fail("the block index does not match the tree")
    if not set(cache.snapshots.keys()) <= index_seen.keys():
        fail("a snapshot outlived its block")
    num_cached = sum(len(n.hashes) for n in nodes.values())
    if num_cached != cache.num_cached:
        fail(f"num_cached {cache.num_cached} != {num_cached} blocks in the tree")

    claims = list(cache.claims.values())
    for claim in claims:
        slots_seen.update(claim.pending_slots)
    free = [s for start, stop in cache.free_runs for s in range(start, stop)]
    slots_seen.update(free)
    if len(free) != cache.num_free:
        fail(f"num_free {cache.num_free} != {len(free)} slots in the free runs")
    doubled = [s for s, k in slots_seen.items() if k > 1]
    if doubled or set(slots_seen) != set(range(cache.capacity)):
        fail(f"slots are not a partition of the pool (doubled: {doubled[:5]})")
    num_pending = sum(len(c.pending_slots) for c in claims)
    if num_pending != cache.num_allocated:
        fail(f"num_allocated {cache.num_allocated} != {num_pending} pending slots")
    if sum(c.num_escrowed for c in claims) != cache.num_escrowed:
        fail("num_escrowed differs from the sum of the claims' escrows")

    # Pins: every hold's tip plus the attach point of every protected child, where a
    # node is protected when a hold's tip lies on it or below it.
    expected: dict[NodeId, Counter[int]] = {nid: Counter() for nid in nodes}
    protected: set[NodeId] = set()
    for claim in claims:
        if claim.tip_len:
            expected[claim.tip][claim.tip_len] += 1
            nid = claim.tip
            while nid != ROOT and nid not in protected:
                protected.add(nid)
                nid = nodes[nid].parent  # type: ignore[assignment]
    for nid in protected:
        node = nodes[nid]
        expected[node.parent][node.attach] += 1  # type: ignore[index]
    for nid, node in nodes.items():
        if nid != ROOT and Counter(node.pins) != expected[nid]:
            fail(f"node {nid} pins {node.pins} != expected {sorted(expected[nid].elements())}")
    num_protected = sum(n.pins[-1] for nid, n in nodes.items() if nid != ROOT and n.pins)
    if num_protected != cache.num_protected:
        fail(f"num_protected {cache.num_protected} != {num_protected} recomputed")
    if cache.num_free + cache.num_cached + cache.num_allocated != cache.capacity:
        fail("free + cached + allocated != capacity")
    if cache.num_backable < 0:
        fail(
            f"escrow over-committed: {cache.num_escrowed} escrowed but only "
            f"{cache.capacity - cache.num_protected - cache.num_allocated} backable"
        )
    _audit_victims(cache, nodes)
    _audit_snapshots(cache, nodes, claims)


def _audit_victims(cache: StageCache, nodes: dict) -> None:
    eviction = cache.eviction
    expected = sorted(
        (eviction.key(n), nid)
        for nid, n in nodes.items()
        if nid != ROOT and eviction.evictable(n) > 0
    )
    if list(cache.victims) != expected:
        raise InvariantError(
            f"the victim order {list(cache.victims)[:4]} != {expected[:4]} recomputed"
        )


def _audit_snapshots(cache: StageCache, nodes: dict, claims: list) -> None:
    def fail(message: str) -> None:
        raise InvariantError(message)

    slots: Counter[int] = Counter()
    pins: Counter[int] = Counter(c.resume for c in claims if c.resume is not None)
    for block, snap in cache.snapshots.items():
        node = nodes[cache.index[block]]
        if node.depth + node.hashes.index(block) + 1 != snap.k:
            fail(f"snapshot after block {block:#x} says k={snap.k}, the tree says otherwise")
        if snap.pins != pins.pop(block, 0):
            fail(f"snapshot k={snap.k} has {snap.pins} pins; claims resume from it otherwise")
        slots[snap.slot] += 1
    if pins:
        fail(f"claims resume from {len(pins)} snapshots that are not cached")
    pending = [slot for c in claims for _, slot in c.pending_snapshots]
    if len(pending) != cache.num_snapshot_pending:
        fail(f"num_snapshot_pending {cache.num_snapshot_pending} != {len(pending)} reserved")
    slots.update(pending)
    free = [s for start, stop in cache.snapshot_free for s in range(start, stop)]
    if len(free) != cache.num_snapshot_free:
        fail(f"num_snapshot_free {cache.num_snapshot_free} != {len(free)} in the free runs")
    slots.update(free)
    doubled = [s for s, k in slots.items() if k > 1]
    if doubled or set(slots) != set(range(cache.snapshot_capacity)):
        fail(f"snapshot slots are not a partition of the snapshot pool (doubled: {doubled[:5]})")
    marks: dict = {}
    for block, snap in cache.snapshots.items():
        marks.setdefault(cache.index[block], []).append(snap.k)
    if {n: tuple(sorted(ks)) for n, ks in marks.items()} != dict(cache.snapshot_marks):
        fail("snapshot_marks do not match the snapshots on each node")
    lru = sorted((s.recency, b) for b, s in cache.snapshots.items() if not s.pins)
    if list(cache.snapshot_lru) != lru:
        fail("the snapshot LRU order does not match the unpinned snapshots")
