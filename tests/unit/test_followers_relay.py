"""A follower stage passes handoff outcomes on at once (``HandoffRelay``): one relayed
from upstream, and one of its own bands that settled, reach the next link while the
stage's worker is still inside a wave — they do not wait for it."""

from __future__ import annotations

import anyio
import numpy as np

from wavepp.exec.base import StageOutput
from wavepp.rounds.messages import (
    ChunkMsg,
    DataMessage,
    HandoffOutcome,
    HandoffRelay,
    WaveMsg,
    decode_untrusted,
    encode,
)
from wavepp.runtime.followers import follow_waves


class Pipe:
    """A link in memory: what one side sends, the other receives, in order."""

    def __init__(self) -> None:
        self._send, self._recv = anyio.create_memory_object_stream(100)

    async def send(self, descriptor: bytes, tensor) -> None:
        await self._send.send((bytes(descriptor), tensor))

    async def recv(self, max_bytes=None):
        return await self._recv.receive()


class Sender:
    """The part of a HandoffSender ``follow_waves`` uses."""

    def __init__(self) -> None:
        self._send, self._settled = anyio.create_memory_object_stream(100)

    def settle(self, outcome: HandoffOutcome) -> None:
        self._send.send_nowait(outcome)

    async def settled(self) -> list[HandoffOutcome]:
        return [await self._settled.receive()]


class BusyStage:
    """A stage whose waves run until ``release`` is set."""

    def __init__(self) -> None:
        self.handoffs = Sender()
        self.inside, self.release = anyio.Event(), anyio.Event()
        self.last_wave_s = 0.0

    def take_cache_report(self):
        return None

    async def begin(self, wave, prompts=None):
        return wave

    async def finish(self, wave, tensor):
        self.inside.set()
        await self.release.wait()
        return StageOutput(np.zeros(1, dtype=np.float32), 0.0, {}), []


def outcome(rid: str, stage: int) -> HandoffOutcome:
    return HandoffOutcome(rid, stage, True, "", "", 8, 0.01, 1.8e9, 0.005)


def test_outcomes_pass_a_busy_stage_at_once_and_the_wave_follows():
    stage, inbound, outbound = BusyStage(), Pipe(), Pipe()

    async def main():
        async with anyio.create_task_group() as tg:
            tg.start_soon(follow_waves, stage, inbound, outbound, None)
            await inbound.send(encode(WaveMsg(1, 64, [ChunkMsg("a", 0, 8, 8, False)])), None)
            with anyio.fail_after(30):  # hang guard
                await stage.inside.wait()
                # the worker is inside wave 1: an upstream relay, then a band of its own
                await inbound.send(encode(HandoffRelay([outcome("a", 0)])), None)
                first = decode_untrusted((await outbound.recv())[0], DataMessage)
                stage.handoffs.settle(outcome("a", 1))
                second = decode_untrusted((await outbound.recv())[0], DataMessage)
                stage.release.set()
                wave = decode_untrusted((await outbound.recv())[0], DataMessage)
                await inbound.send(encode(WaveMsg(2, 0, [], stop=True)), None)
                stop = decode_untrusted((await outbound.recv())[0], DataMessage)
            tg.cancel_scope.cancel()
        return first, second, wave, stop

    first, second, wave, stop = anyio.run(main)
    assert first == HandoffRelay([outcome("a", 0)])
    assert second == HandoffRelay([outcome("a", 1)])
    assert isinstance(wave, WaveMsg) and wave.wave_id == 1 and wave.stage_s == [0.0]
    assert isinstance(stop, WaveMsg) and stop.stop
