"""A short soak (``python -m benchmarks.soak``): 35 s of a reuse workload with cancels and
disconnects against the server at P = 2 on ``tiny-hybrid``. Fails when a table grows with
the number of requests served instead of staying within the concurrency, or a rank's
memory keeps growing, or the server's leak check fails at the end.

It needs the server's ``wavepp_table_size{table=...}`` gauge on ``/metrics`` (each table
rank 0 and the stages keep, by name): without it the test fails saying so.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.run import ROOT

pytestmark = pytest.mark.slow

CONCURRENCY = 4
DURATION_S = 35
MIB = 1024 * 1024


def test_tables_stay_within_the_concurrency_and_memory_levels_off(tmp_path):
    out = tmp_path / "soak.json"
    cmd = [sys.executable, "-m", "benchmarks.soak", "--duration-s", str(DURATION_S),
           "--every-s", "2.5", "--concurrency", str(CONCURRENCY), "--json", str(out),
           "--log", str(tmp_path / "server.log")]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    log = (tmp_path / "server.log").read_text() if (tmp_path / "server.log").exists() else ""
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + log[-3000:]
    record = json.loads(out.read_text())
    samples = record["samples"]
    assert record["server_exit"] == 0  # drained, and every stage's leak check held
    assert record["simulated"] is False  # the torch executor: real waves
    assert len(samples) >= 12, done.stdout

    # The first third warms up (pools fill, allocators and caches settle).
    warm = samples[len(samples) // 3]
    middle = samples[len(samples) // 2]
    last_third = samples[-(len(samples) // 3) :]
    final = samples[-1]
    served = final["requests"]["sent"] - warm["requests"]["sent"]
    gone = sum(final["requests"][k] - warm["requests"][k] for k in ("cancelled", "disconnected"))
    # Enough traffic that a table keeping one entry per request (or per cancel) would
    # outgrow the bound below many times over.
    assert served >= 40 * CONCURRENCY and gone >= 2 * CONCURRENCY, final["requests"]

    # RSS: a leak of even a few KiB a request shows over the hundreds served in the second
    # half, but a rank's resident size also moves by some MiB without any leak (glibc's
    # arenas keep freed memory, torch's allocator caches buffers of new shapes, pages of
    # the weights get touched late). 32 MiB a rank between the middle and the end is
    # several times what a settled rank moves here (under 2 MiB in 60 s) and far below
    # what a per-request leak of the KV or a prompt's tokens would add.
    for rank, before in middle["rss_bytes"].items():
        after = final["rss_bytes"][rank]
        assert after - before <= 32 * MIB, (
            f"rank {rank}: RSS {before / MIB:.1f} MiB at the middle, {after / MIB:.1f} at the end"
        )

    # Tables: per-request state for the requests in the system (at most the client's
    # concurrency, queued or running), and windows of recent history, each capped (the
    # server says its cap: wavepp_table_limit). So after the warm-up no other table grows
    # by more than a few times the concurrency (one that keeps anything per request
    # served grows by hundreds), and a window never holds more than its cap.
    assert all(s["tables"] is not None for s in samples), (
        "the server exports no wavepp_table_size gauge on /metrics: the soak cannot see its tables"
    )
    bound = 4 * CONCURRENCY
    limits = final["table_limits"]
    assert {"ended_ids", "admitter_round_seconds", "stage_probe_us"} <= set(limits), limits
    for name, cap in limits.items():
        top = max(s["tables"].get(name, 0.0) for s in samples)
        assert top <= cap, f"table {name} held {top:g} entries, over its cap of {cap:g}"
    for name, start in warm["tables"].items():
        if name in limits:
            continue
        top = max(s["tables"].get(name, 0.0) for s in last_third)
        assert top - start <= bound, (
            f"table {name} grew from {start:g} after the warm-up to {top:g} in the last "
            f"third ({served} requests later; the bound is {bound} over its size then)"
        )
