"""Request intake on rank 0: validation, the waiting queue, and how requests end.

Every request — from a workload generator, a requests file, the Python API or the HTTP
server — enters through :meth:`Intake.submit` and leaves through exactly one of
:meth:`finish`, :meth:`settle_cancel` or :meth:`reject`, which wake whoever awaits it
and stream its :class:`Result` to subscribers.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import anyio
import numpy as np

from wavepp.queueing import WaitingQueue
from wavepp.rounds.admission import Offer
from wavepp.runtime.records import STATUSES, Record, RequestRejected, Result, Signal
from wavepp.state import RequestId, block_hashes, num_blocks_for
from wavepp.workload import RequestSpec

MAX_DEADLINE_S = 1e6  # a deadline is at most this many seconds after submission


class HandoffTarget(Protocol):
    """Where requests' caches go (``wavepp.runtime.handoff.HandoffTargets``)."""

    def __call__(self, spec: RequestSpec) -> str: ...

    def settled(self, spec: RequestSpec, target: str, ok: bool) -> None: ...


class Intake:
    def __init__(
        self, block_size: int, min_capacity: int, vocab_size: int | None,
        changed: Signal, log: Callable[[str], None], *, num_stages: int = 1,
        handoff_target: HandoffTarget | None = None, queue_order: str = "fcfs",
    ) -> None:  # fmt: skip
        """``handoff_target(spec)``: the address a request that asks for a handoff sends
        its cache to (raises RequestRejected), told when its handoff has ended; None:
        this run hands nothing on. ``queue_order``: the policy's order inside a priority
        class (``"fcfs"`` or ``"edf"``, ``wavepp.queueing``)."""
        self.block_size = block_size
        self.min_capacity = min_capacity
        self.vocab_size = vocab_size  # None: ids are not checked (the sim executor)
        self.changed = changed
        self.log = log
        self.records: dict[RequestId, Record] = {}
        self.waiting = WaitingQueue(queue_order)
        self.num_unfinished = 0  # submitted and not yet ended
        self.capacity_epoch = 0  # bumped whenever a request that held room ends
        self.draining = False
        self._subscribers: list[anyio.abc.ObjectSendStream] = []
        self.on_end: Callable[[RequestId], None] = lambda rid: None  # the admitter's hook
        # A server runs for days: keep only the last ``retain_finished`` ended records
        # (None keeps all, as an offline run's record needs). Totals are counted as
        # requests end, so they cover the forgotten ones too.
        self.retain_finished: int | None = None
        self._ended: deque[RequestId] = deque()
        self.rejected: list[Record] = []  # rejected at submission (offline runs only)
        self.totals: dict[str, int] = dict.fromkeys(STATUSES[3:], 0)
        self.tokens_done = 0  # prompt tokens of done requests, cached included
        self.tokens_cached = 0
        self.good_hits = 0  # done requests reusing ≥ 80% of their expected reuse
        self.expecting_reuse = 0
        self.num_stages = num_stages  # bands that make a handed-off request's cache
        self.handoff_target = handoff_target
        self.awaiting_handoff: set[RequestId] = set()  # prefilled, bands still on their way
        self.handoff_totals: dict[str, int] = {}  # "done" or a failure reason -> requests
        self.with_deadline = 0  # ended requests that carried a deadline (rejected aside)
        self.deadlines_met = 0  # of those, the ones done by their deadline

    # -- entry --------------------------------------------------------------------

    def check(self, spec: RequestSpec) -> str | None:
        """Why this request can never run, or None."""
        n = spec.num_tokens
        if n == 0:
            return "empty prompt (need at least one token)"
        if self.vocab_size is not None:
            tokens = np.asarray(spec.tokens)
            bad = tokens[(tokens < 0) | (tokens >= self.vocab_size)]
            if bad.size:
                return (f"{bad.size} token ids outside the vocabulary 0..{self.vocab_size - 1}, "
                        f"e.g. {int(bad[0])}")  # fmt: skip
        blocks = num_blocks_for(n, self.block_size)
        if blocks > self.min_capacity:
            return (f"prompt of {n:,} tokens needs {blocks:,} blocks; "
                    f"the smallest stage pool holds {self.min_capacity:,}")  # fmt: skip
        return None

    def submit(self, spec: RequestSpec, priority: int = 0) -> Record:
        """Queue a request for admission. Raises :class:`RequestRejected` for bad input;
        a request that can never run is also recorded, as rejected."""
        rid = RequestId(spec.request_id)
        if self.draining:
            raise RequestRejected("draining: no new requests are taken", "draining")
        if rid in self.records:
            raise RequestRejected(f"duplicate request id {rid!r}", "duplicate")
        now = time.time()
        deadline_s = spec.deadline_s
        if deadline_s is not None and not (isinstance(deadline_s, int | float)
                                           and not isinstance(deadline_s, bool)
                                           and 0 < deadline_s <= MAX_DEADLINE_S):  # fmt: skip
            raise RequestRejected(f"deadline_s must be a number of seconds in (0, "
                                  f"{MAX_DEADLINE_S:g}], got {deadline_s!r}", "invalid")
        hashes = block_hashes(spec.tokens, self.block_size) if spec.num_tokens else ()
        limit = max(spec.num_tokens - 1, 0) // self.block_size
        target = ""
        if spec.handoff not in (None, False, ""):
            if self.handoff_target is None:
                raise RequestRejected("this run hands no cache on (handoff needs the torch "
                                      "executor)", "invalid")  # fmt: skip
            target = self.handoff_target(spec)
        record = Record(spec, Offer(rid, spec.num_tokens, hashes, limit, target), priority, now)
        self.records[rid] = record
        problem = self.check(spec)
        if problem is not None:
            self.reject(rid, problem)
            del self.records[rid]  # a rejected request leaves no trace: its id is free
            if self.retain_finished is None:  # an offline run's record lists it
                self.rejected.append(record)
            reason = "too_long" if "smallest stage pool" in problem else "invalid"
            raise RequestRejected(f"request {rid!r}: {problem}", reason)
        self.num_unfinished += 1
        deadline = None if deadline_s is None else now + deadline_s
        self.waiting.push(rid, priority, deadline)
        self.changed.notify()
        return record

    # -- exits ----------------------------------------------------------------------

    def _end(self, record: Record, status: str, held_room: bool) -> None:
        self.on_end(RequestId(record.spec.request_id))
        record.status = status
        record.done_at = time.time()
        record.finished.set()
        self.totals[status] += 1
        if record.offer.handoff:
            summary = record.handoff_summary()
            self.handoff_target.settled(record.spec, record.offer.handoff,
                                        summary["status"] == "done")  # fmt: skip
            if status != "rejected":  # a rejected request never asked anything of a stage
                key = summary["reason"] if summary["status"] == "failed" else status
                self.handoff_totals[key] = self.handoff_totals.get(key, 0) + 1
        met = record.deadline_met()
        if met is not None:
            self.with_deadline += 1
            self.deadlines_met += met
        if status == "done":
            self.tokens_done += record.spec.num_tokens
            self.tokens_cached += record.cached_tokens
            if record.spec.expected_reuse > 0:
                self.expecting_reuse += 1
                self.good_hits += record.cached_tokens >= 0.8 * record.spec.expected_reuse
        if self.retain_finished is not None and status != "rejected":
            self._ended.append(RequestId(record.spec.request_id))
            while len(self._ended) > self.retain_finished:
                self.records.pop(self._ended.popleft(), None)
        if held_room:
            self.capacity_epoch += 1
        result = record.result()
        for stream in list(self._subscribers):
            try:
                stream.send_nowait(result)
            except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._subscribers.remove(stream)
        self.changed.notify()

    def reject(self, rid: RequestId, error: str) -> None:
        record = self.records[rid]
        record.error = error
        self.log(f"rejected {rid}: {error}")
        self._end(record, "rejected", held_room=False)

    def finish(self, rid: RequestId, cached: int, token: int, logit: float) -> None:
        record = self.records[rid]
        if record.done_at is not None:
            return
        if record.cancelled:  # its last chunk ran before the cancel reached it
            record.cancelled, record.error = False, None
        record.cached_tokens, record.first_token, record.top_logit = cached, token, logit
        record.prefilled = True
        if record.offer.handoff and len(record.handoff_outcomes) < self.num_stages:
            record.status = "handing_off"  # ends when every stage's band has
            self.awaiting_handoff.add(rid)
            return
        self.num_unfinished -= 1
        self._end(record, "done", held_room=True)

    def handoff_settled(self, outcome) -> None:
        """One stage's band of a request ended (a HandoffOutcome)."""
        rid = RequestId(outcome.request_id)
        record = self.records.get(rid)
        if record is None or record.done_at is not None or not record.offer.handoff:
            return  # cancelled (its cancel settled it) or a peer's stray outcome
        record.handoff_outcomes[outcome.stage] = outcome
        if record.prefilled and len(record.handoff_outcomes) >= self.num_stages:
            self.awaiting_handoff.discard(rid)
            if record.cancelled:  # every band ended before the cancel reached a stage
                record.cancelled, record.error = False, None
            self.num_unfinished -= 1
            self._end(record, "done", held_room=True)

    def fail(self, rid: RequestId, error: str) -> None:
        record = self.records[rid]
        self.awaiting_handoff.discard(rid)
        if record.done_at is None:
            record.error = error
            self.num_unfinished -= 1
            self._end(record, "failed", held_room=True)

    def settle_cancel(self, rid: RequestId) -> None:
        """Every stage dropped the request (or it never reached one)."""
        record = self.records[rid]
        self.awaiting_handoff.discard(rid)
        if record.done_at is None:
            self.num_unfinished -= 1
            self._end(record, "cancelled", held_room=record.admitted_at is not None)

    # -- observers ------------------------------------------------------------------

    def subscribe(self) -> anyio.abc.ObjectReceiveStream:
        send, receive = anyio.create_memory_object_stream[Result](math.inf)
        self._subscribers.append(send)
        return receive

    def count_by_status(self) -> dict[str, int]:
        """Live requests by state (queued, admitted, running) and ended ones by outcome."""
        counts = dict.fromkeys(STATUSES, 0) | self.totals
        counts["queued"] = len(self.waiting)
        live = self.num_unfinished - len(self.waiting)
        running = sum(1 for r in self.records.values()
                      if r.done_at is None and r.status == "running")  # fmt: skip
        counts["running"] = running
        counts["admitted"] = max(live - running, 0)
        return counts
