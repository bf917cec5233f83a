"""Issue 17: first-day edge cases end fast with a clear line and the right exit code."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.run import ROOT, TORCHRUN

pytestmark = pytest.mark.slow


def wavepp_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("[wavepp rank")]


def run(cmd, timeout=180):
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_every_request_rejected_ends_at_once_and_says_why(tmp_path):
    out = tmp_path / "r.json"
    proc = run([*TORCHRUN, "--nproc-per-node=2", "-m", "wavepp.main", "--no-progress",
                "--capacity-blocks", "3", "--requests", "4", "--json", str(out)])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = wavepp_lines(proc.stderr)
    assert any("the smallest stage pool holds 3" in line for line in lines), lines
    assert any("warm-up requests was rejected; measuring without warm-up" in line
               for line in lines), lines  # fmt: skip
    record = json.loads(out.read_text())
    assert record["measured_requests"] == 4 and record["rejected_requests"] == 4
    assert record["failed_requests"] == 0  # rejected at submission, counted apart
    assert record["warmup_not_done"] == 1  # the one warm-up request, rejected
    assert all(r["status"] == "rejected" for r in record["requests"])
    assert all(leak["balanced"] for leak in record["leak_check"])


TOO_LONG = "".join(json.dumps({"id": rid, "tokens": list(range(100))}) + "\n" for rid in "ab")


@pytest.mark.parametrize("content,extra,names", [
    ("", [], []),
    ('{"id": "a", "tokens": []}\nnot json\n', [], ["line 1:", "line 2:"]),
    # Every line parses, but none fits the pool given on the command line.
    (TOO_LONG, ["--capacity-blocks", "2", "--block-size", "16"],
     ["request a: prompt of 100 tokens needs 7 blocks; the smallest stage pool holds 2",
      "request b:"]),
])  # fmt: skip
def test_a_requests_file_with_nothing_runnable_exits_2_naming_the_file(tmp_path, content,
                                                                        extra, names):  # fmt: skip
    path = tmp_path / "requests.jsonl"
    path.write_text(content)
    proc = run([*TORCHRUN, "--nproc-per-node=2", "-m", "wavepp.main", "--no-progress",
                "--requests-file", str(path), *extra])  # fmt: skip
    lines = wavepp_lines(proc.stderr)
    said = [line for line in lines if "no runnable request" in line]
    assert len(said) == 1 and str(path) in said[0], lines
    assert ("the file is empty" in said[0]) == (content == "")
    assert all(name in said[0] for name in names), said[0]
    assert "ValueError" not in proc.stderr and "positive pool capacity" not in proc.stderr
    # The ranks exit 2; torchrun reports that in its own failure summary. A rank still
    # exiting when torchrun saw the first one's 2 is stopped by torchrun's SIGTERM, and
    # exits 2 too (not 1, as a failure: the signal came after the run had ended).
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr)
    assert "2" in codes and set(codes) == {"2"} and proc.returncode != 0, codes


def _start(cmd, log):
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip


def _wait_for(path, needle, proc, limit=180):
    deadline = time.monotonic() + limit  # a hang guard, not a speed bound
    while needle not in path.read_text() and proc.poll() is None:
        if time.monotonic() > deadline:
            raise AssertionError(path.read_text()[-3000:])
        time.sleep(0.3)
    assert needle in path.read_text(), path.read_text()[-3000:]


# No warm-up phase: measurement (and its "measuring" line) starts at once.
LONG = ["--executor", "sim", "--workload", "cold", "--requests", "4000",
        "--concurrency", "64", "--no-progress"]  # fmt: skip


def test_sigint_to_torchrun_writes_the_partial_record(tmp_path):
    out, log_path = tmp_path / "r.json", tmp_path / "log"
    with log_path.open("w") as log:
        proc = _start([*TORCHRUN, "--nproc-per-node=2", "-m", "wavepp.main", *LONG,
                       "--json", str(out)], log)  # fmt: skip
        try:
            _wait_for(log_path, "measuring", proc)
            time.sleep(1.0)
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    lines = wavepp_lines(log_path.read_text())
    said = "\n".join(lines)  # whole, where a list in the message would be cut short
    assert sum("interrupted by SIGINT" in line for line in lines) == 2, said
    assert sum("interrupted after" in line and "of 4000 requests" in line
               for line in lines) == 1, said  # fmt: skip
    assert not any("failed:" in line for line in lines), said
    record = json.loads(out.read_text())
    assert record["interrupted"] == "SIGINT"
    assert record["unfinished_requests"] > 0
    assert len(record["leak_check"]) == 1  # rank 0's own stage: no collectives after a signal


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_one_stage_run_exits_128_plus_the_signal(tmp_path, sig, code):
    log_path = tmp_path / "log"
    with log_path.open("w") as log:
        proc = _start([sys.executable, "-m", "wavepp.main", *LONG], log)
        try:
            _wait_for(log_path, "measuring", proc)
            time.sleep(0.5)
            proc.send_signal(sig)
            rc = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log_path.read_text()
    assert rc == code, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert f"interrupted by {sig.name}" in text
