"""Fault injection: a rank killed (SIGKILL) or stopped (SIGSTOP) mid-run. Every other
rank must exit non-zero within 30 s with a message naming the rank, and torchrun must
report failure. Bounded in time; each test cleans up its processes (the runner:
tests/helpers/faults.py)."""

import signal
import sys

import pytest

from tests.helpers.faults import break_a_rank

pytestmark = pytest.mark.slow

OPTIONS = ("--executor", "sim", "--workload", "short-suffix", "--requests", "4000",
           "--concurrency", "64")  # fmt: skip


def run_and_break(tmp_path, sig: int, victim: int = 2):
    broken = break_a_rank(tmp_path, 4, OPTIONS, victim, sig, settle_s=2)
    last_exit = max(broken.exits.values(), default=float("inf"))
    print(f"{signal.Signals(sig).name} rank {victim}: last other rank exited after "
          f"{last_exit:.2f} s, rc {broken.rc}", file=sys.stderr)  # fmt: skip
    for _, said in sorted(broken.logs.items()):
        for line in said.splitlines():
            if line.startswith("[wavepp rank"):
                print(line[:300], file=sys.stderr)
    assert len(broken.exits) == 3, broken.logs
    return broken.rc, last_exit, "\n".join(broken.logs.values())


def test_killed_rank_fails_the_run_fast(tmp_path):
    rc, last_exit, text = run_and_break(tmp_path, signal.SIGKILL)
    assert rc != 0
    assert last_exit < 30
    ours = [line for line in text.splitlines() if line.startswith("[wavepp rank")]
    assert any("rank 2" in line for line in ours), text[-3000:]


def test_stopped_rank_is_named_and_the_others_exit(tmp_path):
    rc, last_exit, text = run_and_break(tmp_path, signal.SIGSTOP)
    assert rc != 0
    assert last_exit < 30
    assert "rank 2 sent no heartbeat" in text, text[-3000:]
