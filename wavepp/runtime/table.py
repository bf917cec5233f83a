"""Rank 0's request table: every request's life, from the waiting queue to its end.

The table holds the live requests (queued, admitted, running, handing off), the waiting
queue, and what ended requests leave behind: counters, and the ids of the recently
ended ones (an id names one request until 10,000 later ones have ended, on a server).
Every status change is one of its moves (:class:`~wavepp.runtime.records.Record`'s
methods, called from here only); every end wakes whoever awaits the request, streams
its :class:`Result` to subscribers, and counts it — then a server forgets the record.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

import anyio
import attrs
import numpy as np

from wavepp.queueing import WaitingQueue
from wavepp.runtime.records import ENDS, Record, Result, Signal, Status
from wavepp.state import RequestId

RECENT_RECORDS = 1000  # a server's ended requests its JSON record lists, the latest ones


def _drop_prompt(record: Record) -> None:
    """Keep of an ended ``record`` what its result and the JSON record read: its prompt's
    ids (and the offer's block hashes) give way to an array of its length that takes no
    memory."""
    spec = record.spec
    tokens = np.broadcast_to(np.zeros((), dtype=spec.tokens.dtype), spec.tokens.shape)
    record.spec = attrs.evolve(spec, tokens=tokens)
    record.offer = _EndedOffer(getattr(record.offer, "handoff", ""))


@attrs.frozen
class _EndedOffer:
    handoff: str  # all an ended request's result reads of its offer


class RequestTable:
    def __init__(
        self, log: Callable[[str], None], *, num_stages: int = 1, queue_order: str = "fcfs",
        retain_ended: int | None = None,
    ) -> None:  # fmt: skip
        """``num_stages``: the bands that make a handed-off request's cache.
        ``queue_order``: the policy's order inside a priority class (``"fcfs"`` or
        ``"edf"``, ``wavepp.queueing``). ``retain_ended``: how many ended requests' ids
        stay taken (a server; their records are forgotten at once); None keeps every
        ended record, as an offline run's record needs."""
        self.log = log
        self.num_stages = num_stages
        self.changed = Signal()
        self.waiting = WaitingQueue(queue_order)
        self.capacity_epoch = 0  # bumped whenever a request that held room ends
        self.draining = False  # takes no new requests
        self.closed = False  # no more requests will come: the run ends once none is live
        self.awaiting_handoff: set[RequestId] = set()  # prefilled, bands still on their way
        self._live: dict[RequestId, Record] = {}
        self._retain = retain_ended
        self._recent: deque[RequestId] = deque()  # ended ids still taken, oldest first
        self._recent_set: set[RequestId] = set()
        self._kept: dict[RequestId, Record] | None = None if retain_ended else {}
        self._rejected: list[Record] | None = None if retain_ended else []
        # A server's record lists its most recent ended requests (their prompts dropped).
        self._recent_records: deque[Record] = deque(maxlen=RECENT_RECORDS)
        self._ended: deque[RequestId] = deque()  # not yet taken by the admitter
        self._subscribers: list[anyio.abc.ObjectSendStream] = []
        # counted as requests end, so they cover the forgotten ones
        self.totals: dict[str, int] = {s.value: 0 for s in Status if s in ENDS}
        self.tokens_done = 0  # prompt tokens of done requests, cached included
        self.tokens_cached = 0
        self.good_hits = 0  # done requests reusing ≥ 80% of their expected reuse
        self.expecting_reuse = 0
        self.handoff_totals: dict[str, int] = {}  # "done" or a failure reason -> requests
        self.with_deadline = 0  # ended requests that carried a deadline (rejected aside)
        self.deadlines_met = 0  # of those, the ones done by their deadline

    # -- lookups --------------------------------------------------------------------

    def __getitem__(self, rid: RequestId) -> Record:
        return self._live[rid]

    def get(self, rid: RequestId) -> Record | None:
        """The live request ``rid``, or None (unknown or ended)."""
        return self._live.get(rid)

    def taken(self, rid: RequestId) -> bool:
        """``rid`` names a live request or one that ended recently."""
        return (rid in self._live or rid in self._recent_set
                or (self._kept is not None and rid in self._kept))  # fmt: skip

    @property
    def num_unfinished(self) -> int:
        """Submitted and not yet ended."""
        return len(self._live)

    def records(self) -> list[Record]:
        """An offline run's every record, in submission order, the rejected ones last; a
        server's last :data:`RECENT_RECORDS` ended ones, in the order they ended, and the
        live ones."""
        if self._kept is None:
            return [*self._recent_records, *self._live.values()]
        return [*self._kept.values(), *self._rejected]

    # -- entry ----------------------------------------------------------------------

    def add(self, record: Record, deadline: float | None) -> None:
        """Queue a request that passed the intake's checks (``deadline``: absolute)."""
        rid = RequestId(record.spec.request_id)
        self._live[rid] = record
        if self._kept is not None:
            self._kept[rid] = record
        self.waiting.push(rid, record.priority, deadline)
        self.changed.notify()

    def reject(self, record: Record, error: str) -> None:
        """A request that can never run: it ends at once, and its id stays free."""
        self.log(f"rejected {record.spec.request_id}: {error}")
        self._end(record, Status.REJECTED, error, held_room=False)
        if self._rejected is not None:  # an offline run's record lists it
            self._rejected.append(record)

    # -- the moves --------------------------------------------------------------------

    def admitted(self, rid: RequestId, now: float, miss_reason: str | None = None) -> None:
        """Every stage holds its room; ``miss_reason``: why it reuses < 80% of its
        expected reuse (rank 0's view), or None."""
        self._live[rid].admit(now, miss_reason)

    def started(self, rid: RequestId, now: float) -> Record:
        """A chunk of ``rid`` left stage 0's planner (its first one starts it)."""
        record = self._live[rid]
        if record.status is not Status.RUNNING:
            record.start(now)
        record.last_chunk_at = now
        return record

    def ask_cancel(self, rid: RequestId, reason: str) -> Record | None:
        """Note a cancel of ``rid``; None when it is unknown, over, or already cancelled."""
        record = self._live.get(rid)
        if record is None or not record.ask_cancel(reason):
            return None
        self.changed.notify()
        return record

    def finish(self, rid: RequestId, cached: int, token: int, logit: float) -> None:
        """The last stage's first token for ``rid``: done, or handing off until every
        stage's band has ended; failed where its logits are not finite (the others go
        on)."""
        record = self._live.get(rid)
        if record is None:  # ended meanwhile (a cancel settled it)
            return
        if not math.isfinite(logit):  # NaN or inf: the model gave no usable answer
            self._end(record, Status.FAILED, f"the model's logits at the prompt's last "
                      f"position are not finite (top logit {logit}): no first token",
                      held_room=True)  # fmt: skip
            return
        record.prefill(cached, token, logit)
        if record.offer.handoff and not self._handed_off(record):
            record.hand_off(time.time())
            self.awaiting_handoff.add(rid)
            return
        self._end(record, Status.DONE, None, held_room=True)

    def _handed_off(self, record: Record) -> bool:
        """Every stage's band has ended, and none was stopped by a cancel: such a
        request ends when the stages confirm the cancel (``settle_cancel``). Outcomes
        come straight from the stages, so they may arrive before that confirmation, and
        before or after the first token (which clears a cancel that came too late for
        the prefill; it may still have stopped a band)."""
        outcomes = record.handoff_outcomes.values()
        stopped = record.cancel_asked is not None and any(
            o.reason == "cancelled" for o in outcomes)  # fmt: skip
        return (len(outcomes) >= self.num_stages and record.cancel_reason is None
                and not stopped)  # fmt: skip

    def handoff_settled(self, outcome) -> None:
        """One stage's band of a request ended (a HandoffOutcome)."""
        rid = RequestId(outcome.request_id)
        record = self._live.get(rid)
        if record is None or not record.offer.handoff or outcome.stage >= self.num_stages:
            return  # cancelled (its cancel settled it) or a peer's stray outcome
        record.handoff_outcomes[outcome.stage] = outcome
        if record.status is not Status.HANDING_OFF:
            return
        if record.cancel_confirmed and len(record.handoff_outcomes) >= self.num_stages:
            self._end(record, Status.CANCELLED, None, held_room=True)
        elif self._handed_off(record):
            self._end(record, Status.DONE, None, held_room=True)

    def fail(self, rid: RequestId, error: str) -> None:
        record = self._live.get(rid)
        if record is not None:
            self._end(record, Status.FAILED, error, held_room=True)

    def settle_cancel(self, rid: RequestId) -> None:
        """Every stage dropped the request (or it never reached one). One handing off
        ends once every stage's band has ended too (each ends at once, stopped by the
        cancel): its result then says how each went."""
        record = self._live.get(rid)
        if record is None:
            return
        if record.status is Status.HANDING_OFF and len(record.handoff_outcomes) < self.num_stages:
            record.cancel_confirmed = True
            return
        self._end(record, Status.CANCELLED, None, held_room=record.admitted_at is not None)

    def drain(self) -> None:
        """Take no new requests; end the run once the live ones have ended."""
        self.draining = True
        self.close()

    def close(self) -> None:
        """No more requests will come: end the run once the live ones have ended."""
        self.closed = True
        self.changed.notify()

    def _end(self, record: Record, status: Status, error: str | None, held_room: bool) -> None:
        rid = RequestId(record.spec.request_id)
        record.end(status, time.time(), error)
        self.totals[status.value] += 1
        self.awaiting_handoff.discard(rid)
        if record.offer.handoff:
            summary = record.handoff_summary()
            if status is not Status.REJECTED:  # a rejected one never asked a stage anything
                key = summary["reason"] if summary["status"] == "failed" else status.value
                self.handoff_totals[key] = self.handoff_totals.get(key, 0) + 1
        met = record.deadline_met()
        if met is not None:
            self.with_deadline += 1
            self.deadlines_met += met
        if status is Status.DONE:
            self.tokens_done += record.spec.num_tokens
            self.tokens_cached += record.cached_tokens
            if record.spec.expected_reuse > 0:
                self.expecting_reuse += 1
                self.good_hits += record.cached_tokens >= 0.8 * record.spec.expected_reuse
        if status is not Status.REJECTED:  # a rejected request was never live
            del self._live[rid]
            self._ended.append(rid)
            if self._retain is not None:
                self._recent.append(rid)
                self._recent_set.add(rid)
                while len(self._recent) > self._retain:
                    self._recent_set.discard(self._recent.popleft())
        if held_room:
            self.capacity_epoch += 1
        result = record.result()
        for stream in list(self._subscribers):
            try:
                stream.send_nowait(result)
            except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._subscribers.remove(stream)
        if self._kept is None:  # a server forgets the request; its record keeps a trace
            _drop_prompt(record)
            self._recent_records.append(record)
        self.changed.notify()

    def take_ended(self) -> list[RequestId]:
        """The requests that ended since the last call (the admitter's in-flight book
        forgets them)."""
        ended = list(self._ended)
        self._ended.clear()
        return ended

    # -- observers ------------------------------------------------------------------

    def subscribe(self) -> anyio.abc.ObjectReceiveStream:
        send, receive = anyio.create_memory_object_stream[Result](math.inf)
        self._subscribers.append(send)
        return receive

    def waiting_load(self) -> tuple[int, float | None]:
        """The requests waiting for admission: their prompt tokens (cached included, as
        admission has not yet said what they reuse) and when the oldest of them was
        submitted (None with none). O(waiting): for a scrape, not for a round."""
        num_tokens, oldest = 0, None
        for rid in self.waiting:
            record = self._live.get(rid)
            if record is None:
                continue
            num_tokens += record.spec.num_tokens
            if record.released_at is not None and (oldest is None or record.released_at < oldest):
                oldest = record.released_at
        return num_tokens, oldest

    def count_by_status(self) -> dict[str, int]:
        """Live requests by status (queued, admitted, running, handing off) and ended ones
        by outcome."""
        counts = {s.value: 0 for s in Status} | self.totals
        for record in self._live.values():
            counts[record.status.value] += 1
        return counts

    def sizes(self) -> dict[str, int]:
        """How many entries each of the table's parts holds (bounded on a server)."""
        return {
            "records": len(self._live),
            "waiting": len(self.waiting),
            "ended_ids": len(self._recent),
            "kept_records": len(self._kept or ()) + len(self._rejected or ()),  # offline only
            "ended_unseen": len(self._ended),
            "awaiting_handoff": len(self.awaiting_handoff),
            "subscribers": len(self._subscribers),
            "recent_records": len(self._recent_records),
        }

    def limits(self) -> dict[str, int]:
        """The tables that are windows of recent history, and their caps."""
        return {"recent_records": RECENT_RECORDS,
                **({"ended_ids": self._retain} if self._retain is not None else {})}
