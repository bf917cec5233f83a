"""The per-rank tasks (DESIGN §3): WAVE (admission) and LOOP (execution).

Every rank runs one anyio event loop. Blocking ``torch.distributed`` calls run in worker
threads, so a pending data-plane receive never stalls an admission round and the other
way round. Rank 0 also owns the requests: it releases them by the workload's rules,
opens admission rounds, plans waves and collects completions.

Rungs (DESIGN §8) are configurations of this one runtime:

- ``R1``: rank 0's LOOP admits inline, one request per round, with the linear walk and
  eager allocation — admission sits on the execution path.
- ``R2``: the WAVE task admits in batched rounds off the path; still eager.
- ``R3``/``R4``/``R5``: hint + lease + escrow, materialized by each stage just before it
  first runs the request; static / MPU / cost planner.
- ``oracle``: rank 0 decides admissions locally for free, and the decisions ride along
  with the wave descriptors.
"""

from __future__ import annotations

import math
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence

import anyio
import attrs

from wavepp.exec.base import StageOutput
from wavepp.exec.planes import Link, TorchRoundsPlane
from wavepp.exec.stage import Admitted, Stage, offer_from_entry
from wavepp.plan import CostFit, Pending, PlanContext, Planner, Wave, cost_plan, observe
from wavepp.rounds.admission import Offer, Policy, probe_points, run_round
from wavepp.rounds.messages import (
    MAX_MESSAGE_BYTES,
    AdmitEntry,
    AdmitRound,
    Cancel,
    ChunkMsg,
    Finished,
    Heartbeat,
    OracleAdmit,
    RoundMessage,
    Stop,
    WaveDone,
    WaveMsg,
    decode_untrusted,
    encode,
    pack_hashes,
)
from wavepp.state import RequestId, block_hashes, escrow, lease, num_blocks_for, release
from wavepp.workload import RequestSpec


class Signal:
    """Wake every waiter on any change; waiters re-check their condition."""

    def __init__(self) -> None:
        self._event = anyio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = anyio.Event()

    async def wait(self, timeout: float | None = None) -> None:
        event = self._event
        if timeout is None:
            await event.wait()
        else:
            with anyio.move_on_after(timeout):
                await event.wait()


@attrs.define
class Record:
    """Rank 0's book on one request."""

    spec: RequestSpec
    offer: Offer
    released_at: float | None = None  # entered the waiting queue (its arrival)
    admitted_at: float | None = None
    done_at: float | None = None
    cached_tokens: int = 0
    first_token: int = -1
    top_logit: float = 0.0
    error: str | None = None
    cancelled: bool = False  # a cancel was asked for; settled when every stage dropped it


@attrs.frozen
class RankConfig:
    rung: str
    block_size: int
    budget: int
    min_budget: int
    ring: int
    concurrency: int
    max_batch: int
    heartbeat_s: float
    progress: bool


def eager(rung: str) -> bool:
    return rung in ("R1", "R2")


# -- ranks other than 0 --------------------------------------------------------------


async def follow_rounds(plane: TorchRoundsPlane, stage: Stage, policy: Policy) -> None:
    """WAVE on ranks > 0: take part in every round rank 0 opens, until Stop."""
    while True:
        message = decode_untrusted(await plane.broadcast(None), RoundMessage)
        if isinstance(message, Stop):
            return
        if isinstance(message, Cancel):
            for rid in message.request_ids:
                stage.drop(RequestId(rid))
        elif isinstance(message, AdmitRound):
            offers = [offer_from_entry(e) for e in message.entries]
            result = await run_round(plane, stage.book, offers, policy)
            for offer, ok, point in zip(offers, result.admitted, result.points, strict=True):
                if ok:
                    stage.register(Admitted(offer, point))
            stage.executor.forget(result.evicted)


