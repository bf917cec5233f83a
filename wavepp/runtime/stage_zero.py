"""Stage 0's LOOP on rank 0 (DESIGN §3): plan a wave, run stage 0, send it on; and the
completions that come back from the last stage."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import anyio
import msgspec
import numpy as np

from wavepp.exec.stage import Ahead, Stage
from wavepp.kv_events.changes import Announcer
from wavepp.plan import Wave
from wavepp.rounds.messages import (
    MAX_MESSAGE_BYTES,
    CacheReport,
    ChunkMsg,
    Finished,
    HandoffOutcome,
    HandoffRelay,
    WaveDone,
    WaveMsg,
    decode_untrusted,
    encode,
)
from wavepp.runtime.admitter import Admitter
from wavepp.runtime.followers import finished
from wavepp.runtime.pace import Pace
from wavepp.runtime.planning import WavePlanner
from wavepp.runtime.table import RequestTable
from wavepp.state import RequestId
from wavepp.transport.base import Link


class StageZero:
    def __init__(
        self, stage: Stage, planner: WavePlanner, admitter: Admitter, table: RequestTable,
        pace: Pace, outbound: Link | None, done: Link | None, ring: int,
        events: Announcer | None = None, look_ahead: bool = False,
    ) -> None:  # fmt: skip
        """``look_ahead`` (admission in rounds, off the path): the next wave is planned and
        its cache effects done while this one's executor runs."""
        self.stage = stage
        self.planner = planner
        self.admitter = admitter
        self.table = table
        self.pace = pace  # learns each wave's passage and the slowest stage's time
        self.outbound = outbound  # to stage 1; None when rank 0 is the only stage
        self.done_link = done  # from the last stage
        self.ring = ring
        self.events = events  # with --kv-events: every stage's cache changes -> KV events
        self.look_ahead = look_ahead
        self.in_flight = 0  # waves sent and not yet back from the last stage
        self.pending_cancels: list[RequestId] = []  # admitted, to drop with the next wave
        self.measuring: dict[int, Wave] = {}  # measured waves in flight, for the cost fit
        self.sent: dict[int, tuple[Wave, float]] = {}  # waves in flight, sent when: their
        #                      chunks' blocks publish everywhere once they leave the last stage

    def drop_everywhere(self, rid: RequestId) -> None:
        """An admitted request was cancelled: the next wave drops it on every stage (after
        its chunks already in flight)."""
        self.pending_cancels.append(rid)

    def sizes(self) -> dict[str, int]:
        return {"pending_cancels": len(self.pending_cancels),
                "waves_in_flight": len(self.sent), "waves_measuring": len(self.measuring)}

    def complete(self, results: Sequence[Finished], cancelled: Sequence[str] = (),
                 handoffs: Sequence[HandoffOutcome] = (),
                 cache: Sequence[CacheReport] = ()) -> None:  # fmt: skip
        self._cache_changed(cache)
        for rid in cancelled:
            self.table.settle_cancel(RequestId(rid))
        for item in results:
            self.table.finish(RequestId(item.request_id), item.cached_tokens,
                              item.first_token, item.top_logit)  # fmt: skip
        for outcome in handoffs:
            self.table.handoff_settled(outcome)
        self.table.changed.notify()

    def _cache_changed(self, cache: Sequence[CacheReport] = ()) -> None:
        """Stages 1..'s reports (riding the waves) and stage 0's own, into KV events."""
        if self.events is not None:
            self.events.report([*cache, self.stage.take_cache_report()])

    def _next_wave(self) -> Wave | None:
        wave = None
        if self.in_flight < self.ring:
            budget = self.planner.ctx.budget * max(self.ring // 2, 1)  # enough to feed P
            wave = self.planner.next(self.in_flight, self.admitter.upcoming(budget),
                                     self.admitter.round_latency_s(), self._running())  # fmt: skip
        if wave is None and self.pending_cancels:
            wave = Wave(self.planner.take_wave_id(), 0, ())  # carries the cancels
        return wave

    def _message(self, wave: Wave) -> tuple[WaveMsg, dict[RequestId, np.ndarray]]:
        """The wave's descriptor (what every stage gets) and its requests' token ids from
        the request table (what stage 0 embeds)."""
        now = time.time()
        chunks, prompts = [], {}
        for c in wave.chunks:
            record = self.table.started(c.request_id, now)
            prompts[c.request_id] = record.spec.tokens
            shared = self.admitter.sending(c.request_id, c.start, c.end)
            chunks.append(ChunkMsg(c.request_id, c.start, c.end, c.num_tokens,
                                   record.spec.warmup, shared))  # fmt: skip
        message = WaveMsg(wave.wave_id, wave.budget, chunks, self.admitter.take_oracle_admits(),
                          cancels=self.pending_cancels)  # fmt: skip
        self.pending_cancels = []
        return message, prompts

    async def run(self, finished_all: Callable[[], bool]) -> None:
        """Until ``finished_all()`` and nothing is left to plan; stage 0's bands' outcomes
        go straight into the table as they settle meanwhile."""
        async with anyio.create_task_group() as tg:
            if self.stage.handoffs is not None:
                tg.start_soon(self._settlements)
            await self._waves(finished_all)
            tg.cancel_scope.cancel()

    async def _settlements(self) -> None:
        while True:
            self.complete((), handoffs=await self.stage.handoffs.settled())

    async def _plan(self, finished_all: Callable[[], bool]) -> Ahead:
        """The next wave, planned and counted in flight, with its message and prompts; a
        wave of None once ``finished_all()`` and nothing is left to plan."""
        while True:
            await self.admitter.admit_on_path()
            wave = self._next_wave()
            if wave is not None:
                break
            if finished_all():
                return Ahead(None)
            await self.table.changed.wait(None)  # outcomes notify it too
        message, prompts = self._message(wave)
        self.in_flight += 1
        self.sent[wave.wave_id] = (wave, time.monotonic())
        return Ahead(message, prompts=prompts, payload=wave)

    async def _waves(self, finished_all: Callable[[], bool]) -> None:
        send_side, receive_side = anyio.create_memory_object_stream(math.inf)

        async def sender() -> None:
            async with receive_side:
                async for raw, tensor in receive_side:
                    await self.outbound.send(raw, tensor)

        async def take() -> Ahead:
            return await self._plan(finished_all)

        ahead: Ahead | None = None  # the next wave, planned while one ran
        async with anyio.create_task_group() as tg:
            if self.outbound is not None:
                tg.start_soon(sender)
            async with send_side, anyio.create_task_group() as runs:
                while True:
                    ahead, current = None, ahead or await take()
                    message, prompts, wave = current.wave, current.prompts, current.payload
                    if message is None:
                        break
                    self.sent[wave.wave_id] = (wave, time.monotonic())  # its passage starts
                    prepared = (current.launched or current.prepared
                                or await self.stage.begin(message, prompts))  # fmt: skip
                    if self.look_ahead:
                        (output, ended), ahead = await self.stage.finish_looking_ahead(
                            prepared, None, take, runs)
                    else:
                        output, ended = await self.stage.finish(prepared, None)
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
            message = decode_untrusted(raw, WaveDone | HandoffRelay)
            if isinstance(message, HandoffRelay):
                self.complete((), (), message.handoffs)
                continue
            if message.stop:
                return
            self.in_flight -= 1
            self._observe(message.wave_id, message.stage_s)
            self._published(message.wave_id)
            self.complete(message.finished, message.cancelled, cache=message.cache)

    def _published(self, wave_id: int) -> None:
        """A wave left the last stage: every stage ran it (waves run in the same order
        everywhere) and published its chunks' blocks; requests waiting for them may go."""
        sent = self.sent.pop(wave_id, None)
        if sent is not None:
            wave, at = sent
            if wave.chunks:
                self.pace.passed(time.monotonic() - at)
            for chunk in wave.chunks:
                self.admitter.progress(chunk.request_id, chunk.end)

    def _running(self) -> int:
        """Requests with waves in the pipeline and nothing left to plan."""
        queued = {p.request_id for p in self.planner.queue}
        sent = {c.request_id for wave, _ in self.sent.values() for c in wave.chunks}
        return len(sent - queued)

    def _observe(self, wave_id: int, stage_s: Sequence[float]) -> None:
        """The slowest stage's whole time on a measured wave teaches the cost fit (it
        sets the pipeline's pace, runtime overheads included)."""
        wave = self.measuring.pop(wave_id, None)
        if wave is not None and stage_s:
            self.planner.observe(wave, max(stage_s))
            self.pace.measured(wave.num_tokens, max(stage_s))
