"""Heartbeats beside the planes, so that a dead or hung rank is named fast (DESIGN §9).

Every rank runs a small thread that, once a second, writes a beat counter and what the
rank is doing ("waiting for a wave from rank 1", "rounds plane: all_min") to the
rendezvous store (the TCP store ``torchrun`` hosts, which outlives any rank), and reads
the others'. A rank whose counter has not moved for ``dead_after_s`` (killed, stopped,
or stuck with the GIL held) is reported by name with its last status, and this rank
exits non-zero; ``torchrun`` then stops the rest and reports the failure. A rank that
fails on its own writes why, so its peers can name it too.
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

_PREFIX = "wavepp/heartbeat/"
_STATS = "wavepp/stats/"


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

    def _read(self, rank: int) -> str | None:
        key = f"{_PREFIX}{rank}"
        with self._lock:
            if not self._store.check([key]):
                return None
            return self._store.get(key).decode(errors="replace")

    def _run(self) -> None:
        beat, started = 0, time.monotonic()
        while not self._stop.is_set():
            beat += 1
            try:
                self._write(f"{beat}|{self.status}")
                if self._stats_fn is not None:
                    with self._lock:
                        self._store.set(f"{_STATS}{self.rank}", json.dumps(self._stats_fn()))
                problem = self._check(started)
            except Exception as error:  # the store itself is gone: the launcher died
                problem = f"lost the rendezvous store ({error})"
            if problem:
                self.declare(problem)
                self.log(f"rank {self.rank}: {problem}; this rank was {self.status}")
                self._answered.wait(self.fault_grace_s)
                os._exit(1)
            self._stop.wait(self.interval_s)

    def _check(self, started: float) -> str | None:
        now = time.monotonic()
        for rank in range(self.world):
            if rank == self.rank:
                continue
            value = self._read(rank)
            if value is None:
                if now - started > self.dead_after_s:
                    return f"{self.name(rank)} never sent a heartbeat in {now - started:.1f} s"
                continue
            counter, _, status = value.partition("|")
            if counter in ("done", "failed"):
                if counter == "failed":
                    return f"{self.name(rank)} failed: {status}"
                continue
            last = self._seen.get(rank)
            if last is None or last[0] != counter:
                self._seen[rank] = (counter, now)
            elif now - last[1] > self.dead_after_s:
                return (
                    f"{self.name(rank)} sent no heartbeat for {now - last[1]:.1f} s "
                    f"(dead or hung; it was {status})"
                )
        return None

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
        that finished (:meth:`finish` without a failure) is neither.

        Silent peers come first, the longest silent first: when one rank dies, the launcher
        stops the others a moment later, so the rank silent longest is the likely cause.
        """
        failed, silent = [], []
        now = time.monotonic()
        for rank in range(self.world):
            if rank == self.rank:
                continue
            try:
                value = self._read(rank) or ""
            except Exception:
                return self.fatal or ""
            counter, _, status = value.partition("|")
            if counter == "done":  # it ended its run and stopped beating on purpose
                continue
            if counter == "failed":
                failed.append(f"{self.name(rank)} failed: {status}")
            elif rank in self._seen and self._seen[rank][0] != counter:
                # it beat since this rank's heartbeat thread last looked (a thread starved
                # on a loaded host looks late): alive
                self._seen[rank] = (counter, now)
            elif rank in self._seen and now - self._seen[rank][1] > 2 * self.interval_s:
                quiet = now - self._seen[rank][1]
                silent.append((quiet, f"{self.name(rank)} stopped beating {quiet:.1f} s ago "
                                      f"(it was {status})"))  # fmt: skip
        silent.sort(key=lambda item: -item[0])
        first = [self.fatal] if self.fatal else []
        return "; ".join(first + [note for _, note in silent] + failed)

    def suspects(self, window_s: float = 4.0) -> str:
        """``peer_report`` after a window long enough for a just-killed peer to go quiet.

        A rank that fails because a peer died often learns it within a second, before the
        dead peer's heartbeat is stale, while a rank the launcher is already stopping may
        look quiet first; reporting at the first non-empty answer would name the wrong one.
        """
        deadline = time.monotonic() + window_s
        report = self.peer_report()
        while time.monotonic() < deadline:
            time.sleep(0.5)
            report = self.peer_report() or report
        return report

    def finish(self, failure: str | None = None) -> None:
        """Stop beating; peers then ignore this rank (or learn why it failed).

        A run that ends well returns once the heartbeat thread has stopped (waiting as
        long as one store call may take): a daemon thread still inside a store call when
        the interpreter shuts down aborts the process as the call comes back ("terminate
        called without an active exception", SIGABRT). A failing rank does not wait: it
        leaves by ``os._exit``, and its heartbeat thread may be the one ending it."""
        self._stop.set()
        with contextlib.suppress(Exception):  # the store may be gone with the launcher
            self._write(f"failed|{failure}" if failure else "done|finished", final=True)
        if failure is None and self._thread.is_alive() and (
                self._thread is not threading.current_thread()):  # fmt: skip
            self._thread.join(self._store_timeout_s + self.interval_s)