async def follow_waves(
    stage: Stage, inbound: Link, outbound: Link | None, done: Link | None
) -> None:
    """LOOP on ranks > 0: receive, execute, send on — three tasks joined by streams."""
    to_worker_send, to_worker = anyio.create_memory_object_stream(math.inf)
    to_sender_send, to_sender = anyio.create_memory_object_stream(math.inf)

    async def receiver() -> None:
        async with to_worker_send:
            while True:
                raw, tensor = await inbound.recv(MAX_MESSAGE_BYTES)
                wave = decode_untrusted(raw, WaveMsg)
                await to_worker_send.send((wave, tensor))
                if wave.stop:
                    return

    async def worker() -> None:
        async with to_worker, to_sender_send:
            async for wave, tensor in to_worker:
                if wave.stop:
                    if outbound is not None:
                        await to_sender_send.send((encode(wave), None, outbound))
                    else:
                        await to_sender_send.send(
                            (encode(WaveDone(wave.wave_id, [], stop=True)), None, done)
                        )
                    return
                output, ended = await stage.execute(wave, tensor)
                if outbound is not None:
                    await to_sender_send.send((encode(wave), output.activations, outbound))
                else:
                    message = WaveDone(
                        wave.wave_id, _finished(output, ended), cancelled=wave.cancels
                    )
                    await to_sender_send.send((encode(message), None, done))

    async def sender() -> None:
        async with to_sender:
            async for raw, tensor, link in to_sender:
                await link.send(raw, tensor)

    async with anyio.create_task_group() as tg:
        tg.start_soon(receiver)
        tg.start_soon(worker)
        tg.start_soon(sender)


def _finished(output: StageOutput, ended: list[tuple[RequestId, int]]) -> list[Finished]:
    out = []
    for rid, cached in ended:
        token, logit = output.results.get(rid, (-1, 0.0))
        out.append(Finished(rid, cached, token, logit))
    return out


# -- rank 0 --------------------------------------------------------------------------


