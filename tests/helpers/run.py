"""Running WavePP's processes from the tests: torchrun from the repository's root, and
finding a run's ranks among the machine's processes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# a traceback frame of WavePP's own code (its package's files, not a venv inside a
# checkout that happens to be named wavepp)
OUR_FRAME = re.compile(r'^[\s|]*File "' + re.escape(str(ROOT / "wavepp")) + "/", re.MULTILINE)
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


def rank_pids(tag: str, module: str = "wavepp.main") -> dict[int, int]:
    """Each rank's pid (by its RANK) of the ``module`` run (``wavepp.main``, or the
    server's ``wavepp.serve``) started with ``WAVEPP_TEST_TAG=tag`` in its environment."""
    pids = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if f"WAVEPP_TEST_TAG={tag}".encode() in env and f"\0{module}\0".encode() in cmd:
            for item in env:
                if item.startswith(b"RANK="):
                    pids[int(item[5:])] = int(entry.name)
    return pids


def alive(pid: int) -> bool:
    """The process runs (it exists and is not a zombie)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"
