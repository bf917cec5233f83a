"""A bad ``--model`` directory, as a user would run it: ``python -m wavepp.main`` (and the
server's launcher, which checks before torchrun starts) exits non-zero with one line
naming the file and the field or tensor, no traceback, and without allocating what the
config would need (the child's peak memory stays that of Python and torch). A server
whose model's logits turn NaN for one prompt fails that request alone, with a reason."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

from tests.helpers.broken_models import BROKEN, broken_model, nan_trap_model
from tests.helpers.run import ROOT
from tests.helpers.serve import start_server

pytestmark = pytest.mark.slow
PEAK_RSS_BYTES = 2 << 30  # torch imported and a tiny model loaded take well under this


def _run(cmd: list[str]) -> tuple[int, str, int]:
    """(exit status, stderr, peak resident bytes) of ``cmd`` run from the repository."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        err = proc.stderr.read()
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        if proc.returncode is None and proc.poll() is None:
            proc.kill()
    return os.waitstatus_to_exitcode(status), err, usage.ru_maxrss * 1024


def _the_line(err: str, words: tuple[str, ...]) -> str:
    lines = [line for line in err.splitlines() if "--model" in line]
    assert len(lines) == 1, err[-3000:]
    assert all(w in lines[0] for w in words), lines[0]
    return lines[0]


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_bad_model_directory_is_one_line_naming_the_file_and_field(tmp_path, case):
    path = broken_model(tmp_path / "model", case)
    code, err, peak = _run([sys.executable, "-m", "wavepp.main", "--model", str(path),
                            "--requests", "2", "--prompt-tokens", "32", "--no-progress"])
    print(_the_line(err, BROKEN[case][1]), f"(peak {peak / 2**20:,.0f} MiB)")
    assert code != 0
    assert "Traceback" not in err, err[-3000:]
    assert peak < PEAK_RSS_BYTES


@pytest.mark.parametrize("case", ["hidden-size-1e9", "tensor-wrong-shape", "rope-theta-inf"])
def test_the_server_launcher_refuses_a_bad_directory_before_torchrun_starts(tmp_path, case):
    path = broken_model(tmp_path / "model", case)
    code, err, _ = _run([sys.executable, "-m", "wavepp.serve.launch", "--nproc-per-node", "2",
                         "--port", "0", "--model", str(path)])  # fmt: skip
    _the_line(err, BROKEN[case][1])
    assert code != 0
    assert "Traceback" not in err and "[wavepp rank" not in err, err[-3000:]


def test_a_request_whose_logits_are_nan_fails_alone_on_the_server(tmp_path):
    trap = 7
    path = nan_trap_model(tmp_path / "model", trap)
    server, url, _ = start_server(tmp_path, ["--model", str(path), "--block-size", "16",
                                             "--capacity-blocks", "256"])  # fmt: skip
    try:
        with httpx.Client(base_url=url, timeout=120) as client:
            def prefill(tokens: list[int]) -> httpx.Response:
                return client.post("/v1/prefill", json={"tokens": tokens})

            before = prefill(list(range(10, 60)))
            bad = prefill([trap, *range(10, 60)])
            completion = client.post("/v1/completions", json={
                "prompt": [*range(20, 40), trap], "max_tokens": 1})  # fmt: skip
            after = prefill(list(range(100, 180)))
            assert before.status_code == after.status_code == 200, (before.text, after.text)
            assert bad.status_code == completion.status_code == 500, (bad.text, completion.text)
            why = "logits at the prompt's last position are not finite"
            assert bad.json()["status"] == "failed" and why in bad.json()["error"]
            assert completion.json()["error"]["type"] == "server_error"
            assert why in completion.json()["error"]["message"]
            assert client.get("/health").status_code == 200
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=120)  # hang guard
    assert code == 0, (tmp_path / "server.err").read_text()[-3000:]
    record = json.loads((tmp_path / "server.json").read_text())
    assert record["failed_requests"] == 2
    assert all(stage["balanced"] for stage in record["leak_check"])
