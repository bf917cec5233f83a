"""Fault injection: a rank killed (SIGKILL) or stopped (SIGSTOP) mid-run. Every other
rank must exit non-zero within 30 s with a message naming the rank, and torchrun must
report failure. Bounded in time; each test cleans up its processes."""

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.helpers.run import ROOT, TORCHRUN, alive, rank_pids

pytestmark = pytest.mark.slow


def run_and_break(tmp_path, sig: int, victim: int = 2):
    tag = uuid.uuid4().hex
    log = tmp_path / "run.log"
    cmd = [*TORCHRUN, "--nproc-per-node=4", "-m", "wavepp.main", "--executor", "sim",
           "--workload", "short-suffix", "--requests", "4000", "--concurrency", "64",
           "--no-progress"]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "WAVEPP_TEST_TAG": tag})  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        pids = {}
        while len(pids) < 4 and time.monotonic() < deadline:
            time.sleep(0.5)
            pids = rank_pids(tag)
        assert len(pids) == 4, log.read_text()[-3000:]
        while "warm-up:" not in log.read_text() and time.monotonic() < deadline + 120:
            time.sleep(0.5)  # a loaded machine may still be importing torch: wait for the run
        assert "warm-up:" in log.read_text(), log.read_text()[-3000:]
        time.sleep(2)  # well into the run
        assert proc.poll() is None, log.read_text()[-3000:]
        t0 = time.monotonic()
        os.kill(pids[victim], sig)
        others = [pid for rank, pid in pids.items() if rank != victim]
        while any(alive(p) for p in others) and time.monotonic() - t0 < 60:
            time.sleep(0.1)
        last_exit = time.monotonic() - t0
        if sig == signal.SIGSTOP:
            os.kill(pids[victim], signal.SIGKILL)  # what an operator would do next
        rc = proc.wait(timeout=90)
        torchrun_exit = time.monotonic() - t0
        text = log.read_text()
        for line in text.splitlines():
            if line.startswith("[wavepp rank"):
                print(line[:300], file=sys.stderr)
        return rc, last_exit, torchrun_exit, text
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in rank_pids(tag).values():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def test_killed_rank_fails_the_run_fast(tmp_path):
    rc, last_exit, torchrun_exit, text = run_and_break(tmp_path, signal.SIGKILL)
    print(f"SIGKILL rank 2: last other rank exited after {last_exit:.2f} s, "
          f"torchrun after {torchrun_exit:.2f} s, rc {rc}", file=sys.stderr)  # fmt: skip
    assert rc != 0
    assert last_exit < 30
    ours = [line for line in text.splitlines() if line.startswith("[wavepp rank")]
    assert any("rank 2" in line for line in ours), text[-3000:]


def test_stopped_rank_is_named_and_the_others_exit(tmp_path):
    rc, last_exit, torchrun_exit, text = run_and_break(tmp_path, signal.SIGSTOP)
    print(f"SIGSTOP rank 2: last other rank exited after {last_exit:.2f} s, "
          f"torchrun after {torchrun_exit:.2f} s, rc {rc}", file=sys.stderr)  # fmt: skip
    assert rc != 0
    assert last_exit < 30
    assert "rank 2 sent no heartbeat" in text, text[-3000:]