class Coordinator:
    """Rank 0: requests, admission rounds, the plan, stage 0's LOOP, completions."""

    def __init__(
        self,
        config: RankConfig,
        plane: TorchRoundsPlane,
        stage: Stage,
        outbound: Link | None,
        done: Link | None,
        specs: list[RequestSpec],
        planner: Planner,
        policy: Policy,
        min_capacity: int,
        log: Callable[[str], None],
        cost_fit: CostFit | None = None,
    ) -> None:
        self.cfg = config
        self.plane = plane
        self.stage = stage
        self.outbound = outbound
        self.done_link = done
        self.planner = planner
        self.cost_fit = cost_fit  # R5: the cost planner's online fit of stage time
        self.policy = policy
        self.log = log
        self.world = plane.world_size
        self.records: dict[RequestId, Record] = {}
        for spec in specs:
            hashes = block_hashes(spec.tokens, config.block_size)
            limit = (spec.num_tokens - 1) // config.block_size
            self.records[RequestId(spec.request_id)] = Record(
                spec, Offer(RequestId(spec.request_id), spec.num_tokens, hashes, limit)
            )
        self.min_capacity = min_capacity
        self.waiting: deque[RequestId] = deque()
        self.queue: list[Pending] = []  # admitted, with unplanned tokens
        self.oracle_admits: list[OracleAdmit] = []
        self.in_round: set[RequestId] = set()  # offered to the admission round under way
        self.pending_cancels: list[RequestId] = []  # admitted, to drop with the next wave
        self.scheduled_cancels: list[tuple[RequestId, float]] = []  # (id, seconds after start)
        self.in_flight = 0
        self.wave_id = 0
        self.round_id = 0
        self.outstanding = 0
        self.capacity_epoch = 0  # bumped by every completion
        self.refused_at_epoch: int | None = None  # admission blocked until epoch moves
        self.round_epoch = 0  # capacity_epoch when the current round started
        self.changed = Signal()
        self.stopping = False
        self.unfinished = 0
        self.round_seconds: list[float] = []
        self.round_spans: list[tuple[float, float, int]] = []  # (start, end, requests) wall
        self.measure_start: float | None = None
        self.measure_end: float | None = None

    # -- requests -----------------------------------------------------------------

    def _release(self, rid: RequestId) -> None:
        record = self.records[rid]
        if record.done_at is not None:  # cancelled before it arrived
            return
        record.released_at = time.time()
        blocks = num_blocks_for(record.offer.num_tokens, self.cfg.block_size)
        if blocks > self.min_capacity:
            record.error = (
                f"prompt of {record.offer.num_tokens:,} tokens needs {blocks:,} blocks; "
                f"the smallest stage pool holds {self.min_capacity:,}"
            )
            record.done_at = record.released_at
            self.log(f"rejected {rid}: {record.error}")
            return
        self.outstanding += 1
        self.unfinished += 1
        self.waiting.append(rid)
        self.changed.notify()

    async def feed(self) -> None:
        """Release warm-up requests, wait for them, then the measured ones."""
        specs = [r.spec for r in self.records.values()]
        for phase in (True, False):
            rids = [RequestId(s.request_id) for s in specs if s.warmup == phase]
            if not rids:
                continue
            if not phase:
                self.measure_start = time.time()
                for rid, after in self.scheduled_cancels:
                    self._task_group.start_soon(self._cancel_later, rid, after)
            open_loop = not phase and any(self.records[r].spec.arrival_s is not None for r in rids)
            if open_loop:
                await self._feed_open(rids)
            else:
                await self._feed_closed(rids, phase)
            while self.unfinished:
                await self.changed.wait()
        self.measure_end = time.time()

    async def _feed_closed(self, rids: list[RequestId], warmup: bool) -> None:
        todo = deque(rids)
        total, done_before = len(rids), self._num_done(rids)
        last_shown = 0.0
        while todo:
            while todo and self.outstanding < self.cfg.concurrency:
                self._release(todo.popleft())
            await self.changed.wait()
            last_shown = self._progress(rids, total, done_before, warmup, last_shown)
        while self.unfinished:
            await self.changed.wait()
            last_shown = self._progress(rids, total, done_before, warmup, last_shown)
        self._progress(rids, total, done_before, warmup, 0.0, final=True)

    async def _feed_open(self, rids: list[RequestId]) -> None:
        start = time.time()
        for rid in rids:
            delay = start + (self.records[rid].spec.arrival_s or 0.0) - time.time()
            if delay > 0:
                await anyio.sleep(delay)
            self._release(rid)

    def _num_done(self, rids: list[RequestId]) -> int:
        return sum(1 for r in rids if self.records[r].done_at is not None)

    def _progress(self, rids, total, done_before, warmup, last_shown, final=False) -> float:
        if not self.cfg.progress:
            return last_shown
        now = time.time()
        tty = sys.stderr.isatty()
        if not final and now - last_shown < (0.5 if tty else 10.0):  # logs get a line / 10 s
            return last_shown
        done = self._num_done(rids) - done_before
        width = 30
        fill = int(width * done / max(total, 1))
        label = "warm-up" if warmup else "measured"
        bar = "#" * fill + "." * (width - fill)
        start, end = ("\r", "\n" if final else "") if tty else ("", "\n")
        print(f"{start}[{bar}] {label} {done}/{total} in flight {self.in_flight}", end=end,
              file=sys.stderr, flush=True)  # fmt: skip
        return now

    # -- cancellation -------------------------------------------------------------

    def cancel(self, rid: RequestId, reason: str = "cancelled") -> bool:
        """Cancel a request wherever it is: queued, in an admission round, or running.

        Queued: dropped at once. Admitted or running: no more of its chunks are planned,
        and the next wave carries the cancel to every stage, which releases its lease,
        escrow, slots and references after the chunks already in flight. Returns False
        if the request is unknown or already over.
        """
        record = self.records.get(rid)
        if record is None or record.done_at is not None or record.cancelled:
            return False
        record.cancelled = True
        record.error = reason
        if rid in self.in_round:
            pass  # settled by _admit when the round returns
        elif rid in self.waiting:
            self.waiting.remove(rid)
            self._settle_cancel(rid)
        elif record.released_at is not None:
            self.queue = [p for p in self.queue if p.request_id != rid]
            self.pending_cancels.append(rid)
        else:  # not released yet: it never will be
            record.done_at = time.time()
        self.changed.notify()
        return True

    def _settle_cancel(self, rid: RequestId) -> None:
        record = self.records[rid]
        if record.done_at is None:
            record.done_at = time.time()
            self.outstanding -= 1
            self.unfinished -= 1
            self.capacity_epoch += 1
        self.changed.notify()

    def _complete(self, finished: list[Finished], cancelled: Sequence[str] = ()) -> None:
        for rid in cancelled:
            self._settle_cancel(RequestId(rid))
        now = time.time()
        for item in finished:
            record = self.records[RequestId(item.request_id)]
            if record.done_at is not None:
                continue
            if record.cancelled:  # its last chunk ran before the cancel reached it
                record.cancelled, record.error = False, None
            record.done_at = now
            record.cached_tokens = item.cached_tokens
            record.first_token = item.first_token
            record.top_logit = item.top_logit
            self.outstanding -= 1
            self.unfinished -= 1
        self.capacity_epoch += 1
        self.changed.notify()

    # -- admission ----------------------------------------------------------------

    def _admission_blocked(self) -> bool:
        return self.refused_at_epoch == self.capacity_epoch

    def _take_batch(self, limit: int) -> list[Offer]:
        # A refusal blocks retries until a completion *after the round started* frees
        # room; completions during the round count (else a refusal could wait forever).
        self.round_epoch = self.capacity_epoch
        batch = list(self.waiting)[:limit]
        self.in_round.update(batch)
        return [self.records[rid].offer for rid in batch]

    def _admit(
        self, offers: list[Offer], admitted: tuple[bool, ...], points: tuple[int, ...]
    ) -> None:
        now = time.time()
        self.in_round.clear()
        for offer, ok, point in zip(offers, admitted, points, strict=True):
            if not ok:
                self.refused_at_epoch = self.round_epoch
                break
            self.waiting.popleft()
            record = self.records[offer.request_id]
            record.admitted_at = now
            if record.cancelled:  # cancelled during its round: drop it on every stage
                self.pending_cancels.append(offer.request_id)
                continue
            self.queue.append(
                Pending(offer.request_id, point * self.cfg.block_size, offer.num_tokens)
            )
        for rid in list(self.waiting):  # cancelled while offered, and refused
            if self.records[rid].cancelled:
                self.waiting.remove(rid)
                self._settle_cancel(rid)
        self.changed.notify()

    async def _round(self, offers: list[Offer]) -> None:
        self.round_id += 1
        entries = [
            AdmitEntry(o.request_id, o.num_tokens, pack_hashes(o.hashes), o.probe_limit)
            for o in offers
        ]
        started = time.time()
        async with self.plane.lock:
            await self.plane.broadcast(encode(AdmitRound(self.round_id, entries)))
            result = await run_round(self.plane, self.stage.book, offers, self.policy)
        self.round_seconds.append(result.seconds)
        self.round_spans.append((started, time.time(), len(offers)))
        for offer, ok, point in zip(offers, result.admitted, result.points, strict=True):
            if ok:
                self.stage.register(Admitted(offer, point))
        self.stage.executor.forget(result.evicted)
        self._admit(offers, result.admitted, result.points)

    async def admitter(self) -> None:
        """WAVE on rank 0: batched rounds (async rungs) and heartbeats (every rung)."""
        inline = self.cfg.rung in ("R1", "oracle")
        last = time.monotonic()
        while not (self.stopping and not self.unfinished):
            if not inline and self.waiting and not self._admission_blocked():
                await self._round(self._take_batch(self.cfg.max_batch))
                last = time.monotonic()
                await anyio.sleep(0)  # let the LOOP plan before the next round
                continue
            await self.changed.wait(timeout=self.cfg.heartbeat_s)
            if time.monotonic() - last >= self.cfg.heartbeat_s:
                self.round_id += 1
                async with self.plane.lock:
                    await self.plane.broadcast(encode(Heartbeat(self.round_id)))
                last = time.monotonic()
        self.round_id += 1
        async with self.plane.lock:
            await self.plane.broadcast(encode(Stop(self.round_id, "all requests finished")))

    async def _admit_inline(self) -> None:
        if not self.waiting or self._admission_blocked():
            return
        if self.cfg.rung == "R1":
            while self.waiting and not self._admission_blocked():
                await self._round(self._take_batch(1))
            return
        # oracle: the same decisions for free — no collectives, applied by every stage.
        t0 = time.perf_counter()
        offers, points, flags = [], [], []
        for offer in self._take_batch(len(self.waiting)):
            cache = self.stage.book.cache
            point = probe_points(cache, [offer], self.policy, self.stage.book.probe_us)[0]
            cache, point = lease(cache, offer.request_id, offer.hashes, point)
            need = num_blocks_for(offer.num_tokens, self.cfg.block_size) - point
            cache, ok = escrow(cache, offer.request_id, need)
            if not ok:
                self.stage.book.cache = release(cache, offer.request_id)
                offers.append(offer)
                points.append(point)
                flags.append(False)
                break
            self.stage.book.cache = cache
            self.stage.register(Admitted(offer, point))
            entry = AdmitEntry(
                offer.request_id, offer.num_tokens, pack_hashes(offer.hashes), offer.probe_limit
            )
            self.oracle_admits.append(OracleAdmit(entry, point))
            offers.append(offer)
            points.append(point)
            flags.append(True)
        self.round_seconds.append(time.perf_counter() - t0)
        self._admit(offers, tuple(flags), tuple(points))

    # -- execution ----------------------------------------------------------------

    def _plan(self):
        ctx = PlanContext(self.cfg.budget, self.cfg.ring, self.cfg.min_budget)
        if self.cost_fit is not None:
            wave = cost_plan(self.queue, self.wave_id, ctx, self.cost_fit.model())
        else:
            wave = self.planner(self.queue, self.wave_id, ctx)
        if wave is None:
            return None
        if wave.num_tokens > wave.budget or wave.budget > self.cfg.budget:
            raise RuntimeError(f"planner broke the budget: {wave}")
        self.wave_id += 1
        by_id = {p.request_id: i for i, p in enumerate(self.queue)}
        for chunk in wave.chunks:
            i = by_id[chunk.request_id]
            if chunk.start != self.queue[i].next_token:
                raise RuntimeError(f"planner skipped tokens: {chunk} after {self.queue[i]}")
            self.queue[i] = Pending(chunk.request_id, chunk.end, chunk.num_tokens)
        self.queue = [p for p in self.queue if p.remaining > 0]
        return wave

    async def loop0(self) -> None:
        """LOOP on rank 0: admit inline (R1, oracle), plan, run stage 0, send on."""
        send_side, receive_side = anyio.create_memory_object_stream(math.inf)

        async def sender() -> None:
            async with receive_side:
                async for raw, tensor in receive_side:
                    await self.outbound.send(raw, tensor)

        async with anyio.create_task_group() as tg:
            if self.outbound is not None:
                tg.start_soon(sender)
            async with send_side:
                while True:
                    if self.cfg.rung in ("R1", "oracle"):
                        await self._admit_inline()
                    wave = self._plan() if self.in_flight < self.cfg.ring else None
                    if wave is None and self.pending_cancels:
                        wave = Wave(self.wave_id, 0, ())  # carries only the cancels
                        self.wave_id += 1
                    if wave is None:
                        if self.stopping and not self.unfinished:
                            break
                        await self.changed.wait()
                        continue
                    chunks = [
                        ChunkMsg(c.request_id, c.start, c.end, c.num_tokens,
                                 self.records[c.request_id].spec.warmup)
                        for c in wave.chunks
                    ]  # fmt: skip
                    message = WaveMsg(wave.wave_id, wave.budget, chunks, self.oracle_admits,
                                      cancels=self.pending_cancels)  # fmt: skip
                    self.oracle_admits, self.pending_cancels = [], []
                    self.in_flight += 1
                    output, ended = await self.stage.execute(message, None)
                    if self.cost_fit is not None and output.seconds and not chunks[0].free:
                        shape = [(c.end - c.start, c.start) for c in wave.chunks]
                        self.cost_fit = observe(self.cost_fit, shape, output.seconds)
                    if self.outbound is None:
                        self.in_flight -= 1
                        self._complete(_finished(output, ended), message.cancels)
                    else:
                        await send_side.send((encode(message), output.activations))
                if self.outbound is not None:
                    await send_side.send(
                        (encode(WaveMsg(self.wave_id, 0, [], [], stop=True)), None)
                    )

    async def completions(self) -> None:
        """Rank 0: waves leaving the last stage."""
        while True:
            raw, _ = await self.done_link.recv(MAX_MESSAGE_BYTES)
            message = decode_untrusted(raw, WaveDone)
            if message.stop:
                return
            self.in_flight -= 1
            self._complete(message.finished, message.cancelled)

    async def _cancel_later(self, rid: RequestId, after: float) -> None:
        await anyio.sleep(after)
        if self.cancel(rid):
            self.log(f"cancelled {rid} at {after:.3f} s")

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            self._task_group = tg
            tg.start_soon(self.admitter)
            tg.start_soon(self.loop0)
            if self.done_link is not None:
                tg.start_soon(self.completions)
            await self.feed()
            self.stopping = True
            self.changed.notify()
