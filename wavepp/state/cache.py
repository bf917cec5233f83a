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

``num_allocated`` counts slots handed to requests by materialization and not yet
published into the tree. Unprotected cached blocks are exactly the evictable ones.
"""

from __future__ import annotations

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

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)

    def floor(self) -> int:
        """Blocks that must stay: pinned ones and those under any child (leaf-first)."""
        pinned = self.pins[-1] if self.pins else 0
        under_child = max(self.children.values()) if self.children else 0
        return max(pinned, under_child)

    def num_evictable_now(self) -> int:
        """Tail blocks evictable right now without breaking leaf-first order."""
        if self.node_id == ROOT:
            return 0
        return len(self.hashes) - self.floor()


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
    snapshots: immutables.Map[BlockHash, int]  # block h_{k-1} -> k: a snapshot after k blocks
    claims: immutables.Map[RequestId, Claim]
    free_runs: tuple[SlotRun, ...]  # free slots as runs; order is allocation order
    num_free: int
    num_cached: int  # blocks in the tree
    num_protected: int  # cached blocks on the root path of some hold
    num_allocated: int  # slots materialized for requests and not yet published
    num_escrowed: int  # sum of Claim.num_escrowed
    clock: int  # bumped by every reducer; recency source
    next_node_id: int

    @property
    def num_evictable(self) -> int:
        return self.num_cached - self.num_protected

    @property
    def num_backable(self) -> int:
        """Blocks that free + evictable slots can still back beyond current escrows."""
        return self.capacity - self.num_protected - self.num_allocated - self.num_escrowed


def empty_cache(capacity: int, *, has_recurrent: bool = False) -> StageCache:
    """A stage cache with ``capacity`` free slots and nothing cached."""
    if capacity <= 0:
        raise ValueError(f"a stage needs a positive pool capacity, got {capacity} blocks")
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
    )
