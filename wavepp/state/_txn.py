"""A private scratchpad that builds the next ``StageCache`` from the current one.

Reducers are pure: they open a ``_Txn`` over the input value, edit persistent-map
mutations (one ``.mutate()`` per table, so a batch of edits costs one copy-on-write
pass) and local counters, and ``finish()`` into a new value. The input is never
touched; the transaction object never escapes a reducer.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable, Sequence

import attrs
import immutables

from wavepp.state.cache import Claim, Node, SlotRun, StageCache
from wavepp.state.errors import InvariantError
from wavepp.state.ids import ROOT, BlockHash, NodeId, RequestId, SlotId


class _Txn:
    def __init__(self, cache: StageCache) -> None:
        self.base = cache
        self.nodes = cache.nodes.mutate()
        self.index = cache.index.mutate()
        self.snapshots = cache.snapshots.mutate()
        self.claims = cache.claims.mutate()
        self.free_runs: list[SlotRun] = list(cache.free_runs)
        self.num_free = cache.num_free
        self.num_cached = cache.num_cached
        self.num_protected = cache.num_protected
        self.num_allocated = cache.num_allocated
        self.num_escrowed = cache.num_escrowed
        self.clock = cache.clock + 1
        self.next_node_id = cache.next_node_id

    def finish(self) -> StageCache:
        return attrs.evolve(
            self.base,
            nodes=self.nodes.finish(),
            index=self.index.finish(),
            snapshots=self.snapshots.finish(),
            claims=self.claims.finish(),
            free_runs=tuple(self.free_runs),
            num_free=self.num_free,
            num_cached=self.num_cached,
            num_protected=self.num_protected,
            num_allocated=self.num_allocated,
            num_escrowed=self.num_escrowed,
            clock=self.clock,
            next_node_id=self.next_node_id,
        )

    # -- tables -------------------------------------------------------------------

    def node(self, node_id: NodeId) -> Node:
        return self.nodes[node_id]  # type: ignore[index]

    def put(self, node: Node) -> None:
        self.nodes[node.node_id] = node

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
            self.put(attrs.evolve(node, recency=self.clock))

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
        taken: list[SlotId] = []
        while count and self.free_runs:
            start, stop = self.free_runs[-1]
            k = min(count, stop - start)
            taken.extend(range(start, start + k))  # type: ignore[arg-type]
            if start + k == stop:
                self.free_runs.pop()
            else:
                self.free_runs[-1] = (start + k, stop)
            count -= k
        self.num_free -= len(taken)
        return taken

    def give_free(self, slots: Iterable[SlotId]) -> None:
        runs: list[SlotRun] = []
        for slot in sorted(slots):
            if runs and runs[-1][1] == slot:
                runs[-1] = (runs[-1][0], slot + 1)
            else:
                runs.append((slot, slot + 1))
        self.free_runs.extend(runs)
        self.num_free += sum(stop - start for start, stop in runs)

    # -- eviction -----------------------------------------------------------------

    def evict(self, count: int) -> tuple[list[SlotId], list[BlockHash]]:
        """Evict ``count`` unprotected blocks, least recently used leaf tails first.

        Candidates come from the transaction's base value, so call this before
        inserting nodes in the same transaction. Ties in recency go to the older node.
        """
        heap = [
            (node.recency, node.node_id)
            for node in self.base.nodes.values()
            if node.num_evictable_now() > 0
        ]
        heapq.heapify(heap)
        slots: list[SlotId] = []
        hashes: list[BlockHash] = []
        while count:
            if not heap:
                raise InvariantError(
                    f"materialization needed {count} more blocks but nothing is evictable "
                    f"(cached {self.num_cached}, protected {self.num_protected})"
                )
            recency, node_id = heapq.heappop(heap)
            node = self.nodes.get(node_id)
            if node is None or node.num_evictable_now() == 0:
                continue  # stale entry
            if node.recency != recency:  # touched in this transaction: requeue
                heapq.heappush(heap, (node.recency, node_id))
                continue
            k = min(count, node.num_evictable_now())
            keep = len(node.hashes) - k
            gone = node.hashes[keep:]
            slots.extend(reversed(node.slots[keep:]))
            hashes.extend(reversed(gone))  # deepest first: the order of leaf-first eviction
            for block in gone:
                del self.index[block]
                self.snapshots.pop(block, None)
            self.num_cached -= k
            count -= k
            if keep:
                self.put(attrs.evolve(node, hashes=node.hashes[:keep], slots=node.slots[:keep]))
                continue
            # The node is gone; its parent inherits its recency (it was used through it).
            del self.nodes[node_id]
            parent = self.node(node.parent)  # type: ignore[arg-type]
            parent = attrs.evolve(
                parent,
                children=parent.children.delete(node_id),
                recency=max(parent.recency, node.recency),
            )
            self.put(parent)
            if parent.num_evictable_now() > 0:
                heapq.heappush(heap, (parent.recency, parent.node_id))
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
            self.put(attrs.evolve(node, children=node.children.set(target, tip_len)))
        for block in hashes:
            self.index[block] = target
        self.num_cached += len(hashes)
        return target
