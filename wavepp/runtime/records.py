"""Rank 0's book on each request — its status and the only moves between them — and
what a caller gets back."""

from __future__ import annotations

import enum

import anyio
import attrs

from wavepp.errors import RequestRejected as RequestRejected  # re-exported
from wavepp.handoff.wire import PULL_TARGET
from wavepp.ids import ID_RULE as ID_RULE  # re-exported
from wavepp.ids import id_problem as id_problem  # re-exported
from wavepp.rounds.errors import ProtocolError as ProtocolError  # re-exported
from wavepp.workload import RequestSpec


class Signal:
    """Wake every waiter on any change; waiters re-check their condition."""

    def __init__(self) -> None:
        self._event = anyio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = anyio.Event()

    async def wait(self, timeout: float | None = None) -> None:
        event = self._event
        if timeout is None:
            await event.wait()
        else:
            with anyio.move_on_after(timeout):
                await event.wait()

class Status(enum.StrEnum):
    """Where a request is in its life; the last four are ends."""

    QUEUED = "queued"  # waiting for admission
    ADMITTED = "admitted"  # every stage holds its room; no chunk planned yet
    RUNNING = "running"  # its first chunk left stage 0's planner
    HANDING_OFF = "handing_off"  # first token back, its cache's bands still on their way
    DONE = "done"
    CANCELLED = "cancelled"
    REJECTED = "rejected"  # never ran: refused at submission
    FAILED = "failed"

    @property
    def ended(self) -> bool:
        return self in ENDS


ENDS = frozenset({Status.DONE, Status.CANCELLED, Status.REJECTED, Status.FAILED})
_NEXT: dict[Status, frozenset[Status]] = {
    Status.QUEUED: frozenset({Status.ADMITTED, Status.REJECTED, Status.CANCELLED, Status.FAILED}),
    Status.ADMITTED: frozenset({Status.RUNNING, Status.CANCELLED, Status.FAILED}),
    Status.RUNNING: frozenset({Status.HANDING_OFF, Status.DONE, Status.CANCELLED,
                               Status.FAILED}),
    Status.HANDING_OFF: frozenset({Status.DONE, Status.CANCELLED, Status.FAILED}),
    **{end: frozenset() for end in ENDS},
}  # fmt: skip


class StatusError(RuntimeError):
    """A move the request's life does not have (a bug in rank 0)."""


@attrs.frozen
class Result:
    """How one request ended, with its timings (``time.time()`` seconds)."""

    request_id: str
    status: str  # "done" | "cancelled" | "rejected" | "failed" (an ended Status)
    first_token: int | None  # argmax of the last prompt position's logits (done only)
    top_logit: float | None  # its logit
    num_tokens: int
    cached_tokens: int  # prompt tokens served from the cache instead of computed
    error: str | None
    submitted_at: float
    admitted_at: float | None
    first_chunk_at: float | None
    done_at: float
    # A request that handed its cache on: where to, and how each stage's band went —
    # {"target", "status": "done" | "failed", "reason", "error", "stages": [...]}.
    handoff: dict | None = None
    # The request's deadline, seconds after ``submitted_at`` (None: it had none), and
    # whether its result met it: True when done by ``submitted_at + deadline_s``; False
    # when done later, or cancelled, failed or interrupted; None without a deadline.
    deadline_s: float | None = None
    deadline_met: bool | None = None

    def to_json(self) -> dict:
        return attrs.asdict(self)


