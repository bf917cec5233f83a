"""Rank 0's book on each request, and what a caller gets back."""

from __future__ import annotations

import anyio
import attrs

from wavepp.errors import RequestRejected as RequestRejected  # re-exported
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






STATUSES = ("queued", "admitted", "running", "done", "cancelled", "rejected", "failed")


@attrs.frozen
class Result:
    """How one request ended, with its timings (``time.time()`` seconds)."""

    request_id: str
    status: str  # "done" | "cancelled" | "rejected" | "failed"
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
    """Rank 0's book on one request."""

    spec: RequestSpec
    offer: object  # wavepp.rounds.admission.Offer: what admission rounds see
    priority: int = 0
    released_at: float | None = None  # submitted: entered the waiting queue
    admitted_at: float | None = None
    first_chunk_at: float | None = None  # its first chunk left stage 0's planner
    done_at: float | None = None
    cached_tokens: int = 0
    first_token: int = -1
    top_logit: float = 0.0
    error: str | None = None
    cancelled: bool = False  # a cancel was asked for; settled when every stage dropped it
    status: str = "queued"
    miss_reason: str | None = None  # why it reused < 80% of its expected reuse
    prefilled: bool = False  # its first token came back (a handoff may still be under way)
    handoff_outcomes: dict = attrs.field(factory=dict)  # stage -> HandoffOutcome
    finished: anyio.Event = attrs.field(factory=anyio.Event)

    def result(self) -> Result:
        done = self.status == "done"
        return Result(
            request_id=self.spec.request_id,
            status=self.status,
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
        if deadline_s is None or self.status == "rejected":
            return None
        if self.status != "done" or self.done_at is None or self.released_at is None:
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
        elif self.status == "done":
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
                        "ended_at": o.ended_at}
                       for o in stages],
        }  # fmt: skip
