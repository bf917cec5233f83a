"""Stage 0's LOOP on rank 0 (DESIGN §3): plan a wave, run stage 0, send it on; and the
completions that come back from the last stage."""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence

import anyio
import msgspec

from wavepp.exec.stage import Stage
from wavepp.fleet.changes import Announcer
from wavepp.plan import Wave
from wavepp.rounds.messages import (
    MAX_MESSAGE_BYTES,
    CacheReport,
    ChunkMsg,
    Finished,
    HandoffOutcome,
    WaveDone,
    WaveMsg,
    decode_untrusted,
    encode,
)
from wavepp.runtime.admitter import Admitter
from wavepp.runtime.followers import finished
from wavepp.runtime.intake import Intake
from wavepp.runtime.planning import WavePlanner
from wavepp.state import RequestId
from wavepp.transport.base import Link

CARRIER_S = 0.005  # while bands are awaited and no wave flows: an empty wave this often


class StageZero:
    def __init__(
        self, stage: Stage, planner: WavePlanner, admitter: Admitter, intake: Intake,
        outbound: Link | None, done: Link | None, ring: int, events: Announcer | None = None,
    ) -> None:  # fmt: skip
        self.stage = stage
        self.planner = planner
        self.admitter = admitter
        self.intake = intake
        self.outbound = outbound  # to stage 1; None when rank 0 is the only stage
        self.done_link = done  # from the last stage
        self.ring = ring
        self.events = events  # with --kv-events: every stage's cache changes -> KV events
        self.in_flight = 0  # waves sent and not yet back from the last stage
        self.pending_cancels: list[RequestId] = []  # admitted, to drop with the next wave
        self.measuring: dict[int, Wave] = {}  # measured waves in flight, for the cost fit
        self.sent: dict[int, tuple[Wave, float]] = {}  # waves in flight, sent when: their
        #                      chunks' blocks publish everywhere once they leave the last stage
        self.passage_s: deque[float] = deque(maxlen=16)  # recent send -> back, seconds
        self.pace: deque[tuple[int, float]] = deque(maxlen=32)  # recent measured waves:
        #                                     (tokens, seconds of the slowest stage)
        self._last_carrier = 0.0  # when the last empty wave left (_carrier_due)
        admitter.recompute_s = self._recompute_s
        admitter.work_ahead = self._work_ahead

    def complete(self, results: Sequence[Finished], cancelled: Sequence[str] = (),
                 handoffs: Sequence[HandoffOutcome] = (),
                 cache: Sequence[CacheReport] = ()) -> None:  # fmt: skip
        self._cache_changed(cache)
        for rid in cancelled:
            self.intake.settle_cancel(RequestId(rid))
        for item in results:
            self.intake.finish(RequestId(item.request_id), item.cached_tokens,
                               item.first_token, item.top_logit)  # fmt: skip
        for outcome in [*handoffs, *self.stage.take_handoff_outcomes()]:
            self.intake.handoff_settled(outcome)
        self.intake.changed.notify()

    def _cache_changed(self, cache: Sequence[CacheReport] = ()) -> None:
        """Stages 1..'s reports (riding the waves) and stage 0's own, into KV events."""
        if self.events is not None:
            self.events.report([*cache, self.stage.take_cache_report()])

    def _carrier_due(self) -> bool:
        """Bands of stages 1.. settle while no wave may be flowing; their outcomes ride
        to rank 0 on waves, so an empty wave goes every CARRIER_S while some are awaited."""
        if self.outbound is None or self.in_flight or not self.intake.awaiting_handoff:
            return False
        return time.monotonic() - self._last_carrier >= CARRIER_S

    def _next_wave(self) -> Wave | None:
        wave = None
        if self.in_flight < self.ring:
            budget = self.planner.ctx.budget * max(self.ring // 2, 1)  # enough to feed P
            wave = self.planner.next(self.in_flight, self.admitter.upcoming(budget),
                                     self.admitter.round_latency_s(), self._running())  # fmt: skip
        if wave is None and (self.pending_cancels or self._carrier_due()):
            wave = Wave(self.planner.take_wave_id(), 0, ())  # carries cancels / outcomes
            self._last_carrier = time.monotonic()
        return wave

    def _message(self, wave: Wave) -> WaveMsg:
        now = time.time()
        chunks = []
        for c in wave.chunks:
            record = self.intake.records[c.request_id]
            if record.first_chunk_at is None:
                record.first_chunk_at, record.status = now, "running"
            shared = self.admitter.sending(c.request_id, c.start, c.end)
            chunks.append(ChunkMsg(c.request_id, c.start, c.end, c.num_tokens,
                                   record.spec.warmup, shared))  # fmt: skip
        message = WaveMsg(wave.wave_id, wave.budget, chunks, self.admitter.take_oracle_admits(),
                          cancels=self.pending_cancels)  # fmt: skip
        self.pending_cancels = []
        return message

    async def run(self, finished_all: Callable[[], bool]) -> None:
        """Until ``finished_all()`` and nothing is left to plan."""
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
                    await self.admitter.admit_on_path()
                    wave = self._next_wave()
                    if wave is None:
                        own = self.stage.take_handoff_outcomes()
                        if own:  # stage 0's bands that settled while nothing else ran
                            self.complete((), (), own)
                        if finished_all():
                            break
                        awaiting = self.intake.awaiting_handoff or self.stage.handing_off
                        await self.intake.changed.wait(CARRIER_S if awaiting else None)
                        continue
                    message = self._message(wave)
                    self.in_flight += 1
                    self.sent[wave.wave_id] = (wave, time.monotonic())
                    output, ended = await self.stage.execute(message, None)
                    self._cache_changed()  # stage 0's evictions go out before the wave is back
                    if message.chunks and not message.chunks[0].free:
                        self.measuring[wave.wave_id] = wave
                    times = [self.stage.last_wave_s]
                    if self.outbound is None:
                        self.in_flight -= 1
                        self._observe(wave.wave_id, times)
                        self._published(wave.wave_id)
                        self.complete(finished(output, ended), message.cancels)
                    else:
                        message = msgspec.structs.replace(message, stage_s=times)
                        await send_side.send((encode(message), output.activations))
                if self.outbound is not None:
                    stop = WaveMsg(self.planner.take_wave_id(), 0, [], [], stop=True)
                    await send_side.send((encode(stop), None))

    async def completions(self) -> None:
        """Waves leaving the last stage, until the stop wave comes back."""
        while True:
            raw, _ = await self.done_link.recv(MAX_MESSAGE_BYTES)
            message = decode_untrusted(raw, WaveDone)
            if message.stop:
                return
            self.in_flight -= 1
            self._observe(message.wave_id, message.stage_s)
            self._published(message.wave_id)
            self.complete(message.finished, message.cancelled, message.handoffs,
                          message.cache)  # fmt: skip

    def _published(self, wave_id: int) -> None:
        """A wave left the last stage: every stage ran it (waves run in the same order
        everywhere) and published its chunks' blocks; requests waiting for them may go."""
        sent = self.sent.pop(wave_id, None)
        if sent is not None:
            wave, at = sent
            if wave.chunks:
                self.passage_s.append(time.monotonic() - at)
            for chunk in wave.chunks:
                self.admitter.progress(chunk.request_id, chunk.end)

    def _running(self) -> int:
        """Requests with waves in the pipeline and nothing left to plan."""
        queued = {p.request_id for p in self.planner.queue}
        sent = {c.request_id for wave, _ in self.sent.values() for c in wave.chunks}
        return len(sent - queued)

    def _work_ahead(self) -> list[tuple[int, int]]:
        """(tokens, prefix) of the admitted work not yet planned, in planning order."""
        return [(p.remaining, p.next_token) for p in self.planner.queue]

    def _recompute_s(self, tokens: int, prefix: int, ahead: Sequence[tuple[int, int]]) -> float:
        """Seconds until a request admitted now would have computed ``tokens`` after
        ``prefix`` itself: the planner is first come first served, so the work
        ``ahead`` of it ((tokens, prefix) pairs: admitted and not yet planned, then the
        offers before it in its round) goes first, then its own tokens; its last chunk
        then takes a wave's passage through the pipeline. Work is timed at the
        pipeline's measured pace (tokens per second of the slowest stage over recent
        waves), else by the fitted cost model; the passage is the median measured
        send-to-back time of recent waves, else the predicted chunk time on every stage.
        A request waits for a producer at most this long."""
        total = self._time_of([*ahead, (tokens, prefix)])
        if self.passage_s:
            return total + statistics.median(self.passage_s)
        model = self.planner.cost_fit.model()
        last = model.wave([(min(tokens, self.planner.ctx.budget), prefix)])
        return total + (getattr(self.admitter.plane, "world_size", 1) - 1) * last

    def _time_of(self, work: Sequence[tuple[int, int]]) -> float:
        """Seconds the slowest stage takes for (tokens, prefix) work run back to back."""
        num_tokens = sum(t for t, _ in work)
        if num_tokens == 0:
            return 0.0
        measured = sum(t for t, _ in self.pace), sum(s for _, s in self.pace)
        if measured[0] and measured[1]:
            return num_tokens * measured[1] / measured[0]
        model = self.planner.cost_fit.model()
        waves = math.ceil(num_tokens / self.planner.ctx.budget)
        compute = sum(model.chunk(t, p) for t, p in work)
        return waves * model.d + max(compute, waves * model.floor)

    def _observe(self, wave_id: int, stage_s: Sequence[float]) -> None:
        """The slowest stage's whole time on a measured wave teaches the cost fit (it
        sets the pipeline's pace, runtime overheads included)."""
        wave = self.measuring.pop(wave_id, None)
        if wave is not None and stage_s:
            self.planner.observe(wave, max(stage_s))
            self.pace.append((wave.num_tokens, max(stage_s)))
