"""How a rank ends: the signals it takes, how it fails, the status it exits with.

One :class:`Lifecycle` per rank holds what the launch path decides about its end as
fields: whether a failure is being reported, the run's exit status once the run ended,
the signal that interrupted it. Every ``os._exit`` of the launch path is
:meth:`Lifecycle.exit`.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import NoReturn

import anyio
import anyio.to_thread

from wavepp.exec import compute
from wavepp.launch.log import log
from wavepp.transport.base import PlaneError
from wavepp.transport.watchdog import Watchdog

FAULT_GRACE_S = 2.0  # how long a client may answer its callers once the runtime failed
INTERRUPT_GRACE_S = 10.0  # a follower interrupted waits this long for its leader to end
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Lifecycle:
    """One rank's signals, fail-fast and exit status.

    Before the run, or while a failure is being reported (torchrun stops every rank when
    one fails), a signal must not kill the rank before it has said why it fails; while
    the run goes, :meth:`watch` takes them; after it, a signal is the launcher stopping
    every rank because one has exited, and ends this rank with the run's status."""

    def __init__(self, watchdog: Watchdog | None) -> None:
        self.watchdog = watchdog
        self.failing = False  # a failure is being reported: signals no longer interrupt it
        self.ended: int | None = None  # the run's exit status (2 once nothing is runnable)
        self.interrupted: int | None = None  # the signal that stopped the run
        self._interrupted_at = 0.0  # when (monotonic seconds)

    def guard(self) -> None:
        """Signals outside the run go to :meth:`_outside_the_run`."""
        for signum in SIGNALS:
            signal.signal(signum, self._outside_the_run)

    def _outside_the_run(self, signum: int, frame) -> None:
        if self.ended is not None and not self.failing:
            self.exit(self.ended or 128 + signum)
        if not self.failing:
            status = self.watchdog.status if self.watchdog is not None else "starting"
            self.fail(RuntimeError(f"stopped by {signal.Signals(signum).name} while {status}"))

    def end(self, status: int) -> None:
        """The run has ended with ``status``: a signal from now on exits with it."""
        self.ended = status

    @staticmethod
    def hold_signals() -> None:
        """Ignore SIGINT and SIGTERM (a second Ctrl-C must not lose a record or a reason
        being written)."""
        for signum in SIGNALS:
            signal.signal(signum, signal.SIG_IGN)

    def fail(self, error: BaseException) -> NoReturn:
        """Log why this rank fails, tell the peers, exit 1. Where a transfer broke (a
        :class:`PlaneError`) and the watchdog finds a peer gone, that peer is the cause:
        this rank's line leads with it, and the peers learn it (``lost``) rather than
        blame this rank."""
        self.failing = True
        if threading.current_thread() is threading.main_thread():
            # When the run's signal receiver closed, asyncio put the default handlers
            # back: the launcher's SIGTERM (it stops every rank once one fails, often
            # within 0.1 s) would kill this rank silently before it has named the peer
            # that failed.
            self.hold_signals()
        why = reason(error)
        if isinstance(error, SystemExit) and isinstance(error.code, str):
            why = error.code
        peers = ""
        if self.watchdog is not None:
            # the cause already found (watchdog.declare), or let a dead peer's heartbeat
            # go stale
            peers = self.watchdog.fatal or self.watchdog.suspects()
        if peers and broken_link(error):
            self.watchdog.finish(lost=peers)
            log(f"failed: {peers} — here: {why}")
        else:
            if self.watchdog is not None:  # the peers learn why, and whom this rank suspects
                self.watchdog.finish(failure=(why + (f" — {peers}" if peers else ""))[:2000])
            log(f"failed: {why}" + (f" — {peers}" if peers and peers not in why else ""))
        if not any(isinstance(e, SystemExit | PlaneError | KeyboardInterrupt)
                   for e in leaves(error)):  # fmt: skip
            traceback.print_exception(error)
        self.exit(1)

    @staticmethod
    def exit(status: int) -> NoReturn:
        """End the process now: the planes may hold abandoned transfers, not waited on."""
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)

    async def watch(self, scope: anyio.CancelScope, sigterm_drains: bool,
                    drain: Callable[[], None] | None) -> None:  # fmt: skip
        """SIGINT / SIGTERM while the run goes: a peer's failure (torchrun stops the rest)
        or the user's; it cancels ``scope`` and sets :attr:`interrupted`. With
        ``sigterm_drains`` SIGTERM does not interrupt: rank 0 calls ``drain``."""
        watchdog = self.watchdog
        with anyio.open_signal_receiver(*SIGNALS) as signals:
            async for signum in signals:
                if sigterm_drains and signum == signal.SIGTERM:
                    # torchrun's SIGTERM once a rank died is no drain: the fault answers
                    failed = watchdog is not None and (watchdog.fatal or watchdog.died())
                    if drain is not None and not failed:
                        log("SIGTERM: draining (no new requests; the running ones finish)")
                        drain()
                    continue  # a failed peer shows on the planes
                self.interrupted = signum
                if watchdog is not None:  # torchrun stops everyone when one rank dies
                    peers = await anyio.to_thread.run_sync(watchdog.suspects)
                    if peers:
                        watchdog.declare(peers)
                        raise PlaneError(f"stopped by the launcher "
                                         f"({signal.Signals(signum).name})")  # fmt: skip
                scope.cancel()
                return

    def follow(self, work: Callable[[], int], sigterm_drains: bool) -> int:
        """A TP follower's whole run, ``work()`` on the compute thread; its exit status.

        The posts are followed there so that this (main) thread takes signals while they
        wait inside a blocking Gloo call. SIGINT or SIGTERM (the user's, or the
        launcher's) does not end this rank at once: its leader takes the same signal and
        ends the stage (a server drains on SIGTERM, and its stop ends this rank); what
        fails here after the signal — the leader gone — ends it quietly, as an
        interrupted rank, and so does a leader that has not ended within
        INTERRUPT_GRACE_S; unless a peer is found gone (torchrun's signal once a rank
        died): then it fails naming that one."""

        def on_signal(signum: int, frame) -> None:
            if self.interrupted is None and not (sigterm_drains and signum == signal.SIGTERM):
                self.interrupted, self._interrupted_at = signum, time.monotonic()

        for signum in SIGNALS:
            signal.signal(signum, on_signal)
        watchdog = self.watchdog
        if watchdog is not None:
            watchdog.set_status("following its stage leader")
        # the compute thread builds the shard and runs the posts (an interrupted rank
        # exits with it still waiting)
        future = compute.submit(work)
        while True:
            try:
                return future.result(timeout=0.5)
            except concurrent.futures.TimeoutError:
                if (self.interrupted is not None
                        and time.monotonic() - self._interrupted_at > INTERRUPT_GRACE_S):
                    break  # fmt: skip
            except BaseException as error:
                if self.interrupted is None:
                    self.fail(error)
                break
        name = signal.Signals(self.interrupted).name
        peers = (watchdog.fatal or watchdog.suspects()) if watchdog is not None else ""
        if peers:  # the launcher stops every rank once one died: name that one
            watchdog.declare(peers)
            self.fail(PlaneError(f"stopped by the launcher ({name})"))
        if watchdog is not None:  # an interrupted rank ends on purpose: not a cause
            watchdog.finish()
        log(f"interrupted by {name}")
        self.exit(128 + self.interrupted)


