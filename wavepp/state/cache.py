"""The stage cache table: an immutable radix tree of block segments (DESIGN §2–§4).

One ``StageCache`` per pipeline stage. It is a value: reducers in ``reducers.py`` return
a new one and never touch the old, so a reader (the hint probe, a metrics scrape) works
on a snapshot that can never be half-updated.

Layout
------
Cached blocks live in segment ``Node``s. A node holds a run of consecutive blocks of one
prefix chain; a child continues its parent's chain after the parent's first ``attach``
blocks (children may hang off the middle of a node, so nodes never split). ``index``
maps every cached block hash to its node; a block's offset in the node follows from its
absolute position, which the caller always knows (``position - node.depth``).

Holds instead of per-block counts
---------------------------------
A request holds one prefix of its chain per stage: its lease (blocks ``0..point-1``)
extended by the blocks it has published since (its references). A hold is recorded
only at its tip, as the pin "keep the first n blocks of node X". Because eviction is
leaf first, a pinned tip keeps its whole root path alive, so leasing a 3,000-block
prefix costs one pin, not 3,000 reference counts. ``Node.pins`` also holds the attach
point of every protected child, which makes "protected" closed under ancestors and lets
``num_protected`` (blocks on some held root path) be kept exact in O(path nodes).

Accounting (checked by :func:`audit`)::

    capacity == num_free + num_cached + num_allocated
    num_escrowed <= capacity - num_protected - num_allocated   # escrow is backed
    snapshot_capacity == num_snapshot_free + len(snapshots) + pending snapshot slots

``num_allocated`` counts slots handed to requests by materialization and not yet
published into the tree. Unprotected cached blocks are exactly the evictable ones.

Victims without scanning
------------------------
``victims`` keeps every node with an evictable tail sorted by the eviction order's key
(LRU by default: recency, then node id), so materialization takes the next victim from
its head instead of heapifying the tree. Every node change goes through one place in the
transaction (``_Txn.put``), which keeps the order exact; :func:`audit` recomputes it.

Snapshot pool
-------------
Recurrent-state snapshots (stages with ``L`` layers) live in their own pool of
``snapshot_capacity`` slots, addressed by slot like KV blocks. ``snapshots`` maps the
hash of block k-1 to the snapshot after k blocks and its slot. A claim pins the snapshot
at its lease point (the request resumes from it); the others are evicted least recently
used when a new one needs a slot, and with their block when the block is evicted.
``snapshot_marks`` lists each node's snapshot positions in order, so the snapshot floor
of a path is a bisection per node on it, not a scan of its blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import immutables

from wavepp.state.ids import ROOT, BlockHash, NodeId, RequestId, SlotId

SlotRun = tuple[int, int]
"""Free slots ``start..stop-1``."""


@attrs.frozen
class Node:
    """A run of cached blocks of one prefix chain."""

    node_id: NodeId
    parent: NodeId | None  # None only for the root
    attach: int  # number of the parent's blocks that precede this node's first block
    depth: int  # absolute block position of hashes[0] (= parent.depth + attach)
    hashes: tuple[BlockHash, ...]  # the blocks, in chain order
    slots: tuple[SlotId, ...]  # KV-pool slot of each block, same order
    children: immutables.Map[NodeId, int]  # child id -> its attach point in this node
    pins: tuple[int, ...]  # sorted multiset of "keep first n blocks": holds + protected children
    recency: int  # clock of the last use of this node's tail; larger is more recent
    uses: int = 0  # times a request leased, published into or released this node's tail
    attaches: tuple[int, ...] = ()  # sorted multiset of the children's attach points

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)

    def floor(self) -> int:
        """Blocks that must stay: pinned ones and those under any child (leaf-first)."""
        pinned = self.pins[-1] if self.pins else 0
        under_child = self.attaches[-1] if self.attaches else 0
        return max(pinned, under_child)

    def num_evictable_now(self) -> int:
        """Tail blocks evictable right now without breaking leaf-first order."""
        if self.node_id == ROOT:
            return 0
        return len(self.hashes) - self.floor()


def tail_evictable(node: Node) -> int:
    """The default (and only safe) count of a node's blocks evictable now: leaf first,
    never a pinned block."""
    return node.num_evictable_now()


def lru_key(node: Node) -> tuple[int, ...]:
    """Least recently used first (ties: the older node, by id)."""
    return (node.recency,)


@attrs.frozen
class Eviction:
    """The victim order of materialization: which evictable leaf tail goes next.

    ``key`` orders nodes (smallest first) and may read only the node itself, so the
    order can be kept up to date as nodes change. ``evictable`` says how many tail
    blocks of a node may go now; anything but :func:`tail_evictable` breaks the
    protocol (the property suite's ``leased_block_never_evicted`` catches it).
    """

    name: str
    key: Callable[[Node], tuple] = lru_key
    evictable: Callable[[Node], int] = tail_evictable


LRU = Eviction("lru")


@attrs.frozen
class Snapshot:
    """A recurrent-state snapshot after ``k`` blocks, stored in a snapshot-pool slot."""

    k: int  # block count: the state after blocks 0..k-1
    slot: SlotId  # slot in the stage's snapshot pool, 0..snapshot_capacity-1
    recency: int  # clock of its last publish or lease; LRU among unpinned snapshots
    pins: int  # claims whose lease point is k on this chain (they resume from it)


@attrs.frozen
class Claim:
    """What one request holds on one stage. Every field returns to nothing on release."""

    point: int  # leased prefix in blocks (the reuse point agreed for this request)
    tip: NodeId  # node holding the last held block; ROOT when nothing is held
    tip_len: int  # the pin on ``tip``: keep its first tip_len blocks (0 iff tip is ROOT)
    num_published: int  # blocks published past ``point`` and held by reference
    num_escrowed: int  # blocks reserved for the suffix, not yet materialized
    pending_slots: tuple[SlotId, ...]  # materialized slots of blocks not yet published,
    #                                     in block order from position held()
    resume: BlockHash | None = None  # the snapshot this claim pins (hash of block point-1);
    #                                  None unless a recurrent stage leased point > 0
    pending_snapshots: tuple[tuple[int, SlotId], ...] = ()  # (k, snapshot slot) reserved
    #                                  for chunks not yet published, k ascending

    def held(self) -> int:
        """Blocks 0..held()-1 of the request's chain are cached and protected for it."""
        return self.point + self.num_published


@attrs.frozen
class StageCache:
    """One stage's cache, leases, escrows and pool. A value; see the module docstring."""

    capacity: int  # slots in the stage's KV pool
    has_recurrent: bool  # stage has L layers: reuse points need a snapshot
    nodes: immutables.Map[NodeId, Node]
    index: immutables.Map[BlockHash, NodeId]  # every cached block -> its node
    snapshots: immutables.Map[BlockHash, Snapshot]  # block h_{k-1} -> the snapshot after k
    claims: immutables.Map[RequestId, Claim]
    free_runs: tuple[SlotRun, ...]  # free slots as runs; order is allocation order
    num_free: int
    num_cached: int  # blocks in the tree
    num_protected: int  # cached blocks on the root path of some hold
    num_allocated: int  # slots materialized for requests and not yet published
    num_escrowed: int  # sum of Claim.num_escrowed
    clock: int  # bumped by every reducer; recency source
    next_node_id: int
    eviction: Eviction = LRU  # the victim order of this cache's materializations
    victims: tuple[tuple[tuple, NodeId], ...] = ()  # (eviction.key(node), id) of nodes
    #                                     with an evictable tail, sorted: head goes next
    snapshot_capacity: int = 0  # slots in the snapshot pool
    snapshot_free: tuple[SlotRun, ...] = ()  # free snapshot slots as runs
    num_snapshot_free: int = 0
    num_snapshot_pending: int = 0  # reserved by claims, not yet published
    snapshot_lru: tuple[tuple[int, BlockHash], ...] = ()  # (recency, hash) of unpinned
    #                                     snapshots, sorted: head is evicted next
    snapshot_marks: immutables.Map[NodeId, tuple[int, ...]] = attrs.field(
        factory=immutables.Map
    )  # node ->
    #                                     the k of every snapshot on its blocks, ascending
    #                                     (the snapshot floor's search; no empty entries)

    @property
    def num_evictable(self) -> int:
        return self.num_cached - self.num_protected

    @property
    def num_backable(self) -> int:
        """Blocks that free + evictable slots can still back beyond current escrows."""
        return self.capacity - self.num_protected - self.num_allocated - self.num_escrowed


def empty_cache(
    capacity: int,
    *,
    has_recurrent: bool = False,
    snapshot_capacity: int | None = None,
    eviction: Eviction = LRU,
) -> StageCache:
    """A stage cache with ``capacity`` free slots and nothing cached.

    ``snapshot_capacity`` defaults to ``capacity``: a snapshot sits on a cached or
    materialized block, so the pool then never runs short (the behaviour before it was
    bounded). A smaller pool costs reuse, never correctness.
    """
    if capacity <= 0:
        raise ValueError(f"a stage needs a positive pool capacity, got {capacity} blocks")
    if snapshot_capacity is None:
        snapshot_capacity = capacity
    if snapshot_capacity < 0:
        raise ValueError(f"snapshot pool capacity must be ≥ 0, got {snapshot_capacity}")
    root = Node(
        node_id=ROOT,
        parent=None,
        attach=0,
        depth=0,
        hashes=(),
        slots=(),
        children=immutables.Map(),
        pins=(),
        recency=0,
    )
    return StageCache(
        capacity=capacity,
        has_recurrent=has_recurrent,
        nodes=immutables.Map({ROOT: root}),
        index=immutables.Map(),
        snapshots=immutables.Map(),
        claims=immutables.Map(),
        free_runs=((0, capacity),),
        num_free=capacity,
        num_cached=0,
        num_protected=0,
        num_allocated=0,
        num_escrowed=0,
        clock=0,
        next_node_id=1,
        eviction=eviction,
        victims=(),
        snapshot_capacity=snapshot_capacity,
        snapshot_free=((0, snapshot_capacity),) if snapshot_capacity else (),
        num_snapshot_free=snapshot_capacity,
        num_snapshot_pending=0,
        snapshot_lru=(),
    )
