"""Launch real multi-process runs: torchrun, Gloo, localhost."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def torchrun(nproc: int, args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = [*TORCHRUN, f"--nproc-per-node={nproc}", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"exit {proc.returncode}: {' '.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def run_plain(cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    """Run a command from the repository root, whatever its exit status."""
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def run_wavepp(tmp_path):
    def run(nproc: int, *options: str, timeout: float = 240) -> tuple[dict, str]:
        out = tmp_path / f"run-{len(list(tmp_path.iterdir()))}.json"
        proc = torchrun(
            nproc, ["-m", "wavepp.main", "--no-progress", "--json", str(out), *options], timeout
        )
        return json.loads(out.read_text()), proc.stdout

    return run
