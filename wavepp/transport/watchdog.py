"""Heartbeats beside the planes, so that a dead or hung rank is named fast (DESIGN §9).

Every rank runs a small thread that, once a second, writes a beat counter and what the
rank is doing ("waiting for a wave from rank 1", "rounds plane: all_min") to the
rendezvous store (the TCP store ``torchrun`` hosts, which outlives any rank), and reads
the others'. A rank whose counter has not moved for ``dead_after_s`` (killed, stopped,
or stuck with the GIL held) is reported by name with its last status — at once where its
process, on this machine, has ended (``wavepp.transport.processes``) — and this rank
exits non-zero; ``torchrun`` then stops the rest and reports the failure. A rank that
fails on its own writes why (``failed``), so its peers can name it too; a rank that fails
because of a peer (found here, or a transfer to it broken) writes that peer's name
(``lost``), so every rank names the one that died rather than the first to notice.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from wavepp.transport import processes

_PREFIX = "wavepp/heartbeat/"
_STATS = "wavepp/stats/"
_PROCESS = "wavepp/process/"
_FINAL = ("done", "failed", "lost")  # a rank's last word: it ended (well), failed, lost a peer


class Watchdog:
    def __init__(
        self, rank: int, world: int, log: Callable[[str], None],
        interval_s: float = 1.0, dead_after_s: float = 10.0, fault_grace_s: float = 0.0,
        tp: int = 1,
    ) -> None:  # fmt: skip
        """``fault_grace_s``: once a peer is found dead or hung, how long this rank lives on
        (its :attr:`fatal` set) so that a server can answer its callers before it exits.
        ``tp``: ranks per stage (``--tp``; stage s is ranks s*tp ..), to name a rank's
        stage and to key the stages' figures by stage."""
        self.rank, self.world, self.log, self.tp = rank, world, log, tp
        self.interval_s, self.dead_after_s = interval_s, dead_after_s
        self.fault_grace_s = fault_grace_s
        self._answered = threading.Event()  # the server answered its callers: no more grace
        self.fatal: str | None = None  # why this run can no longer answer (set once)
        self._on_fatal: list[Callable[[str], None]] = []
        self.status = "starting"
        self._stop = threading.Event()
        self._store_timeout_s = max(5.0, dead_after_s)  # the longest one store call waits
        self._store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
            timeout=datetime.timedelta(seconds=self._store_timeout_s), wait_for_workers=False,
        )  # fmt: skip
        self._lock = threading.Lock()  # one store client, used from two threads
        self._seen: dict[int, tuple[str, float]] = {}  # rank -> (beat, when it last moved)
        # where each rank's process runs, so a peer on this machine sees it end at once
        self._here = processes.machine()
        self._where: dict[int, str] = {}  # rank -> its whereabouts, once read
        self._store.set(f"{_PROCESS}{rank}", processes.whereabouts())
        self._thread = threading.Thread(target=self._run, name="wavepp-watchdog", daemon=True)
        # Figures this rank publishes with each beat (its stage's busy time and pool use),
        # read by rank 0 for metrics; numbers only.
        self._stats_fn: Callable[[], dict[str, float]] | None = None

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def publish(self, figures: Callable[[], dict[str, float]]) -> None:
        """From now on each beat carries ``figures()`` (the stage, built after the
        watchdog started, publishes its busy time and pool use for rank 0's metrics)."""
        self._stats_fn = figures

    def set_status(self, text: str) -> None:
        self.status = text

    def _write(self, value: str, final: bool = False) -> None:
        """This rank's heartbeat entry; once :meth:`finish` has begun, only its final
        word (a beat already past the stop check must not overwrite "done" or "failed")."""
        with self._lock:
            if final or not self._stop.is_set():
                self._store.set(f"{_PREFIX}{self.rank}", value)

    def _read(self, rank: int, prefix: str = _PREFIX) -> str | None:
        key = f"{prefix}{rank}"
        with self._lock:
            if not self._store.check([key]):
                return None
            return self._store.get(key).decode(errors="replace")

    def _look(self, rank: int) -> tuple[str, str, processes.Fate | None] | None:
        """What rank's entry says — its counter (a beat, or a last word of ``_FINAL``,
        or "died": its process on this machine ended without one) and status — and
        what became of its process; None before its first beat."""
        value = self._read(rank)
        if value is None:
            return None
        counter, _, status = value.partition("|")
        if counter in _FINAL:
            return counter, status, None
        fate = self._fate(rank)
        if fate == "ended":  # a last word written just before it exited is read now
            counter, _, status = (self._read(rank) or value).partition("|")
            return (counter if counter in _FINAL else "died"), status, fate
        return counter, status, fate

    def _fate(self, rank: int) -> processes.Fate | None:
        if self._here is None:
            return None
        if rank not in self._where:
            where = self._read(rank, _PROCESS)
            if where is None:
                return None
            self._where[rank] = where
        return processes.fate(self._where[rank], self._here)

    def _died(self, rank: int, status: str) -> str:
        return f"{self.name(rank)} died (its process ended; it was {status})"

    @staticmethod
    def _why_quiet(fate: processes.Fate | None, status: str) -> str:
        return ("its process is stopped" if fate == "stopped" else "dead or hung") + (
            f"; it was {status}")

    def _run(self) -> None:
        beat, started = 0, time.monotonic()
        while not self._stop.is_set():
            beat += 1
            cause = None
            try:
                self._write(f"{beat}|{self.status}")
                if self._stats_fn is not None:
                    with self._lock:
                        self._store.set(f"{_STATS}{self.rank}", json.dumps(self._stats_fn()))
                problem, cause = self._check(started)
            except Exception as error:  # the store itself is gone: the launcher died
                problem = f"lost the rendezvous store ({error})"
            if problem:
                if cause:  # the others learn whom this rank lost, not just that it ended
                    with contextlib.suppress(Exception):
                        self._write(f"lost|{cause}"[:2000], final=True)
                self.declare(problem)
                self.log(f"rank {self.rank}: {problem}; this rank was {self.status}")
                self._answered.wait(self.fault_grace_s)
                os._exit(1)
            self._stop.wait(self.interval_s)

    def _check(self, started: float) -> tuple[str | None, str | None]:
        """(what is wrong, the cause to pass on), or (None, None): a peer that never
        beat, stopped beating, failed, or lost a peer of its own."""
        now = time.monotonic()
        for rank in range(self.world):
            if rank == self.rank:
                continue
            looked = self._look(rank)
            if looked is None:
                if now - started > self.dead_after_s:
                    problem = f"{self.name(rank)} never sent a heartbeat in {now - started:.1f} s"
                    return problem, problem
                continue
            counter, status, fate = looked
            if counter == "done":
                continue
            if counter == "failed":
                problem = f"{self.name(rank)} failed: {status}"
                return problem, problem
            if counter == "lost":
                return self._as_found(rank, status), status
            if counter == "died":
                problem = self._died(rank, status)
                return problem, problem
            last = self._seen.get(rank)
            if last is None or last[0] != counter:
                self._seen[rank] = (counter, now)
            elif now - last[1] > self.dead_after_s:
                problem = (f"{self.name(rank)} sent no heartbeat for {now - last[1]:.1f} s "
                           f"({self._why_quiet(fate, status)})")  # fmt: skip
                return problem, problem
        return None, None

    def _as_found(self, rank: int, cause: str) -> str:
        return f"{cause} (as {self.name(rank)} found)"

    def declare(self, problem: str) -> None:
        """The run has failed (a peer dead, hung or gone): :attr:`fatal` says why, first
        cause kept, and :meth:`peer_report` leads with it."""
        if self.fatal is not None:
            return
        self.fatal = problem[:2000]
        for callback in list(self._on_fatal):
            callback(self.fatal)

    def answered(self) -> None:
        """The server has answered every caller (or stopped): a fault need not wait out the
        rest of ``fault_grace_s`` before this rank exits."""
        self._answered.set()

    def when_fatal(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(why)`` once the run has failed (at once if it has), from the
        thread that finds it: the heartbeat thread, or the one calling :meth:`declare`."""
        self._on_fatal.append(callback)
        if self.fatal is not None:
            callback(self.fatal)

    def name(self, rank: int) -> str:
        if self.tp == 1:
            return f"rank {rank}"
        return f"rank {rank} (stage {rank // self.tp}, TP rank {rank % self.tp})"

    def peer_stats(self) -> dict[int, dict[str, float]]:
        """The other stages' latest published figures, by stage (each stage's first rank
        publishes them; untrusted: numbers only, bounded)."""
        out: dict[int, dict[str, float]] = {}
        for rank in range(self.world):
            if rank == self.rank:
                continue
            key = f"{_STATS}{rank}"
            try:
                with self._lock:
                    if not self._store.check([key]):
                        continue
                    raw = self._store.get(key)
                data = json.loads(raw[:4096]) if len(raw) <= 4096 else {}
            except Exception:  # a gone store or junk: no figures from that rank
                continue
            if isinstance(data, dict):
                out[rank // self.tp] = {str(k)[:64]: float(v) for k, v in list(data.items())[:32]
                             if isinstance(v, int | float) and not isinstance(v, bool)}  # fmt: skip
        return out

    def peer_report(self) -> str:
        """Which peers failed or look gone, for an error message; empty if none. A peer
        that finished (:meth:`finish` without a failure) is neither."""
        return self._report()[0]

    def _report(self) -> tuple[str, bool]:
        """:meth:`peer_report`, and whether a peer's process is seen to have ended.

        Peers whose process ended come first, then silent peers, the longest silent
        first: when one rank dies, the launcher stops the others a moment later, so the
        rank silent longest is the likely cause. A peer's word on whom it lost counts
        only where no peer is seen gone here."""
        died, failed, lost, silent = [], [], [], []
        now = time.monotonic()
        for rank in range(self.world):
            if rank == self.rank:
                continue
            try:
                counter, status, fate = self._look(rank) or ("", "", None)
            except Exception:
                return self.fatal or "", False
            if counter == "done":  # it ended its run and stopped beating on purpose
                continue
            if counter == "died":
                died.append(self._died(rank, status))
            elif counter == "failed":
                failed.append(f"{self.name(rank)} failed: {status}")
            elif counter == "lost":
                lost.append(self._as_found(rank, status))
            elif rank in self._seen and self._seen[rank][0] != counter:
                # it beat since this rank's heartbeat thread last looked (a thread starved
                # on a loaded host looks late): alive
                self._seen[rank] = (counter, now)
            elif rank in self._seen and now - self._seen[rank][1] > 2 * self.interval_s:
                quiet = now - self._seen[rank][1]
                silent.append((quiet, f"{self.name(rank)} stopped beating {quiet:.1f} s ago "
                                      f"({self._why_quiet(fate, status)})"))  # fmt: skip
        silent.sort(key=lambda item: -item[0])
        first = [self.fatal] if self.fatal else []
        gone = died + [note for _, note in silent]
        return "; ".join(first + (gone or lost) + failed), bool(died)

    def died(self) -> str:
        """The peers on this machine whose process ended without a last word (killed,
        crashed), named; empty if none (or none can be seen from here)."""
        out = []
        for rank in range(self.world):
            if rank != self.rank:
                with contextlib.suppress(Exception):  # the store gone: nothing to say
                    looked = self._look(rank)
                    if looked is not None and looked[0] == "died":
                        out.append(self._died(rank, looked[1]))
        return "; ".join(out)

    def suspects(self, window_s: float = 4.0) -> str:
        """``peer_report`` after a window long enough for a just-killed peer to go quiet,
        or as soon as a peer's process is seen to have ended.

        A rank that fails because a peer died often learns it within a second, before the
        dead peer's heartbeat is stale, while a rank the launcher is already stopping may
        look quiet first; reporting at the first non-empty answer would name the wrong one.
        A process that ended is no guess: the launcher's stopping takes the others longer.
        """
        deadline = time.monotonic() + window_s
        report, certain = self._report()
        while not certain and time.monotonic() < deadline:
            time.sleep(0.5)
            latest, certain = self._report()
            report = latest or report
        return report

    def finish(self, failure: str | None = None, lost: str | None = None) -> None:
        """Stop beating; peers then ignore this rank, or learn why it failed
        (``failure``), or which peer it failed for (``lost``: that peer's name and what
        became of it, which the others then repeat).

        A run that ends well returns once the heartbeat thread has stopped (waiting as
        long as one store call may take): a daemon thread still inside a store call when
        the interpreter shuts down aborts the process as the call comes back ("terminate
        called without an active exception", SIGABRT). A failing rank does not wait: it
        leaves by ``os._exit``, and its heartbeat thread may be the one ending it."""
        self._stop.set()
        with contextlib.suppress(Exception):  # the store may be gone with the launcher
            word = (f"lost|{lost}" if lost else f"failed|{failure}" if failure
                    else "done|finished")  # fmt: skip
            self._write(word[:2000], final=True)
        if failure is None and lost is None and self._thread.is_alive() and (
                self._thread is not threading.current_thread()):  # fmt: skip
            self._thread.join(self._store_timeout_s + self.interval_s)
