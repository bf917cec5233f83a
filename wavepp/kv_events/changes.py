"""Stage cache changes for KV events: each stage's log, and rank 0's pipeline view.

A stage's :class:`StageLog` follows its cache value through the calls that change what
is cached — a publish (blocks and snapshots stored), a materialization or an admission
round's commit (blocks evicted, and their snapshots with them), a snapshot reservation
(snapshots evicted for room) — and hands rank 0 the changes as a
:class:`~wavepp.rounds.messages.CacheReport` riding the next wave, as handoff outcomes
do. Each entry is a transition of the stage's *reported* view, so rank 0 keeps only a
count per block; pending changes are coalesced per block (the last one wins) and a
report takes at most ``limit`` of them, so everything stays bounded by the pools. A
report also checks the view's sizes against the cache and, should they ever differ (a
policy whose reducers change the cache elsewhere), re-reports the difference in full.

Rank 0's :class:`PipelineView` turns the reports into vLLM KV events (docs/fleet.md):

- group 0 (``full_attention``): a block is stored when *every* stage holds it, removed
  when *any* drops it;
- group 1 (``mamba``, hybrids only): the reuse point after block h — stored when every
  stage holds h and every stage with L layers holds a snapshot after h, removed when any
  of that stops.

The largest point admission grants is then the largest k ≤ the probe limit with blocks
0..k-1 in group 0 and, for a hybrid, k = 0 or block k-1 in group 1 (DESIGN §4).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np

from wavepp.kv_events.events import (
    ATTENTION_GROUP,
    SNAPSHOT_GROUP,
    Event,
    removed,
    stored,
)
from wavepp.rounds.messages import MAX_REPORT_HASHES, CacheReport, pack_hashes, unpack_hashes
from wavepp.state import BlockHash, StageCache

TokensOf = Callable[[BlockHash], tuple[BlockHash | None, bytes] | None]
#  a block's parent and token ids (<i4 bytes), when known

MAX_WAVE_HASHES = 1 << 20  # hashes of all stages' reports on one wave (8 MiB packed)

BLOCK, SNAPSHOT = 0, 1  # the two kinds of thing a stage reports


def report_limit(num_stages: int) -> int:
    """Hashes one stage's report may carry, so that a wave's reports stay ≤ 8 MiB."""
    return max(1024, min(MAX_REPORT_HASHES, MAX_WAVE_HASHES // max(num_stages, 1)))


class StageLog:
    """One stage's cache changes not yet reported to rank 0."""

    def __init__(self, stage: int, recurrent: bool, limit: int = MAX_REPORT_HASHES) -> None:
        self.stage = stage
        self.recurrent = recurrent
        self.limit = limit
        self._reported: tuple[set[BlockHash], set[BlockHash]] = (set(), set())
        self._pending: dict[tuple[int, BlockHash], bool] = {}  # (kind, hash) -> present
        self._size = [0, 0]  # sizes of the view with the pending changes applied
        self.num_resyncs = 0  # reports that found the view off and re-reported it
        self.tokens: dict[BlockHash, tuple[BlockHash | None, bytes]] = {}
        #  with token ids (stage 0 on rank 0): block -> (parent, its tokens as <i4 bytes),
        #  for every block in the view or pending; what a BlockStored event carries

    # -- what the stage calls ---------------------------------------------------------

    def published(self, before: StageCache, after: StageCache, hashes: Sequence[BlockHash],
                  start: int, end: int, tokens: np.ndarray | None = None,
                  block_size: int = 0) -> None:  # fmt: skip
        """A publish of blocks ``start..end-1`` (and snapshots at ``start+1..end``)."""
        for i in range(start, end):
            block = hashes[i]
            if block in after.index and block not in before.index:
                self._set(BLOCK, block, True)
                if tokens is not None:
                    parent = hashes[i - 1] if i else None
                    ids = tokens[i * block_size : (i + 1) * block_size]
                    self.tokens[block] = (parent, np.asarray(ids, dtype="<i4").tobytes())
        if after.has_recurrent:
            for k in range(max(start, 1), end + 1):
                block = hashes[k - 1]
                if block in after.snapshots and block not in before.snapshots:
                    self._set(SNAPSHOT, block, True)

    def evicted(self, blocks: Iterable[BlockHash]) -> None:
        """Blocks a materialization or a round evicted; their snapshots went with them."""
        for block in blocks:
            self._set(SNAPSHOT, block, False)
            self._set(BLOCK, block, False)

    def snapshots_evicted(self, before: StageCache, after: StageCache) -> None:
        """After a snapshot reservation: the snapshots it evicted to make room."""
        gone = len(before.snapshots) - len(after.snapshots)
        if gone <= 0:
            return
        # The default reservation takes the least recently used unpinned ones: look there
        # first, then anywhere (a policy of its own may choose otherwise).
        found: set[BlockHash] = set()
        order = (h for _, h in before.snapshot_lru)
        for candidates in (order, iter(before.snapshots.keys())):
            for block in candidates:
                if block not in after.snapshots and block not in found:
                    found.add(block)
                    self._set(SNAPSHOT, block, False)
                    if len(found) == gone:
                        return

    # -- the report -------------------------------------------------------------------

    def take(self, cache: StageCache) -> CacheReport | None:
        """The changes since the last report (at most ``limit``), or None if there are none."""
        if self._size != [cache.num_cached, len(cache.snapshots) if cache.has_recurrent else 0]:
            self._resync(cache)
        if not self._pending:
            return None
        lists: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
        taken = []
        for key, present in self._pending.items():
            if len(taken) == self.limit:
                break
            kind, block = key
            taken.append(key)
            lists[2 * kind + (not present)].append(block)
            view = self._reported[kind]
            if present:
                view.add(block)
            else:
                view.discard(block)
                if kind == BLOCK:
                    self.tokens.pop(block, None)
        for key in taken:
            del self._pending[key]
        return CacheReport(self.stage, self.recurrent, *(pack_hashes(x) for x in lists))

    def _set(self, kind: int, block: BlockHash, present: bool) -> None:
        key = (kind, block)
        was = self._pending.get(key, block in self._reported[kind])
        if was == present:
            return
        self._size[kind] += 1 if present else -1
        reported = block in self._reported[kind]
        if present == reported:
            del self._pending[key]  # back to what rank 0 knows
        else:
            self._pending[key] = present
        if kind == BLOCK and not present and not reported:
            self.tokens.pop(block, None)  # stored and gone before any report

    def _resync(self, cache: StageCache) -> None:
        """The view with its pending changes differs from the cache: set every pending
        change to what the cache holds (a pass over the cache; never on the default
        policy's path)."""
        self.num_resyncs += 1
        now = (cache.index, cache.snapshots if cache.has_recurrent else {})
        for kind in (BLOCK, SNAPSHOT):
            view, held = self._reported[kind], now[kind]
            for block in [*view, *(b for k, b in self._pending if k == kind)]:
                self._set(kind, block, block in held)
            for block in held:
                self._set(kind, block, True)


