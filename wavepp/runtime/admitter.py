"""Rank 0's admission (DESIGN §3, §4): the WAVE task and the rung's admission mode.

- ``ROUNDS``: the WAVE task opens batched rounds on the rounds plane, off the
  execution path, whenever requests wait and room may have been freed.
- ``INLINE`` (R1): stage 0's LOOP admits one request per round before it plans.
- ``FREE`` (oracle): rank 0 decides alone, without collectives and without charging
  their time; the decisions ride with the next wave to every stage.

A refused head blocks admission until a request that held room ends (the intake's
``capacity_epoch`` moves): rounds are not re-run when nothing could have changed.
The WAVE task also beats on the rounds plane while idle, so the other ranks' rounds
followers see a live rank 0, and ends every rank's WAVE with ``Stop``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import anyio

from wavepp.exec.planes import TorchRoundsPlane
from wavepp.exec.stage import Admitted, Stage
from wavepp.rounds.admission import Offer, RoundCounters, RoundMode, probe_points, run_round
from wavepp.rounds.messages import (
    AdmitEntry,
    AdmitRound,
    Heartbeat,
    OracleAdmit,
    Stop,
    encode,
    pack_hashes,
)
from wavepp.rungs import Admission, Rung
from wavepp.runtime.intake import Intake
from wavepp.state import RequestId, attention_hit, num_blocks_for, probe

MISS_REASONS = ("no snapshot near the hit", "evicted", "in flight and not waited for",
                "stages disagreed", "cancelled")  # fmt: skip


def _entry(offer: Offer) -> AdmitEntry:
    return AdmitEntry(offer.request_id, offer.num_tokens, pack_hashes(offer.hashes),
                      offer.probe_limit)  # fmt: skip


class Admitter:
    def __init__(
        self, rung: Rung, plane: TorchRoundsPlane, stage: Stage, intake: Intake,
        mode: RoundMode, max_batch: int, heartbeat_s: float,
        on_admitted: Callable[[RequestId, int], None],
    ) -> None:  # fmt: skip
        self.rung = rung
        self.plane = plane
        self.stage = stage
        self.intake = intake
        self.mode = mode  # the rung's reservation mode and the policy in use
        self.max_batch = max_batch
        self.heartbeat_s = heartbeat_s
        self.on_admitted = on_admitted  # (request, agreed point in blocks): plan it
        self.in_round: set[RequestId] = set()  # offered to the round under way
        self.refused_at_epoch: int | None = None  # blocked until the capacity epoch moves
        self.oracle_admits: list[OracleAdmit] = []  # FREE: to ride with the next wave
        self.round_id = 0
        self.round_seconds: list[float] = []  # wall seconds of each round
        self.round_cpu_s: list[float] = []  # rank 0's process CPU seconds during each round
        self.round_spans: list[tuple[float, float, int]] = []  # (start, end, requests) wall
        self.counters = RoundCounters()  # disagreements, roll-backs, fallbacks: summed
        self.stopping = False
        # Blocks of admitted, unfinished prompts: a prefix among them is being computed.
        self.live_blocks: dict[int, int] = {}  # block hash -> live requests holding it
        self._seen_here: dict[RequestId, tuple[int, int]] = {}  # rank 0's (hit, point)

    # -- shared by every mode ---------------------------------------------------------

    def blocked(self) -> bool:
        return self.refused_at_epoch == self.intake.capacity_epoch

    def ready(self) -> bool:
        return bool(self.intake.waiting) and not self.blocked()

    def _offers(self, limit: int) -> tuple[list[Offer], int]:
        # The epoch is read when the round starts: a request ending during the round
        # unblocks the next one (else a refusal could wait forever).
        batch = self.intake.waiting.head(limit)
        self.in_round.update(batch)
        cache = self.stage.book.cache
        for rid in batch:  # rank 0's own view, to explain a miss afterwards
            record = self.intake.records[rid]
            if record.spec.expected_reuse > 0:
                o = record.offer
                self._seen_here[rid] = (attention_hit(cache, o.hashes, o.probe_limit),
                                        probe(cache, o.hashes, o.probe_limit))  # fmt: skip
        return [self.intake.records[rid].offer for rid in batch], self.intake.capacity_epoch

    def _explain(self, rid: RequestId, point: int) -> str | None:
        """Why a request expecting reuse got less than 80% of it (rank 0's view), or None."""
        record = self.intake.records[rid]
        seen = self._seen_here.pop(rid, None)
        expected = record.spec.expected_reuse // self.mode.block_size
        if seen is None or point >= 0.8 * expected:
            return None
        hit, local = seen
        hashes = record.offer.hashes
        if local > point:
            return "stages disagreed"  # rank 0 could serve more than the agreed point
        if hit > local:
            return "no snapshot near the hit"
        if point < len(hashes) and self.live_blocks.get(hashes[point], 0):
            return "in flight and not waited for"
        return "evicted"

    def ended(self, rid: RequestId) -> None:
        """A request left the stages: its blocks are no longer being computed."""
        offer = self.intake.records[rid].offer
        if self.intake.records[rid].admitted_at is None:
            return
        for block in offer.hashes:
            left = self.live_blocks.get(block, 0) - 1
            if left > 0:
                self.live_blocks[block] = left
            else:
                self.live_blocks.pop(block, None)

    def _apply(
        self, offers: Sequence[Offer], admitted: Sequence[bool], points: Sequence[int], epoch: int
    ) -> None:
        """Apply a round's outcome. The policy's escrow order may admit offers that are
        not a prefix of the round (only FCFS's cut is); every refusal blocks further
        rounds until room is freed."""
        now = time.time()
        self.in_round.clear()
        taken = [o.request_id for o, ok in zip(offers, admitted, strict=True) if ok]
        if len(taken) < len(offers):
            self.refused_at_epoch = epoch
        self.intake.waiting.pop_admitted(taken)
        for offer, ok, point in zip(offers, admitted, points, strict=True):
            if not ok:
                self._seen_here.pop(offer.request_id, None)
                continue
            record = self.intake.records[offer.request_id]
            record.admitted_at, record.status = now, "admitted"
            record.miss_reason = self._explain(offer.request_id, point)
            for block in offer.hashes:
                self.live_blocks[block] = self.live_blocks.get(block, 0) + 1
            self.on_admitted(offer.request_id, point)
        for rid in self.intake.waiting.head():  # cancelled while offered, and refused
            if self.intake.records[rid].cancelled:
                self.intake.waiting.remove(rid)
                self.intake.settle_cancel(rid)
        self.intake.changed.notify()

    async def _round(self, limit: int) -> None:
        offers, epoch = self._offers(limit)
        self.round_id += 1
        started, cpu = time.time(), time.process_time()
        async with self.plane.lock:
            await self.plane.broadcast(
                encode(AdmitRound(self.round_id, [_entry(o) for o in offers]))
            )
            result = await run_round(self.plane, self.stage.book, offers, self.mode)
        self.round_seconds.append(result.seconds)
        self.round_cpu_s.append(time.process_time() - cpu)
        self.round_spans.append((started, time.time(), len(offers)))
        self.counters += result.counters
        for offer, ok, point in zip(offers, result.admitted, result.points, strict=True):
            if ok:
                self.stage.register(Admitted(offer, point))
        self.stage.executor.forget(result.evicted)
        self._apply(offers, result.admitted, result.points, epoch)

    def _admit_free(self) -> None:
        """The oracle: the same decisions as a round, on rank 0's cache, for free."""
        t0, cpu = time.perf_counter(), time.process_time()
        offers, epoch = self._offers(len(self.intake.waiting))
        book, p = self.stage.book, self.mode.policy
        flags, points = [], []
        for offer in offers:
            point = probe_points(book.cache, [offer], self.mode, book.probe_us)[0]
            cache, point = p.lease(book.cache, offer.request_id, offer.hashes, point)
            need = num_blocks_for(offer.num_tokens, self.mode.block_size) - point
            cache, ok = p.escrow(cache, offer.request_id, need)
            flags.append(ok)
            points.append(point)
            if not ok:
                book.cache = p.release(cache, offer.request_id)
                break
            book.cache = cache
            self.stage.register(Admitted(offer, point))
            self.oracle_admits.append(OracleAdmit(_entry(offer), point))
        self.round_seconds.append(time.perf_counter() - t0)
        self.round_cpu_s.append(time.process_time() - cpu)
        for offer in offers[len(flags) :]:  # not tried after the refusal: back to waiting
            self.in_round.discard(offer.request_id)
            self._seen_here.pop(offer.request_id, None)
        self._apply(offers[: len(flags)], flags, points, epoch)

    async def admit_on_path(self) -> None:
        """Called by stage 0's LOOP before it plans (INLINE and FREE modes)."""
        if self.rung.admission is Admission.INLINE:
            while self.ready():
                await self._round(1)
        elif self.rung.admission is Admission.FREE and self.ready():
            self._admit_free()

    def take_oracle_admits(self) -> list[OracleAdmit]:
        admits, self.oracle_admits = self.oracle_admits, []
        return admits

    # -- the WAVE task ------------------------------------------------------------------

    async def run(self) -> None:
        """Batched rounds (ROUNDS mode) and heartbeats (every mode), then Stop."""
        rounds = self.rung.admission is Admission.ROUNDS
        last = time.monotonic()
        while not (self.stopping and not self.intake.num_unfinished):
            if rounds and self.ready():
                await self._round(self.max_batch)
                last = time.monotonic()
                await anyio.sleep(0)  # let the LOOP plan before the next round
                continue
            await self.intake.changed.wait(timeout=self.heartbeat_s)
            if time.monotonic() - last >= self.heartbeat_s:
                self.round_id += 1
                async with self.plane.lock:
                    await self.plane.broadcast(encode(Heartbeat(self.round_id)))
                last = time.monotonic()
        self.round_id += 1
        async with self.plane.lock:
            await self.plane.broadcast(encode(Stop(self.round_id, "all requests finished")))
