"""Breaking a rank of a running ``torchrun -m wavepp.main`` or server: kill or stop it
once the run is under way, and collect what every rank said (for ``wavepp.main`` on its
own stderr: torchrun's ``--log-dir`` with ``--redirects 3``, one file per rank, so a line
is known to be that rank's), how long each took to exit, and what the server's clients
were answered."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.helpers.run import ROOT, TORCHRUN, alive, rank_pids


@dataclass(frozen=True)
class Broken:
    rc: int  # torchrun's exit status
    exits: dict[int, float]  # rank -> seconds from the signal to its exit (the others)
    logs: dict[int, str]  # rank -> its stderr
    launcher: str  # torchrun's own output

    def said(self, rank: int) -> str:
        return self.logs.get(rank, "")


def rank_logs(log_dir: Path) -> dict[int, str]:
    """Each local rank's stderr under torchrun's ``--log-dir`` (one node: local = global)."""
    out = {}
    for path in log_dir.glob("*/attempt_*/*/stderr.log"):
        out[int(path.parent.name)] = path.read_text(errors="replace")
    return out


def break_a_rank(tmp_path: Path, nproc: int, options: Sequence[str], victim: int, sig: int,
                 ready: str = "warm-up:", settle_s: float = 1.0,
                 hang_guard_s: float = 120) -> Broken:  # fmt: skip
    """Run ``torchrun --nproc-per-node nproc -m wavepp.main *options``; once rank 0 has
    logged ``ready`` and ``settle_s`` more, send ``sig`` to rank ``victim``; wait (at
    most ``hang_guard_s``) for every other rank and torchrun to end. A stopped victim is
    killed once the others have ended, as an operator would."""
    tag = uuid.uuid4().hex
    log_dir = tmp_path / "logs"
    out_path = tmp_path / "torchrun.out"
    cmd = [*TORCHRUN, f"--nproc-per-node={nproc}", "--log-dir", str(log_dir), "--redirects",
           "3", "-m", "wavepp.main", "--no-progress", *options]  # fmt: skip
    with out_path.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "WAVEPP_TEST_TAG": tag})  # fmt: skip
    try:
        deadline = time.monotonic() + 240  # start-up on a loaded machine: a hang guard
        while ready not in rank_logs(log_dir).get(0, "") and time.monotonic() < deadline:
            assert proc.poll() is None, rank_logs(log_dir)
            time.sleep(0.5)
        assert ready in rank_logs(log_dir).get(0, ""), rank_logs(log_dir)
        pids = rank_pids(tag)
        assert len(pids) == nproc, (pids, rank_logs(log_dir))
        time.sleep(settle_s)  # into the run
        assert proc.poll() is None, rank_logs(log_dir)
        t0 = time.monotonic()
        os.kill(pids[victim], sig)
        others = {rank: pid for rank, pid in pids.items() if rank != victim}
        exits: dict[int, float] = {}
        while len(exits) < len(others) and time.monotonic() - t0 < hang_guard_s:
            for rank, pid in others.items():
                if rank not in exits and not alive(pid):
                    exits[rank] = time.monotonic() - t0
            time.sleep(0.1)
        if sig == signal.SIGSTOP:
            os.kill(pids[victim], signal.SIGKILL)
        rc = proc.wait(timeout=hang_guard_s)
        return Broken(rc, exits, rank_logs(log_dir), out_path.read_text(errors="replace"))
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in rank_pids(tag).values():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


@dataclass(frozen=True)
class BrokenServer:
    rc: int  # the launcher's exit status
    answers: list  # (status, content type, body) of every answer; (None, error) for none
    text: str  # the launcher's stderr: every rank's lines, torchrun's, its own


def load(url: str, answers: list, stop: threading.Event, worker: int) -> None:
    """Prefill requests of 200 token ids below 401 one after another until told to stop
    or one is not a 200; each answer is (status, content type, body), or (None, "", the
    error) where none came."""
    with httpx.Client(base_url=url, timeout=120) as client:
        n = 0
        while not stop.is_set():
            tokens = [(worker * 37 + n * 11 + k) % 400 + 1 for k in range(200)]
            try:
                reply = client.post("/v1/prefill", json={"tokens": tokens})
            except httpx.HTTPError as error:
                answers.append((None, "", type(error).__name__))
                return
            answers.append((reply.status_code, reply.headers.get("content-type", ""),
                            reply.text))  # fmt: skip
            if reply.status_code != 200:
                return
            n += 1


def break_a_serving_rank(tmp_path: Path, nproc: int, options: Sequence[str], victim: int,
                         sig: int, hang_guard_s: float = 180) -> BrokenServer:  # fmt: skip
    """``python -m wavepp.serve.launch --nproc-per-node nproc *options`` under light load
    (three clients); once six requests were answered, send ``sig`` to rank ``victim``
    and wait (at most ``hang_guard_s``) for the launcher to end."""
    tag = uuid.uuid4().hex
    err_path = tmp_path / "server.err"
    cmd = [sys.executable, "-m", "wavepp.serve.launch", f"--nproc-per-node={nproc}", "--host",
           "127.0.0.1", "--port", "0", "--no-progress", *options]  # fmt: skip
    with err_path.open("w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err,
                                env={**os.environ, "WAVEPP_TEST_TAG": tag})  # fmt: skip
    stop = threading.Event()
    workers: list[threading.Thread] = []
    try:
        deadline, match = time.monotonic() + 240, None  # start-up: a hang guard
        while not match and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.3)
            match = re.search(r"listening on (http://\S+)", err_path.read_text())
        assert match, err_path.read_text()[-4000:]
        pids = rank_pids(tag, "wavepp.serve")
        assert len(pids) == nproc, (pids, err_path.read_text()[-4000:])
        answers: list = []
        workers = [threading.Thread(target=load, args=(match.group(1), answers, stop, i))
                   for i in range(3)]  # fmt: skip
        for thread in workers:
            thread.start()
        while sum(1 for a in answers if a[0] == 200) < 6:
            assert proc.poll() is None and time.monotonic() < deadline, (
                answers[-3:], err_path.read_text()[-4000:])  # fmt: skip
            time.sleep(0.2)
        os.kill(pids[victim], sig)
        rc = proc.wait(timeout=hang_guard_s)
        stop.set()
        for thread in workers:
            thread.join(timeout=hang_guard_s)
        return BrokenServer(rc, answers, err_path.read_text(errors="replace"))
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
        for pid in rank_pids(tag, "wavepp.serve").values():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