class PipelineView:
    """Rank 0: per block, the stages holding it (and snapshots after it); the blocks every
    stage holds and, for hybrids, the points every L stage can resume from, as events."""

    def __init__(self, num_stages: int, block_size: int, tokens: TokensOf) -> None:
        self.num_stages = num_stages
        self.block_size = block_size
        self._tokens = tokens  # stage 0's log: a block's parent and token ids
        self._holders: dict[BlockHash, int] = {}  # block -> stages holding it (> 0)
        self._snapshots: dict[BlockHash, int] = {}  # block -> L stages with a snapshot
        self._recurrent: dict[int, bool] = {}  # stage -> has L layers, from its reports
        self.blocks: set[BlockHash] = set()  # announced in group 0
        self.points: set[BlockHash] = set()  # announced in group 1

    @property
    def hybrid(self) -> bool:
        return any(self._recurrent.values())

    def apply(self, reports: Iterable[CacheReport]) -> list[Event]:
        """Count the reports in; the events that change what is announced, in order."""
        out: list[Event] = []
        for report in reports:
            self._recurrent[report.stage] = report.recurrent
            touched: list[BlockHash] = []
            for packed, table, delta in (
                (report.snapshots_removed, self._snapshots, -1),
                (report.removed, self._holders, -1),
                (report.stored, self._holders, +1),
                (report.snapshots_stored, self._snapshots, +1),
            ):
                for block in unpack_hashes(packed):
                    count = table.get(block, 0) + delta
                    if count > 0:
                        table[block] = count
                    else:
                        table.pop(block, None)
                    touched.append(block)
            self._announce(touched, out)
        return out

    def _announce(self, touched: list[BlockHash], out: list[Event]) -> None:
        num_stages = self.num_stages
        num_recurrent = sum(self._recurrent.values())
        gone_points, gone_blocks, new_blocks, new_points = [], [], [], []
        seen = set()
        for block in touched:
            if block in seen:
                continue
            seen.add(block)
            everywhere = self._holders.get(block, 0) == num_stages
            point = everywhere and num_recurrent > 0 and (
                self._snapshots.get(block, 0) == num_recurrent)
            if block in self.points and not point:
                self.points.discard(block)
                gone_points.append(block)
            if block in self.blocks and not everywhere:
                self.blocks.discard(block)
                gone_blocks.append(block)
            if everywhere and block not in self.blocks:
                self.blocks.add(block)
                new_blocks.append(block)
            if point and block not in self.points:
                self.points.add(block)
                new_points.append(block)
        if gone_points:
            out.append(removed(gone_points, SNAPSHOT_GROUP))
        if gone_blocks:
            out.append(removed(gone_blocks, ATTENTION_GROUP))
        out.extend(self._runs(new_blocks, ATTENTION_GROUP))
        out.extend(self._runs(new_points, SNAPSHOT_GROUP))

    def _runs(self, blocks: list[BlockHash], group: int) -> list[Event]:
        """BlockStored events: one per run of consecutive blocks of one chain."""
        out: list[Event] = []
        run: list[BlockHash] = []
        ids: list[int] = []
        first_parent: BlockHash | None = None
        for block in blocks:
            parent, tokens = self._tokens(block) or (None, b"")
            if run and parent != run[-1]:
                out.append(stored(run, first_parent, ids, self.block_size, group))
                run, ids = [], []
            if not run:
                first_parent = parent
            run.append(block)
            ids.extend(np.frombuffer(tokens, dtype="<i4").tolist())
        if run:
            out.append(stored(run, first_parent, ids, self.block_size, group))
        return out


class Announcer:
    """Rank 0: the stages' reports in, KV-event batches out (one batch per call that
    changes what is announced)."""

    def __init__(self, view: PipelineView, publish: Callable[[list[Event]], object],
                 info: dict) -> None:  # fmt: skip
        self.view = view
        self._publish = publish  # EventPublisher.publish
        self.info = info  # what GET /v1/models says of the events: endpoint, replay, topic

    def report(self, reports: Iterable[CacheReport | None]) -> None:
        events = self.view.apply(r for r in reports if r is not None)
        if events:
            self._publish(events)
