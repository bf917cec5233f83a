"""Ranks > 0: the WAVE task follows rank 0's rounds, the LOOP runs the waves it receives."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import anyio
import msgspec

from wavepp.exec.base import StageOutput
from wavepp.exec.stage import Admitted, Ahead, Stage, offer_from_entry
from wavepp.rounds.admission import RoundMode, run_round
from wavepp.rounds.messages import (
    MAX_MESSAGE_BYTES,
    AdmitRound,
    Finished,
    HandoffOutcome,
    HandoffRelay,
    RoundMessage,
    Stop,
    WaveDone,
    WaveMsg,
    decode_untrusted,
    encode,
)
from wavepp.rounds.plane import RoundsPlane
from wavepp.state import RequestId
from wavepp.transport.base import Link


async def follow_rounds(plane: RoundsPlane, stage: Stage, mode: RoundMode) -> None:
    """WAVE on ranks > 0: take part in every round rank 0 opens, until Stop."""
    while True:
        message = decode_untrusted(await plane.broadcast(None), RoundMessage)
        if isinstance(message, Stop):
            return
        if isinstance(message, AdmitRound):
            offers = [offer_from_entry(e) for e in message.entries]
            anchors = message.anchors or None
            result = await run_round(plane, stage.book, offers, mode, anchors)
            for offer, ok, point in zip(offers, result.admitted, result.points, strict=True):
                if ok:
                    stage.register(Admitted(offer, point))
            stage.forget(result.evicted)


async def follow_waves(
    stage: Stage, inbound: Link, outbound: Link | None, done: Link | None,
    look_ahead: bool = False,
) -> None:
    """LOOP on ranks > 0: receive, execute, send on — three tasks joined by streams.
    ``look_ahead`` (admission in rounds, off the path): the next wave's cache effects are
    done while this one's executor runs, and it starts as that run ends
    (``Stage.finish_looking_ahead``).
    Handoff outcomes skip the worker: a relay from upstream, or a band of this stage's
    that settled, goes on to the next link at once (``HandoffRelay``)."""
    to_worker_send, to_worker = anyio.create_memory_object_stream(math.inf)
    to_sender_send, to_sender = anyio.create_memory_object_stream(math.inf)
    onward = outbound if outbound is not None else done

    def relay(handoffs: Sequence[HandoffOutcome]) -> None:
        if handoffs:
            with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
                to_sender_send.send_nowait((encode(HandoffRelay(handoffs)), None, onward))

    async def settlements() -> None:  # this stage's bands, as they settle
        while True:
            relay(await stage.handoffs.settled())

    async def receiver() -> None:
        async with to_worker_send:
            while True:
                raw, tensor = await inbound.recv(MAX_MESSAGE_BYTES)
                wave = decode_untrusted(raw, WaveMsg | HandoffRelay)
                if isinstance(wave, HandoffRelay):
                    relay(wave.handoffs)
                    continue
                await to_worker_send.send((wave, tensor))
                if wave.stop:
                    return

    async def worker() -> None:
        ahead: Ahead | None = None  # the next wave, taken while one ran

        async def take() -> Ahead:
            try:
                wave, tensor = await to_worker.receive()
            except anyio.EndOfStream:  # the receiver ended without a stop wave
                return Ahead(None)
            return Ahead(wave, tensor)

        async with to_worker, to_sender_send, anyio.create_task_group() as runs:
            while True:
                ahead, current = None, ahead or await take()
                wave, tensor = current.wave, current.activations
                if wave is None:
                    return
                if wave.stop:
                    if outbound is not None:
                        await to_sender_send.send((encode(wave), None, outbound))
                    else:
                        await to_sender_send.send(
                            (encode(WaveDone(wave.wave_id, [], stop=True)), None, done)
                        )
                    return
                prepared = current.launched or current.prepared or await stage.begin(wave)
                if look_ahead:
                    (output, ended), ahead = await stage.finish_looking_ahead(
                        prepared, tensor, take, runs)
                else:
                    output, ended = await stage.finish(prepared, tensor)
                times = [*wave.stage_s, stage.last_wave_s]
                # this stage's cache changes ride on to rank 0, with --kv-events
                # (wavepp.kv_events.changes); its bands' outcomes went on as they settled
                report = stage.take_cache_report()
                cache = wave.cache if report is None else [*wave.cache, report]
                if outbound is not None:
                    wave = msgspec.structs.replace(wave, stage_s=times, cache=cache)
                    await to_sender_send.send((encode(wave), output.activations, outbound))
                else:
                    message = WaveDone(wave.wave_id, finished(output, ended),
                                       cancelled=wave.cancels, stage_s=times,
                                       cache=cache)  # fmt: skip
                    await to_sender_send.send((encode(message), None, done))

    async def sender() -> None:
        async with to_sender:
            async for raw, tensor, link in to_sender:
                await link.send(raw, tensor)

    async with anyio.create_task_group() as beside:
        if stage.handoffs is not None:
            beside.start_soon(settlements)
        async with anyio.create_task_group() as tg:
            tg.start_soon(receiver)
            tg.start_soon(worker)
            tg.start_soon(sender)
        beside.cancel_scope.cancel()


def finished(output: StageOutput, ended: list[tuple[RequestId, int]]) -> list[Finished]:
    """The last stage's results for the requests whose last chunk was in this wave."""
    out = []
    for rid, cached in ended:
        token, logit = output.results.get(rid, (-1, 0.0))
        out.append(Finished(rid, cached, token, logit))
    return out
