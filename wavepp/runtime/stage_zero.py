"""Stage 0's LOOP on rank 0 (DESIGN §3): plan a wave, run stage 0, send it on; and the
completions that come back from the last stage."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import anyio
import msgspec

from wavepp.exec.planes import Link
from wavepp.exec.stage import Stage
from wavepp.plan import Wave
from wavepp.rounds.messages import (
    MAX_MESSAGE_BYTES,
    ChunkMsg,
    Finished,
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


class StageZero:
    def __init__(
        self, stage: Stage, planner: WavePlanner, admitter: Admitter, intake: Intake,
        outbound: Link | None, done: Link | None, ring: int,
    ) -> None:  # fmt: skip
        self.stage = stage
        self.planner = planner
        self.admitter = admitter
        self.intake = intake
        self.outbound = outbound  # to stage 1; None when rank 0 is the only stage
        self.done_link = done  # from the last stage
        self.ring = ring
        self.in_flight = 0  # waves sent and not yet back from the last stage
        self.pending_cancels: list[RequestId] = []  # admitted, to drop with the next wave
        self.measuring: dict[int, Wave] = {}  # measured waves in flight, for the cost fit

    def complete(self, results: Sequence[Finished], cancelled: Sequence[str] = ()) -> None:
        for rid in cancelled:
            self.intake.settle_cancel(RequestId(rid))
        for item in results:
            self.intake.finish(RequestId(item.request_id), item.cached_tokens,
                               item.first_token, item.top_logit)  # fmt: skip
        self.intake.changed.notify()

    def _next_wave(self) -> Wave | None:
        wave = self.planner.next() if self.in_flight < self.ring else None
        if wave is None and self.pending_cancels:
            wave = Wave(self.planner.take_wave_id(), 0, ())  # carries only the cancels
        return wave

    def _message(self, wave: Wave) -> WaveMsg:
        now = time.time()
        chunks = []
        for c in wave.chunks:
            record = self.intake.records[c.request_id]
            if record.first_chunk_at is None:
                record.first_chunk_at, record.status = now, "running"
            chunks.append(ChunkMsg(c.request_id, c.start, c.end, c.num_tokens, record.spec.warmup))
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
                        if finished_all():
                            break
                        await self.intake.changed.wait()
                        continue
                    message = self._message(wave)
                    self.in_flight += 1
                    output, ended = await self.stage.execute(message, None)
                    if message.chunks and not message.chunks[0].free:
                        self.measuring[wave.wave_id] = wave
                    times = [self.stage.last_wave_s]
                    if self.outbound is None:
                        self.in_flight -= 1
                        self._observe(wave.wave_id, times)
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
            self.complete(message.finished, message.cancelled)

    def _observe(self, wave_id: int, stage_s: Sequence[float]) -> None:
        """The slowest stage's whole time on a measured wave teaches the cost fit (it
        sets the pipeline's pace, runtime overheads included)."""
        wave = self.measuring.pop(wave_id, None)
        if wave is not None and stage_s:
            self.planner.observe(wave, max(stage_s))