def leaves(error: BaseException) -> list[BaseException]:
    """The exceptions inside ``error``'s groups, however nested (task groups nest them)."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for e in error.exceptions for leaf in leaves(e)]
    return [error]


def broken_link(error: BaseException) -> bool:
    """``error`` holds a failed collective or transfer (a peer gone, likely)."""
    return any(isinstance(e, PlaneError) for e in leaves(error))


def blame(watchdog: Watchdog, error: BaseException) -> str:
    """Why the run failed, as this rank tells its callers: the cause already found; for
    a broken transfer the peer gone (after the watchdog's window); else ``error``."""
    if watchdog.fatal:
        return watchdog.fatal
    peers = watchdog.suspects() if broken_link(error) else ""
    return peers or reason(error)


def reason(error: BaseException) -> str:
    """``error`` in one line: every exception inside it, by type."""
    return "; ".join(f"{type(e).__name__}: {e}" for e in leaves(error)) or repr(error)


REFUSED_WAIT_S = 30.0  # a rank > 0 refusing an option waits this long for rank 0 to say why


def refuse_once(error: SystemExit) -> NoReturn:
    """A refused option: rank 0 says why in one line, the other ranks exit quietly (each
    would say the same). A rank > 0 first waits (up to ``REFUSED_WAIT_S``) for torchrun to
    stop it: its own exit would have torchrun stop every rank at once, rank 0 too if it
    had not reached the check yet (a loaded machine), and the line would be lost. Rank 0
    refuses the same options, so it ends the wait within moments; a check that passes on
    rank 0 costs the wait."""
    if int(os.environ.get("RANK", "0") or 0) and isinstance(error.code, str):
        time.sleep(REFUSED_WAIT_S)
        raise SystemExit(2) from None
    raise error
