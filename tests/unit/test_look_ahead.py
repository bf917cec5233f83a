"""Host work off the path (``Stage.finish_looking_ahead``): while a wave's executor runs,
the stage takes the next wave and does its cache effects, unless that wave carries a
request of the running one (whose next chunk reads what this wave publishes); a next
wave prepared in time starts running before this one publishes."""

from __future__ import annotations

import anyio
import numpy as np

from wavepp.exec.base import StageOutput
from wavepp.exec.stage import Admitted, Ahead, Stage
from wavepp.policy import DEFAULT as p
from wavepp.rounds.admission import Offer, StageBook
from wavepp.rounds.messages import ChunkMsg, WaveMsg
from wavepp.rungs import RUNGS
from wavepp.state import block_hashes, empty_cache

BS = 4


class GatedExecutor:
    """Runs a wave until ``gate`` is set; notes what the stage's cache held meanwhile."""

    has_recurrent = False

    def __init__(self) -> None:
        self.gate, self.inside = anyio.Event(), anyio.Event()
        self.runs: list[list[str]] = []
        self.held_at_start: list[int] = []  # a's published blocks when each run started
        self.stage: Stage | None = None

    async def run(self, works, activations):
        self.runs.append([w.request_id for w in works])
        self.held_at_start.append(self.stage.book.cache.claims["a"].held())
        self.inside.set()
        await self.gate.wait()
        return StageOutput(None, 0.01, {w.request_id: (1, 0.0) for w in works if w.is_last})

    def forget(self, evicted):
        pass

    def cancel(self, rid):
        pass


def _stage() -> tuple[Stage, GatedExecutor]:
    executor = GatedExecutor()
    stage = Stage(1, StageBook(empty_cache(32)), executor, BS, 4, False)
    executor.stage = stage
    for rid, n in (("a", 16), ("b", 8)):
        hashes = tuple(block_hashes(np.arange(n, dtype=np.int32) + ord(rid) * 100, BS))
        cache, _ = p.lease(stage.book.cache, rid, hashes, 0)
        stage.book.cache, ok = p.escrow(cache, rid, n // BS)
        assert ok
        stage.register(Admitted(Offer(rid, n, hashes, n // BS - 1, ""), 0))
    return stage, executor


def _wave(wave_id: int, *chunks: tuple[str, int, int, int]) -> WaveMsg:
    return WaveMsg(wave_id, 16, [ChunkMsg(r, s, e, n, False) for r, s, e, n in chunks])


def _pending(stage: Stage, rid: str) -> int:
    return len(stage.book.cache.claims[rid].pending_slots)


def _look_ahead(stage: Stage, executor: GatedExecutor, current: WaveMsg, nxt: WaveMsg):
    """Run ``current`` and offer ``nxt`` as the next wave; returns what was pending for
    each request while ``current`` ran, and what the look-ahead handed back."""
    seen: dict[str, int] = {}

    async def main():
        prepared = await stage.begin(current)
        with anyio.fail_after(30):  # hang guard
            async with anyio.create_task_group() as runs:

                async def release() -> None:
                    await executor.inside.wait()
                    await anyio.sleep(0.05)  # the look-ahead runs while the wave does
                    seen.update({r: _pending(stage, r) for r in ("a", "b")})
                    executor.gate.set()

                runs.start_soon(release)

                async def take() -> Ahead:
                    return Ahead(nxt)

                result = await stage.finish_looking_ahead(prepared, None, take, runs)
                _, ahead = result
                if ahead.launched is not None:  # the next wave runs: end it as the loop does
                    await ahead.launched.done.wait()
                    stage._settle(ahead.launched)
                return result

    (output, ended), ahead = anyio.run(main)
    return seen, ahead, ended


def test_the_next_wave_is_prepared_and_started_before_the_wave_publishes():
    stage, executor = _stage()
    seen, ahead, ended = _look_ahead(stage, executor, _wave(0, ("a", 0, 8, 16)),
                                     _wave(1, ("b", 0, 8, 8)))  # fmt: skip
    # b's two blocks were taken while a's wave ran; a's first two are pending too
    assert seen == {"a": 2, "b": 2}
    assert ahead.wave.wave_id == 1 and [w.request_id for w in ahead.prepared.works] == ["b"]
    # b's run started before a's chunk published (a held nothing yet), then a published
    assert ahead.launched is not None and executor.runs == [["a"], ["b"]]
    assert executor.held_at_start == [0, 0]
    assert ended == []  # a has a chunk to go
    assert stage.book.cache.claims["a"].held() == 2
    assert "b" not in stage.book.cache.claims  # b ran to its end and released


def test_a_request_of_the_running_wave_waits_for_its_publishing():
    stage, executor = _stage()
    seen, ahead, _ = _look_ahead(stage, executor, _wave(0, ("a", 0, 8, 16)),
                                 _wave(1, ("a", 8, 16, 16), ("b", 0, 8, 8)))  # fmt: skip
    # taken, not prepared: nothing of the next wave was materialized while a's first ran
    assert seen == {"a": 2, "b": 0}
    assert ahead.wave.wave_id == 1 and ahead.prepared is None and ahead.launched is None
    prepared = anyio.run(stage.begin, ahead.wave)  # after a's first chunk published
    assert stage.book.cache.claims["a"].held() == 2 and _pending(stage, "a") == 2
    first = prepared.works[0]
    assert (first.request_id, first.start, len(first.block_table)) == ("a", 8, 4)


def test_only_rungs_that_admit_off_the_path_look_ahead():
    assert [name for name, rung in RUNGS.items() if rung.look_ahead] == ["R2", "R3", "R4", "R5"]
