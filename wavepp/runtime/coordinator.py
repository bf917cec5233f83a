"""Rank 0: the parts with one job each, put together (DESIGN §3).

- :class:`~wavepp.runtime.intake.Intake` — requests in, results out;
- :class:`~wavepp.runtime.admitter.Admitter` — the WAVE task (admission rounds);
- :class:`~wavepp.runtime.planning.WavePlanner` — the waves;
- :class:`~wavepp.runtime.stage_zero.StageZero` — stage 0's LOOP and the completions.

A *client* feeds the intake: the offline workload runner (``wavepp.runtime.feed``) or
the HTTP server (``wavepp.serve``), through the :class:`wavepp.engine.Engine` API. The
run ends when the client has returned (or the engine was drained) and every submitted
request has ended.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio

from wavepp.exec.stage import Stage
from wavepp.fleet.changes import Announcer
from wavepp.rounds.admission import RoundMode
from wavepp.rounds.plane import RoundsPlane
from wavepp.rungs import Rung
from wavepp.runtime.admitter import Admitter
from wavepp.runtime.intake import HandoffTarget, Intake
from wavepp.runtime.planning import WavePlanner
from wavepp.runtime.records import Signal
from wavepp.runtime.stage_zero import StageZero
from wavepp.state import RequestId
from wavepp.transport.base import Link


class Coordinator:
    def __init__(
        self, rung: Rung, plane: RoundsPlane, stage: Stage, outbound: Link | None,
        done: Link | None, planner: WavePlanner, mode: RoundMode, *, min_capacity: int,
        vocab_size: int | None, ring: int, max_batch: int, heartbeat_s: float,
        log: Callable[[str], None], num_stages: int = 1,
        handoff_target: HandoffTarget | None = None, events: Announcer | None = None,
    ) -> None:  # fmt: skip
        self.rung = rung
        self.stage = stage
        self.log = log
        self.intake = Intake(stage.block_size, min_capacity, vocab_size, Signal(), log,
                             num_stages=num_stages, handoff_target=handoff_target,
                             queue_order=mode.policy.queue_order)  # fmt: skip
        self.planner = planner
        self.admitter = Admitter(rung, plane, stage, self.intake, mode, max_batch,
                                 heartbeat_s, self._admitted)  # fmt: skip
        self.intake.on_end = self.admitter.ended
        self.loop = StageZero(stage, planner, self.admitter, self.intake, outbound, done, ring,
                              events)  # fmt: skip
        self.has_completions = done is not None
        self.stopping = False
        stage.tokens_of = lambda rid: self.intake.records[rid].spec.tokens

    @property
    def records(self):
        return self.intake.records

    def _admitted(self, rid: RequestId, point: int) -> None:
        record = self.intake.records[rid]
        if record.cancelled:  # cancelled during its round: drop it on every stage
            self.loop.pending_cancels.append(rid)
        else:
            self.planner.add(rid, point * self.stage.block_size, record.offer.num_tokens)

    def cancel(self, rid: RequestId, reason: str = "cancelled") -> bool:
        """Cancel a request wherever it is: queued, in an admission round, or running.

        Queued: dropped at once. Admitted or running: no more of its chunks are planned,
        and the next wave carries the cancel to every stage, which releases its lease,
        escrow, slots and references after the chunks already in flight. Returns False
        if the request is unknown or already over.
        """
        record = self.intake.records.get(rid)
        if record is None or record.done_at is not None or record.cancelled:
            return False
        record.cancelled, record.error = True, reason
        if rid in self.admitter.in_round:
            pass  # settled by the admitter when the round returns
        elif rid in self.intake.waiting:
            self.intake.waiting.remove(rid)
            self.intake.settle_cancel(rid)
        else:
            self.planner.drop(rid)
            self.loop.pending_cancels.append(rid)
        self.intake.changed.notify()
        return True

    def stop_when_idle(self) -> None:
        """No more requests will come: end the run once every submitted one has ended."""
        self.stopping = self.admitter.stopping = True
        self.intake.changed.notify()

    def _finished_all(self) -> bool:
        return self.stopping and not self.intake.num_unfinished

    async def run(self, client: Callable[[], Awaitable[None]]) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.admitter.run)
            tg.start_soon(self.loop.run, self._finished_all)
            if self.has_completions:
                tg.start_soon(self.loop.completions)
            try:
                await client()
            finally:
                self.stop_when_idle()
