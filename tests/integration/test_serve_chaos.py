"""Chaos, small and bounded: the server at P = 2 (tiny model) under light load.

1. A stalled-body client, a slow-header client and SIGTERM to the launcher: in-flight
   requests answer, a late one gets 503, the launcher exits 0 (the leak check held) well
   within the drain timeout plus start-up slack.
2. Rank 1 SIGKILLed under load: every client gets a JSON error naming rank 1, the
   launcher exits non-zero, and its last line names rank 1.
Every request goes to 127.0.0.1; the timeouts below are hang guards only.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers.faults import load
from tests.helpers.run import ROOT

pytestmark = pytest.mark.slow
READY = re.compile(r"listening on (http://\S+) \(pid (\d+)\)")


def _start(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, str, int, Path]:
    err_path = tmp_path / "server.err"
    err = open(err_path, "w")  # noqa: SIM115 (the child holds it)
    cmd = [sys.executable, "-m", "wavepp.serve.launch", "--nproc-per-node", "2",
           "--host", "127.0.0.1", "--port", "0", "--model", "tiny-hybrid",
           "--capacity-blocks", "512", "--no-progress", "--dead-after-s", "5",
           "--json", str(tmp_path / "server.json"), *extra]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        match = READY.search(err_path.read_text())
        if match:
            return proc, match.group(1), int(match.group(2)), err_path
        time.sleep(0.3)
    proc.kill()
    raise AssertionError(f"server not ready:\n{err_path.read_text()[-3000:]}")


def test_sigterm_drains_past_slow_clients_and_exits_0(tmp_path):
    proc, url, _, err_path = _start(tmp_path, "--drain-timeout-s", "5",
                                    "--header-timeout-s", "2", "--body-timeout-s", "60")
    port = int(url.rsplit(":", 1)[1])
    try:
        stalled = socket.create_connection(("127.0.0.1", port))
        stalled.sendall(b"POST /v1/prefill HTTP/1.1\r\nHost: x\r\nContent-Length: 20\r\n\r\n{")
        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(b"POST /v1/prefill HTTP/1.1\r\nHost: x\r\n")
        answers: list = []
        stop = threading.Event()
        workers = [threading.Thread(target=load, args=(url, answers, stop, i)) for i in range(3)]
        for thread in workers:
            thread.start()
        while sum(1 for a in answers if a[0] == 200) < 6:
            assert proc.poll() is None, err_path.read_text()[-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)  # hang guard
        stop.set()
        for thread in workers:
            thread.join(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = err_path.read_text()
    assert code == 0, text[-3000:]
    assert "Traceback" not in text and "Exception in ASGI" not in text
    assert all(a[0] in (200, 503) or a[0] is None for a in answers), answers[-3:]
    late = [a for a in answers if a[0] == 503]
    assert all("draining" in json.loads(a[2])["error"]["message"] for a in late)
    record = json.loads((tmp_path / "server.json").read_text())
    assert all(stage["balanced"] for stage in record["leak_check"])


def test_rank_1_killed_under_load_answers_json_and_names_it(tmp_path):
    proc, url, rank0, err_path = _start(tmp_path)
    try:
        torchrun = int(Path(f"/proc/{rank0}/stat").read_text().rsplit(")", 1)[1].split()[1])
        ranks = [int(x) for x in
                 Path(f"/proc/{torchrun}/task/{torchrun}/children").read_text().split()]
        rank1 = next(pid for pid in ranks if pid != rank0)
        answers: list = []
        stop = threading.Event()
        workers = [threading.Thread(target=load, args=(url, answers, stop, i)) for i in range(3)]
        for thread in workers:
            thread.start()
        while sum(1 for a in answers if a[0] == 200) < 6:
            assert proc.poll() is None, err_path.read_text()[-3000:]
            time.sleep(0.2)
        os.kill(rank1, signal.SIGKILL)
        code = proc.wait(timeout=120)  # hang guard
        stop.set()
        for thread in workers:
            thread.join(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = err_path.read_text()
    assert code != 0
    assert "Exception in ASGI" not in text
    errors = [a for a in answers if a[0] not in (200, None)]
    assert errors, answers[-3:]
    for status, kind, body in errors:  # every client got the API's JSON error shape
        assert status == 503 and kind.startswith("application/json")
        assert "rank 1" in json.loads(body)["error"]["message"]
    assert "rank 1" in text.strip().splitlines()[-1]  # the launcher's last line
