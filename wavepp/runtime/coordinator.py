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

import time
from collections.abc import Awaitable, Callable

import anyio
import attrs

from wavepp.exec.stage import Stage
from wavepp.kv_events.changes import Announcer
from wavepp.rounds.admission import RoundCounters, RoundMode
from wavepp.rounds.plane import RoundsPlane
from wavepp.rungs import Rung
from wavepp.runtime.admitter import Admitter
from wavepp.runtime.intake import HandoffTarget, Intake
from wavepp.runtime.pace import Pace
from wavepp.runtime.planning import WavePlanner
from wavepp.runtime.records import Record, Result
from wavepp.runtime.stage_zero import StageZero
from wavepp.runtime.table import RequestTable
from wavepp.state import RequestId
from wavepp.transport.base import Link
from wavepp.workload import RequestSpec


@attrs.frozen
class RunBook:
    """What rank 0's run leaves for its JSON record."""

    records: list[Record]  # every request, in submission order, the rejected ones last
    num_rounds: int
    round_seconds: list[float]  # the recent rounds' wall seconds
    round_cpu_s: list[float]
    round_spans: list[tuple[float, float, int]]  # with a timeline: every round's
    counters: RoundCounters
    handoff_totals: dict[str, int]


class Coordinator:
    def __init__(
        self, rung: Rung, plane: RoundsPlane, stage: Stage, outbound: Link | None,
        done: Link | None, planner: WavePlanner, mode: RoundMode, *, min_capacity: int,
        vocab_size: int | None, ring: int, max_batch: int, heartbeat_s: float,
        log: Callable[[str], None], num_stages: int = 1,
        handoff_target: HandoffTarget | None = None, events: Announcer | None = None,
        retain_ended: int | None = None, timeline: bool = False,
    ) -> None:  # fmt: skip
        """``retain_ended``: how many ended requests' ids stay taken (a server); None
        keeps every record for the run's record. ``timeline``: keep every round's span."""
        self.table = RequestTable(log, num_stages=num_stages, queue_order=mode.policy.queue_order,
                                  retain_ended=retain_ended)  # fmt: skip
        self.intake = Intake(self.table, stage.block_size, min_capacity, vocab_size,
                             handoff_target)  # fmt: skip
        self.planner = planner
        pace = Pace(planner, num_stages)
        self.admitter = Admitter(rung, plane, stage, self.table, mode, max_batch, heartbeat_s,
                                 pace, self._admitted, timeline)  # fmt: skip
        self.loop = StageZero(stage, planner, self.admitter, self.table, pace, outbound, done,
                              ring, events, look_ahead=rung.look_ahead)  # fmt: skip
        self.stage = stage
        self.has_completions = done is not None

    # -- requests -------------------------------------------------------------------

    def submit(self, spec: RequestSpec, priority: object = 0) -> Record:
        """Check and queue a request (``Intake.submit``: raises RequestRejected)."""
        return self.intake.submit(spec, priority)

    def taken(self, rid: RequestId) -> bool:
        return self.table.taken(rid)

    def _admitted(self, rid: RequestId, point: int) -> None:
        record = self.table[rid]
        if record.cancelled:  # cancelled during its round: drop it on every stage
            self.loop.drop_everywhere(rid)
        else:
            self.planner.add(rid, point * self.stage.block_size, record.offer.num_tokens)

    def cancel(self, rid: RequestId, reason: str = "cancelled") -> bool:
        """Cancel a request wherever it is: queued, in an admission round, or running.

        Queued: dropped at once. Admitted or running: no more of its chunks are planned,
        and the next wave carries the cancel to every stage, which releases its lease,
        escrow, slots and references after the chunks already in flight. Returns False
        if the request is unknown or already over.
        """
        if self.table.ask_cancel(rid, reason) is None:
            return False
        if rid in self.admitter.in_round:
            pass  # settled by the admitter when the round returns
        elif rid in self.table.waiting:
            self.table.waiting.remove(rid)
            self.table.settle_cancel(rid)
        else:
            self.planner.drop(rid)
            self.loop.drop_everywhere(rid)
        return True

    def subscribe(self) -> anyio.abc.ObjectReceiveStream[Result]:
        """Every result from now on, as requests end."""
        return self.table.subscribe()

    # -- the run's state --------------------------------------------------------------

    def drain(self) -> None:
        """Take no new requests; the run ends when the submitted ones have ended."""
        self.table.drain()

    @property
    def draining(self) -> bool:
        return self.table.draining

    def num_unfinished(self) -> int:
        return self.table.num_unfinished

    def stop_when_idle(self) -> None:
        """No more requests will come: end the run once every submitted one has ended."""
        self.table.close()

    def _finished_all(self) -> bool:
        return self.table.closed and not self.table.num_unfinished

    def figures(self) -> dict:
        """Rank 0's counts for metrics: requests, tokens, reuse, deadlines, rounds, and the
        work waiting (what a prefill autoscaler reads)."""
        table, admitter = self.table, self.admitter
        queued_tokens, oldest = table.waiting_load()
        return {
            "requests": table.count_by_status(),
            "queue_depth": len(table.waiting),
            # queued: whole prompts not yet admitted; admitted: uncached tokens no wave carried
            "tokens_waiting": {"queued": queued_tokens,
                               "admitted": self.planner.num_unplanned_tokens},
            "queue_oldest_seconds": 0.0 if oldest is None else max(time.time() - oldest, 0.0),
            "input_tokens": table.tokens_done,
            "cached_tokens": table.tokens_cached,
            "good_hits": table.good_hits,
            "handoffs": dict(table.handoff_totals),  # handed-off requests by outcome
            "with_deadline": table.with_deadline,  # ended requests that carried a deadline
            "deadlines_met": table.deadlines_met,  # of those, done by their deadline
            "expecting_reuse": table.expecting_reuse,
            "admission_round_seconds": list(admitter.round_seconds)[-1024:],
            "admission_rounds": admitter.num_rounds,
        }

    def stage_figures(self) -> dict[int, dict[str, float]]:
        """Stage 0's busy seconds and pool, by its index."""
        return {self.stage.index: self.stage.figures()}

    def sizes(self) -> dict[str, int]:
        """Every rank-0 table's size (a server's stay bounded)."""
        return {**self.table.sizes(), "planner_queue": len(self.planner.queue),
                **self.admitter.sizes(), **self.loop.sizes(),
                **self.stage.sizes()}  # fmt: skip

    def limits(self) -> dict[str, int]:
        """The tables among :meth:`sizes` that are windows of recent history: their caps."""
        return {**self.table.limits(), **self.admitter.limits(), **self.stage.limits()}

    def run_book(self) -> RunBook:
        admitter = self.admitter
        return RunBook(self.table.records(), admitter.num_rounds, list(admitter.round_seconds),
                       list(admitter.round_cpu_s), list(admitter.timeline or ()),
                       admitter.counters, dict(self.table.handoff_totals))  # fmt: skip

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
