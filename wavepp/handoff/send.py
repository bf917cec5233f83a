"""Each stage hands its band of a finished request's cache to a receiver (docs/handoff.md).

When a request that asked for a handoff ends on a stage, the stage keeps its blocks
leased — they stay protected in the pool, nothing is copied — and :meth:`HandoffSender.send`
gets its :class:`~wavepp.handoff.base.BandJob`; the sender is a task beside the stage's
LOOP. For each band it asks the stage's executor for the band's tensors, waits for room
in the byte budget and hands the band to the transport of its address's kind
(``wavepp.handoff.base``); whatever ends it — acknowledged, refused, timed out,
disconnected or cancelled — it releases the blocks through the stage's callback, once the
transport no longer reads them, and keeps the band's
:class:`~wavepp.rounds.messages.HandoffOutcome` (the whole time since the last chunk, and
of it the time on the wire) for :meth:`~HandoffSender.poll`; :meth:`~HandoffSender.settled`
waits for one.

Memory: at most ``budget_bytes`` of bands are on their way at once per stage; a band
that does not fit waits its turn (its blocks stay in the pool) and one larger than the
whole budget goes alone. ``timeout_s`` bounds a pushed band from the request's last chunk
to the acknowledgement, the waits for the budget and for a thread included. A band for a
``pull:`` target waits on the stage's band server (``wavepp.handoff.pull``) under a lease
instead: ``lease_s`` from the request's last chunk here, holding no budget; once its
decoder has come the lease stops, and the pull has ``timeout_s`` from then, the wait
for the budget included. A lease that runs out settles the band ``expired``. Threads: a
transport's blocking work runs in the sender's worker threads, at most ``BAND_THREADS``
at once, counted apart from the threads of the rest of the process (the planes'): bands
stuck on receivers that stopped reading hold threads until their timeouts, and must not
stall the waves.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from functools import partial

import anyio

from wavepp.handoff import wire
from wavepp.handoff.base import (
    Band,
    BandFailed,
    BandJob,
    BandTensor,
    HandoffSettings,
    Transport,
    TransportClass,
    WorkerThreads,
)
from wavepp.handoff.pull import PullTransport
from wavepp.handoff.socket_send import SocketTransport
from wavepp.rounds.messages import HandoffOutcome
from wavepp.state import RequestId

BAND_THREADS = 8  # a stage's bands on their way in worker threads at once
# every transport a stage has: WavePP's wire over sockets, pulls from the stage's band server
TRANSPORTS: tuple[TransportClass, ...] = (SocketTransport, PullTransport)


class HandoffSender:
    """One stage's sender, the same for every transport. Its seam, as SGLang's
    ``disaggregation/base/conn.py`` has it: :meth:`send` a band, :meth:`abort` one,
    :meth:`poll` the outcomes settled since (each band's failure, if any, is its
    outcome's ``reason`` and ``detail``); the sender is built with everything it calls."""

    def __init__(
        self, settings: HandoffSettings, band: Callable[[BandJob], Sequence[BandTensor]],
        release: Callable[[RequestId], None], *,
        transports: Sequence[TransportClass] = TRANSPORTS,
        thread_setup: Callable[[], None] = lambda: None,
    ) -> None:  # fmt: skip
        """``band(job)``: the job's tensors, from the stage's executor. ``release(rid)``:
        called once per job when its band has ended, however it ended. ``transports``:
        the transports' classes, each built here with the settings and the worker
        threads. ``thread_setup``: run first in each worker thread (the executor keeps
        OpenMP teams out of threads other than its compute thread)."""
        if sys.byteorder != "little":
            raise RuntimeError("the handoff wire format is little-endian; this host is not")
        self.settings = settings
        self._band = band
        self._release = release
        # the bands' own worker threads: a band stuck on a receiver that stopped reading
        # holds one until its timeout, and must not hold one the planes' threads need
        self._threads = WorkerThreads(BAND_THREADS, thread_setup)
        self._all = [make(settings, self._threads) for make in transports]
        self._transports: dict[str, Transport] = {}  # by address kind: the first that serves it
        for transport in self._all:
            for kind in transport.kinds:
                self._transports.setdefault(kind, transport)
        self._send_jobs, self._jobs = anyio.create_memory_object_stream[BandJob](math.inf)
        self._scopes: dict[RequestId, anyio.CancelScope] = {}
        self._aborted: set[RequestId] = set()  # aborted before their task started
        self._in_use = 0  # budget bytes held by bands on their way
        self._budget_freed = anyio.Event()
        self._outcomes: list[HandoffOutcome] = []  # settled since the last poll()
        self._wake = anyio.Event()  # set when an outcome settles (for settled())
        self.num_pending = 0  # jobs sent and not settled

    @property
    def address(self) -> str | None:
        """Where this stage's band server is reached (``pull:`` targets), or None."""
        return next((t.address for t in self._all if t.address), None)

    def figures(self) -> dict[str, float]:
        """The transports' counts (bands parked for pulling, pulls refused, ...)."""
        out: dict[str, float] = {}
        for transport in self._all:
            out.update(transport.figures())
        return out

    # -- the seam ------------------------------------------------------------------

    def send(self, job: BandJob) -> None:
        """Put the job's band on its way (at once: it waits its turn in :meth:`run`)."""
        self.num_pending += 1
        self._send_jobs.send_nowait(job)

    def abort(self, rid: RequestId) -> None:
        """The request was cancelled: stop its band wherever it is. Its blocks are
        released as for any other end (the callback), once nothing reads them."""
        scope = self._scopes.get(rid)
        if scope is not None:
            scope.cancel()
        else:
            self._aborted.add(rid)

    def poll(self) -> list[HandoffOutcome]:
        """The outcomes of the bands settled since the last call."""
        out, self._outcomes = self._outcomes, []
        return out

    async def settled(self) -> list[HandoffOutcome]:
        """:meth:`poll`, once it has an outcome to give (one waiter at a time: the
        runtime's task that passes outcomes on to rank 0)."""
        while not self._outcomes:
            self._wake = anyio.Event()
            await self._wake.wait()
        return self.poll()

    # -- running -------------------------------------------------------------------

    async def run(self) -> None:
        """Serve jobs (and the transports' servers) until cancelled (the run is over)."""
        async with anyio.create_task_group() as tg, self._jobs:
            for transport in self._all:
                tg.start_soon(transport.run)
            async for job in self._jobs:
                if job.request_id in self._aborted:
                    self._aborted.discard(job.request_id)
                    self._settle(job, "cancelled", "cancelled before its band left", 0)
                    continue
                scope = anyio.CancelScope()
                self._scopes[job.request_id] = scope
                tg.start_soon(self._one, job, scope)

    async def _one(self, job: BandJob, scope: anyio.CancelScope) -> None:
        reason, detail, sent = "", "", 0
        band, parks = None, False
        with scope:
            try:
                address = self._address(job)
                transport = self._transports[address.kind]
                parks = transport.parks
                waits = self.settings.lease_s if parks else self.settings.timeout_s
                deadline = job.ended_at + waits
                with anyio.fail_after(max(deadline - time.monotonic(), 0.0)) as limit:
                    band = Band(job, address, deadline, self._turn,
                                partial(self._claimed, limit))  # fmt: skip
                    if parks:
                        sent = await transport.deliver(band)
                    else:
                        async with band.turn():
                            sent = await transport.deliver(band)
            except TimeoutError:
                if parks and band is not None and not band.claimed:
                    reason = "expired"
                    detail = f"not pulled within the lease of {self.settings.lease_s:g} s"
                else:
                    reason = "timeout"
                    detail = f"not acknowledged within {self.settings.timeout_s:g} s"
            except BandFailed as failure:
                reason, detail = failure.reason, failure.detail
            except Exception as error:
                reason, detail = "error", f"{type(error).__name__}: {error}"
        if scope.cancelled_caught:
            reason, detail = "cancelled", "the request was cancelled during its handoff"
        self._scopes.pop(job.request_id, None)
        self._settle(job, reason, detail, sent, 0.0 if band is None else band.wire_s)

    def _claimed(self, limit: anyio.CancelScope, band: Band) -> None:
        """A parked band's decoder has come: the lease stops, the timeout starts."""
        limit.deadline = anyio.current_time() + self.settings.timeout_s
        band.deadline = time.monotonic() + self.settings.timeout_s

    @contextlib.asynccontextmanager
    async def _turn(self, band: Band) -> AsyncIterator[None]:
        """The band's tensors from the stage's executor, and its share of the budget
        while it goes out."""
        band.tensors = self._band(band.job)
        held = min(band.num_bytes, self.settings.budget_bytes)
        await self._acquire(held)
        try:
            yield
        finally:
            self._in_use -= held
            self._budget_freed.set()  # every waiter looks again
            self._budget_freed = anyio.Event()

    def _address(self, job: BandJob) -> wire.Address:
        try:
            address = wire.parse_target(job.target)
        except ValueError as error:
            raise BandFailed("error", str(error)) from None
        if address.kind not in self._transports:
            raise BandFailed("error", f"{job.target}: this stage has no transport for "
                             f"{address.kind} addresses")  # fmt: skip
        return address

    def _settle(self, job: BandJob, reason: str, detail: str, sent: int,
                wire_s: float = 0.0) -> None:  # fmt: skip
        self.num_pending -= 1
        self._release(job.request_id)
        seconds = max(time.monotonic() - job.ended_at, 0.0)
        self._outcomes.append(HandoffOutcome(job.request_id, self.settings.stage, not reason,
                                             reason, detail[:1024], sent, seconds,
                                             job.ended_wall, min(wire_s, seconds)))  # fmt: skip
        self._wake.set()

    async def _acquire(self, num_bytes: int) -> None:
        while self._in_use and self._in_use + num_bytes > self.settings.budget_bytes:
            await self._budget_freed.wait()
        self._in_use += num_bytes