@attrs.define
class Record:
    """Rank 0's book on one request. Its status changes only through the moves below,
    which the request table (``wavepp.runtime.table``) makes; a move the life does not
    have raises :class:`StatusError`."""

    spec: RequestSpec
    offer: object  # wavepp.rounds.admission.Offer: what admission rounds see
    priority: int = 0
    released_at: float | None = None  # submitted: entered the waiting queue
    admitted_at: float | None = None
    first_chunk_at: float | None = None  # its first chunk left stage 0's planner
    last_chunk_at: float | None = None  # its latest chunk left stage 0's planner
    prefilled_at: float | None = None  # its first token came back (handing off since)
    done_at: float | None = None
    cached_tokens: int = 0
    first_token: int = -1
    top_logit: float = 0.0
    error: str | None = None
    # A cancel was asked for, and why; settled when every stage dropped the request
    # (cleared if its last chunk ran before the cancel reached it).
    cancel_reason: str | None = None
    # why a cancel was asked, kept when the first token clears ``cancel_reason``: its
    # cancel wave is on its way, and may still stop a band of a handoff
    cancel_asked: str | None = None
    # every stage dropped it while its bands were still on their way: it ends (cancelled)
    # with its last band's outcome
    cancel_confirmed: bool = False
    miss_reason: str | None = None  # why it reused < 80% of its expected reuse
    handoff_outcomes: dict = attrs.field(factory=dict)  # stage -> HandoffOutcome
    finished: anyio.Event = attrs.field(factory=anyio.Event)
    # its caller may be answered: it ended, or its bands wait for a decoder to pull them
    answered: anyio.Event = attrs.field(factory=anyio.Event)
    _status: Status = attrs.field(default=Status.QUEUED, init=False)

    @property
    def status(self) -> Status:
        return self._status

    @property
    def cancelled(self) -> bool:
        """A cancel was asked for (and, once ended, the request ended cancelled or failed)."""
        return self.cancel_reason is not None

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    # -- the moves ------------------------------------------------------------------

    def _move(self, to: Status) -> None:
        if to not in _NEXT[self._status]:
            raise StatusError(f"request {self.spec.request_id!r}: {self._status} -> {to} "
                              "is not a move of a request's life")  # fmt: skip
        self._status = to

    def admit(self, now: float, miss_reason: str | None = None) -> None:
        self._move(Status.ADMITTED)
        self.admitted_at, self.miss_reason = now, miss_reason

    def start(self, now: float) -> None:
        """Its first chunk left stage 0's planner."""
        self._move(Status.RUNNING)
        self.first_chunk_at = now

    @property
    def held_for_pull(self) -> bool:
        """Its cache waits on the stages' band servers for a decoder (``pull:``)."""
        return getattr(self.offer, "handoff", "") == PULL_TARGET

    def prefill(self, cached: int, token: int, logit: float) -> None:
        """Its first token came back; a cancel asked meanwhile came too late."""
        if self._status is not Status.RUNNING:
            raise StatusError(f"request {self.spec.request_id!r}: a first token while "
                              f"{self._status}")  # fmt: skip
        self.cached_tokens, self.first_token, self.top_logit = cached, token, logit
        self.cancel_reason = None

    def hand_off(self, now: float) -> None:
        """Prefilled; its cache's bands are still on their way (or, pulled, waiting for
        their decoder: its caller is answered now)."""
        self._move(Status.HANDING_OFF)
        self.prefilled_at = now
        if self.held_for_pull:
            self.answered.set()

    def ask_cancel(self, reason: str) -> bool:
        """Note a cancel; False when it is over or a cancel was already asked for."""
        if self._status.ended or self.cancel_reason is not None:
            return False
        self.cancel_reason = self.cancel_asked = reason
        return True

    def end(self, status: Status, now: float, error: str | None = None) -> None:
        self._move(status)
        self.done_at = now
        self.error = (self.cancel_reason or self.cancel_asked) if status is Status.CANCELLED \
            else error  # fmt: skip
        self.finished.set()
        self.answered.set()

    def answer(self) -> Result:
        """What its caller is answered with: its result, or — its cache waiting for a
        decoder to pull it — its prefill's (status done, handoff status ``held``, and
        ``held_since``: wall-clock seconds no later than the start of any stage's
        lease)."""
        if self._status is not Status.HANDING_OFF or not self.held_for_pull:
            return self.result()
        summary = self.handoff_summary() or {}
        # every stage's lease started after its last chunk left stage 0's planner
        held = summary if summary.get("status") == "failed" else {
            **summary, "status": "held", "held_since": self.last_chunk_at or self.prefilled_at}
        return attrs.evolve(self.result(), status=Status.DONE.value,
                            first_token=self.first_token, top_logit=self.top_logit,
                            done_at=self.prefilled_at or 0.0, handoff=held)  # fmt: skip

    def result(self) -> Result:
        done = self._status is Status.DONE
        return Result(
            request_id=self.spec.request_id,
            status=self._status.value,
            first_token=self.first_token if done else None,
            top_logit=self.top_logit if done else None,
            num_tokens=self.spec.num_tokens,
            cached_tokens=self.cached_tokens,
            error=self.error,
            submitted_at=self.released_at or 0.0,
            admitted_at=self.admitted_at,
            first_chunk_at=self.first_chunk_at,
            done_at=self.done_at or 0.0,
            handoff=self.handoff_summary(),
            deadline_s=self.spec.deadline_s,
            deadline_met=self.deadline_met(),
        )

    def deadline_met(self) -> bool | None:
        """None without a deadline (or rejected: never ran); else whether it was done by
        ``released_at + deadline_s`` (a request not yet ended has not met it)."""
        deadline_s = self.spec.deadline_s
        if deadline_s is None or self._status is Status.REJECTED:
            return None
        if self._status is not Status.DONE or self.done_at is None or self.released_at is None:
            return False
        return self.done_at <= self.released_at + deadline_s

    def handoff_summary(self) -> dict | None:
        target = getattr(self.offer, "handoff", "")
        if not target:
            return None
        stages = [self.handoff_outcomes[s] for s in sorted(self.handoff_outcomes)]
        failed = [o for o in stages if not o.ok]
        if failed:
            status = "failed"
        elif self._status is Status.DONE:
            status = "done"
        else:
            status = "pending" if self.done_at is None else "not sent"
        return {
            "target": target,
            "status": status,
            "reason": failed[0].reason if failed else None,
            "error": f"stage {failed[0].stage}: {failed[0].detail}" if failed else None,
            "stages": [{"stage": o.stage, "ok": o.ok, "reason": o.reason or None,
                        "bytes": o.num_bytes, "seconds": round(o.seconds, 6),
                        "wire_s": round(o.wire_s, 6), "ended_at": o.ended_at}
                       for o in stages],
        }  # fmt: skip
