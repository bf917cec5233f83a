"""A private scratchpad that builds the next ``StageCache`` from the current one.

Reducers are pure: they open a ``_Txn`` over the input value, edit persistent-map
mutations (one ``.mutate()`` per table, so a batch of edits costs one copy-on-write
pass) and local counters, and ``finish()`` into a new value. The input is never
touched; the transaction object never escapes a reducer.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

import attrs
import immutables

from wavepp.state.cache import Claim, Node, SlotRun, Snapshot, StageCache
from wavepp.state.errors import InvariantError
from wavepp.state.ids import ROOT, BlockHash, NodeId, RequestId, SlotId


class _Txn:
    def __init__(self, cache: StageCache) -> None:
        self.base = cache
        self.nodes = cache.nodes.mutate()
        self.index = cache.index.mutate()
        self.snapshots = cache.snapshots.mutate()
        self.marks = cache.snapshot_marks.mutate()
        self.claims = cache.claims.mutate()
        self.free_runs: list[SlotRun] = list(cache.free_runs)
        self.num_free = cache.num_free
        self.num_cached = cache.num_cached
        self.num_protected = cache.num_protected
        self.num_allocated = cache.num_allocated
        self.num_escrowed = cache.num_escrowed
        self.clock = cache.clock + 1
        self.next_node_id = cache.next_node_id
        self.key = cache.eviction.key
        self.evictable = cache.eviction.evictable
        self._victims: list[tuple[tuple, NodeId]] | None = None  # copied on first change
        self.snapshot_free: list[SlotRun] = list(cache.snapshot_free)
        self.num_snapshot_free = cache.num_snapshot_free
        self.num_snapshot_pending = cache.num_snapshot_pending
        self._snapshot_lru: list[tuple[int, BlockHash]] | None = None

    def finish(self) -> StageCache:
        victims = self.base.victims if self._victims is None else tuple(self._victims)
        lru = self.base.snapshot_lru if self._snapshot_lru is None else tuple(self._snapshot_lru)
        return attrs.evolve(
            self.base,
            nodes=self.nodes.finish(),
            index=self.index.finish(),
            snapshots=self.snapshots.finish(),
            snapshot_marks=self.marks.finish(),
            claims=self.claims.finish(),
            free_runs=tuple(self.free_runs),
            num_free=self.num_free,
            num_cached=self.num_cached,
            num_protected=self.num_protected,
            num_allocated=self.num_allocated,
            num_escrowed=self.num_escrowed,
            clock=self.clock,
            next_node_id=self.next_node_id,
            victims=victims,
            snapshot_free=tuple(self.snapshot_free),
            num_snapshot_free=self.num_snapshot_free,
            num_snapshot_pending=self.num_snapshot_pending,
            snapshot_lru=lru,
        )

    # -- tables -------------------------------------------------------------------

    def node(self, node_id: NodeId) -> Node:
        return self.nodes[node_id]  # type: ignore[index]

    def put(self, node: Node) -> None:
        """Store a node; the only way a node changes, so the victim order stays exact."""
        old = self.nodes.get(node.node_id)
        self.nodes[node.node_id] = node
        self._reorder(old, node)

    def drop(self, node_id: NodeId) -> None:
        old = self.nodes.get(node_id)
        del self.nodes[node_id]
        self._reorder(old, None)

    def _is_victim(self, node: Node | None) -> bool:
        return node is not None and node.node_id != ROOT and self.evictable(node) > 0

    def _reorder(self, old: Node | None, new: Node | None) -> None:
        was, now = self._is_victim(old), self._is_victim(new)
        if not was and not now:
            return
        old_entry = (self.key(old), old.node_id) if was else None  # type: ignore[union-attr]
        new_entry = (self.key(new), new.node_id) if now else None  # type: ignore[union-attr]
        if old_entry == new_entry:
            return
        if self._victims is None:
            self._victims = list(self.base.victims)
        if old_entry is not None:
            at = bisect.bisect_left(self._victims, old_entry)
            if at == len(self._victims) or self._victims[at] != old_entry:
                raise InvariantError(f"node {old.node_id} missing from the victim order")  # type: ignore[union-attr]
            del self._victims[at]
        if new_entry is not None:
            bisect.insort(self._victims, new_entry)

    def next_victim(self) -> NodeId | None:
        victims = self.base.victims if self._victims is None else self._victims
        return victims[0][1] if victims else None

    def claim(self, request_id: RequestId) -> Claim | None:
        return self.claims.get(request_id)

    # -- pins: "keep the first n blocks of node X" ------------------------------------

    def add_pin(self, node_id: NodeId, n: int) -> None:
        """Pin n blocks of a node; if the node was unpinned, pin its attach in the parent."""
        while node_id != ROOT:
            node = self.node(node_id)
            old = node.pins[-1] if node.pins else 0
            pins = list(node.pins)
            bisect.insort(pins, n)
            self.put(attrs.evolve(node, pins=tuple(pins)))
            self.num_protected += max(old, n) - old
            if node.pins:  # was protected already: ancestors are unchanged
                return
            node_id, n = node.parent, node.attach  # type: ignore[assignment]

    def remove_pin(self, node_id: NodeId, n: int) -> None:
        """Undo one ``add_pin(node_id, n)``."""
        while node_id != ROOT:
            node = self.node(node_id)
            pins = list(node.pins)
            at = bisect.bisect_left(pins, n)
            if at == len(pins) or pins[at] != n:
                raise InvariantError(f"node {node_id} has no pin of {n} blocks to remove")
            del pins[at]
            old = node.pins[-1]
            new = pins[-1] if pins else 0
            self.put(attrs.evolve(node, pins=tuple(pins)))
            self.num_protected -= old - new
            if pins:
                return
            node_id, n = node.parent, node.attach  # type: ignore[assignment]

    def move_hold(self, claim: Claim, tip: NodeId, tip_len: int) -> None:
        """Re-point a hold; pin first so shared ancestors never flicker unprotected."""
        if tip_len:
            self.add_pin(tip, tip_len)
        if claim.tip_len:
            self.remove_pin(claim.tip, claim.tip_len)

    def touch(self, node_id: NodeId) -> None:
        if node_id != ROOT:
            node = self.node(node_id)
            self.put(attrs.evolve(node, recency=self.clock, uses=node.uses + 1))

    def protected_prefix(self, hashes: Sequence[BlockHash], point: int) -> int:
        """Blocks 0..q-1 of this chain already protected by some hold (q ≤ point)."""
        if point == 0:
            return 0
        node = self.node(self.index[hashes[point - 1]])  # type: ignore[index]
        n = point - node.depth
        while node.node_id != ROOT:
            if node.pins:
                return node.depth + min(n, node.pins[-1])
            n = node.attach
            node = self.node(node.parent)  # type: ignore[arg-type]
        return 0

    def locate(self, hashes: Sequence[BlockHash], point: int) -> tuple[NodeId, int]:
        """(node, keep-length) of the block at position point-1; (ROOT, 0) for point 0."""
        if point == 0:
            return ROOT, 0
        node = self.node(self.index[hashes[point - 1]])  # type: ignore[index]
        return node.node_id, point - node.depth

    # -- slots --------------------------------------------------------------------

    def take_free(self, count: int) -> list[SlotId]:
        taken = _take_runs(self.free_runs, count)
        self.num_free -= len(taken)
        return taken

    def give_free(self, slots: Iterable[SlotId]) -> None:
        self.num_free += _give_runs(self.free_runs, slots)

    # -- the snapshot pool ----------------------------------------------------------

    def put_snapshot(self, block: BlockHash, snap: Snapshot | None) -> None:
        """Store (or with None remove) a snapshot; keeps the unpinned LRU order exact."""
        old = self.snapshots.get(block)
        if snap is None:
            del self.snapshots[block]
        else:
            self.snapshots[block] = snap
        if (old is None) != (snap is None):  # added or removed: the node's marks change
            node_id = self.index[block]  # type: ignore[index]
            marks = list(self.marks.get(node_id, ()))
            if snap is None:
                marks.remove(old.k)  # type: ignore[union-attr]
            else:
                bisect.insort(marks, snap.k)
            if marks:
                self.marks[node_id] = tuple(marks)
            else:
                del self.marks[node_id]
        old_entry = (old.recency, block) if old is not None and not old.pins else None
        new_entry = (snap.recency, block) if snap is not None and not snap.pins else None
        if old_entry == new_entry:
            return
        if self._snapshot_lru is None:
            self._snapshot_lru = list(self.base.snapshot_lru)
        if old_entry is not None:
            at = bisect.bisect_left(self._snapshot_lru, old_entry)
            if at == len(self._snapshot_lru) or self._snapshot_lru[at] != old_entry:
                raise InvariantError(f"snapshot {block:#x} missing from the snapshot LRU order")
            del self._snapshot_lru[at]
        if new_entry is not None:
            bisect.insort(self._snapshot_lru, new_entry)

    def drop_snapshot(self, block: BlockHash) -> None:
        """Remove the snapshot after this block, if any, and free its slot."""
        snap = self.snapshots.get(block)
        if snap is not None:
            self.put_snapshot(block, None)
            self.give_snapshot_slots([snap.slot])

    def pin_snapshot(self, block: BlockHash, delta: int) -> None:
        snap = self.snapshots.get(block)
        if snap is None or snap.pins + delta < 0:
            raise InvariantError(f"no snapshot after block {block:#x} to pin by {delta}")
        recency = self.clock if delta > 0 else snap.recency
        self.put_snapshot(block, attrs.evolve(snap, pins=snap.pins + delta, recency=recency))

    def take_snapshot_slot(self) -> SlotId | None:
        """A free snapshot slot, else the slot of the least recently used unpinned one."""
        if self.num_snapshot_free:
            self.num_snapshot_free -= 1
            return _take_runs(self.snapshot_free, 1)[0]
        lru = self.base.snapshot_lru if self._snapshot_lru is None else self._snapshot_lru
        if not lru:
            return None
        block = lru[0][1]
        slot = self.snapshots[block].slot  # type: ignore[index]
        self.put_snapshot(block, None)
        return slot

    def give_snapshot_slots(self, slots: Iterable[SlotId]) -> None:
        self.num_snapshot_free += _give_runs(self.snapshot_free, slots)

    # -- eviction -----------------------------------------------------------------

    def evict(self, count: int) -> tuple[list[SlotId], list[BlockHash]]:
        """Evict ``count`` blocks, taking victims in the cache's eviction order.

        The order (``StageCache.victims``) is kept sorted as nodes change, so each victim
        costs O(log n), not a pass over the tree. A snapshot goes with its block.
        """
        slots: list[SlotId] = []
        hashes: list[BlockHash] = []
        while count:
            node_id = self.next_victim()
            if node_id is None:
                raise InvariantError(
                    f"materialization needed {count} more blocks but nothing is evictable "
                    f"(cached {self.num_cached}, protected {self.num_protected})"
                )
            node = self.node(node_id)
            k = min(count, self.evictable(node))
            keep = len(node.hashes) - k
            gone = node.hashes[keep:]
            slots.extend(reversed(node.slots[keep:]))
            hashes.extend(reversed(gone))  # deepest first: the order of leaf-first eviction
            for block in gone:
                self.drop_snapshot(block)  # while the index still places it
                del self.index[block]
            self.num_cached -= k
            count -= k
            if keep:
                self.put(attrs.evolve(node, hashes=node.hashes[:keep], slots=node.slots[:keep]))
                continue
            # The node is gone; its parent inherits its recency (it was used through it).
            self.drop(node_id)
            parent = self.node(node.parent)  # type: ignore[arg-type]
            self.put(
                attrs.evolve(
                    parent,
                    children=parent.children.delete(node_id),
                    attaches=_without(parent.attaches, node.attach),
                    recency=max(parent.recency, node.recency),
                )
            )
        return slots, hashes

    # -- insertion ----------------------------------------------------------------

    def insert_after(
        self,
        tip: NodeId,
        tip_len: int,
        depth: int,
        hashes: Sequence[BlockHash],
        slots: Sequence[SlotId],
    ) -> NodeId:
        """Cache new blocks right after (tip, tip_len); returns the node now holding them.

        Appends to ``tip`` when the hold ends at its last block, else opens a child.
        The caller moves the hold afterwards.
        """
        node = self.node(tip)
        if tip != ROOT and tip_len == len(node.hashes):
            self.put(
                attrs.evolve(
                    node,
                    hashes=node.hashes + tuple(hashes),
                    slots=node.slots + tuple(slots),
                    recency=self.clock,
                )
            )
            target = tip
        else:
            target = NodeId(self.next_node_id)
            self.next_node_id += 1
            self.put(
                Node(
                    node_id=target,
                    parent=tip,
                    attach=tip_len,
                    depth=depth,
                    hashes=tuple(hashes),
                    slots=tuple(slots),
                    children=immutables.Map(),
                    pins=(),
                    recency=self.clock,
                )
            )
            self.put(attrs.evolve(node, children=node.children.set(target, tip_len),
                                  attaches=_with(node.attaches, tip_len)))  # fmt: skip
        for block in hashes:
            self.index[block] = target
        self.num_cached += len(hashes)
        return target


def _with(points: tuple[int, ...], point: int) -> tuple[int, ...]:
    """A sorted multiset with one more ``point``."""
    i = bisect.bisect_right(points, point)
    return (*points[:i], point, *points[i:])


def _without(points: tuple[int, ...], point: int) -> tuple[int, ...]:
    """A sorted multiset with one ``point`` fewer (it holds one)."""
    i = bisect.bisect_left(points, point)
    return points[:i] + points[i + 1 :]


def _take_runs(runs: list[SlotRun], count: int) -> list[SlotId]:
    """Take ``count`` slots (or all there are) from the end of a run list."""
    taken: list[SlotId] = []
    while count and runs:
        start, stop = runs[-1]
        k = min(count, stop - start)
        taken.extend(range(start, start + k))  # type: ignore[arg-type]
        if start + k == stop:
            runs.pop()
        else:
            runs[-1] = (start + k, stop)
        count -= k
    return taken


def _give_runs(runs: list[SlotRun], slots: Iterable[SlotId]) -> int:
    """Append the slots to a run list as runs; returns how many."""
    added: list[SlotRun] = []
    for slot in sorted(slots):
        if added and added[-1][1] == slot:
            added[-1] = (added[-1][0], slot + 1)
        else:
            added.append((slot, slot + 1))
    runs.extend(added)
    return sum(stop - start for start, stop in added)
