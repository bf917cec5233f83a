"""The server under test: ``python -m wavepp.serve.launch`` on a free port of 127.0.0.1."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Sequence

from tests.helpers.run import ROOT

MODEL = ["--model", "tiny-hybrid", "--seed", "0", "--block-size", "16", "--capacity-blocks", "512"]
MAX_BODY = 64 * 1024
READY = re.compile(r"listening on (http://\S+) \(pid (\d+)\)")


def start_server(tmp_path, options: Sequence[str] = MODEL,
                 nproc: int = 2) -> tuple[subprocess.Popen, str, int]:  # fmt: skip
    """python -m wavepp.serve.launch (torchrun --standalone ... -m wavepp.serve under it) on
    --port 0 (the server binds a free port and names it in its ready line: no window for
    another process to take it); returns (the launcher's process, url, pid of the serving
    rank). ``options``: the model and run options (a tiny hybrid by default); ``nproc``:
    the ranks."""
    err = open(tmp_path / "server.err", "w")  # noqa: SIM115 (the child holds it)
    out = open(tmp_path / "server.out", "w")  # noqa: SIM115
    cmd = [
        sys.executable,
        "-m",
        "wavepp.serve.launch",
        "--nproc-per-node",
        str(nproc),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        *options,
        "--concurrency",
        "8",
        "--no-progress",
        "--max-body-bytes",
        str(MAX_BODY),
        "--json",
        str(tmp_path / "server.json"),
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        match = READY.search((tmp_path / "server.err").read_text())
        if match:
            return proc, match.group(1), int(match.group(2))
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    proc.kill()
    raise AssertionError(
        f"server not ready (exit {proc.poll()}):\n{(tmp_path / 'server.err').read_text()[-4000:]}"
    )
