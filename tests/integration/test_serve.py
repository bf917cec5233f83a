"""End to end: the HTTP server at P = 2 on the real executor under the load generator.

200 measured requests over shared prefixes (the seeded workload, its warm-up first),
30% of them abandoned at random points by closing the connection. Every request that
was not abandoned completes with the first token an offline ``wavepp.main`` run of the
same prompts gives; ``/metrics`` and ``/health`` answer during the load; SIGTERM to the
server's launcher drains it, the leak check holds on every stage, and the exit code is 0.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.run import ROOT, torchrun
from tests.helpers.serve import MAX_BODY, MODEL, start_server
from wavepp.serve.prom import parse_exposition, sample

pytestmark = pytest.mark.slow

def check_bad_input(client: httpx.Client) -> None:
    """Each kind of bad input gets its 4xx with a message, on the real runtime; the server
    keeps serving, and the leak check at the end (after SIGTERM) shows nothing was held."""
    fits_nowhere = [7] * (512 * 16 + 1)  # one token more than the 512-block pools hold
    bad = [
        ("POST", "/v1/prefill", b"{not json", 400, "JSON"),
        ("POST", "/v1/prefill", b'{"tokens": [' + b"1, " * (MAX_BODY // 3) + b"1]}", 413,
         "--max-body-bytes"),
        ("POST", "/v1/prefill", json.dumps({"tokens": []}).encode(), 400, "empty"),
        ("POST", "/v1/prefill", json.dumps({"tokens": [1, 10**9]}).encode(), 400, "vocabulary"),
        ("POST", "/v1/prefill", json.dumps({"tokens": fits_nowhere}).encode(), 400,
         "the smallest stage pool holds 512"),
        ("DELETE", "/v1/requests/no-such-request", b"", 404, "no-such-request"),
    ]  # fmt: skip
    for method, route, body, status, words in bad:
        answer = client.request(method, route, content=body,
                                headers={"content-type": "application/json"})  # fmt: skip
        assert answer.status_code == status, (route, body[:60], answer.text)
        assert words in answer.json()["error"]["message"], answer.text
    good = client.post("/v1/prefill", json={"tokens": [3, 1, 4, 1, 5, 9, 2, 6]})
    assert good.status_code == 200 and good.json()["first_token"] is not None, good.text


def test_server_under_load_matches_offline_and_drains(tmp_path):
    server, url, pid = start_server(tmp_path)
    assert pid != server.pid  # the serving rank, under torchrun under the launcher
    try:
        load_cmd = [
            sys.executable,
            "-m",
            "wavepp.bench.load",
            "--url",
            url,
            "--workload",
            "seeded",
            "--requests",
            "200",
            "--prompt-tokens",
            "128",
            "--concurrency",
            "8",
            "--cancel-fraction",
            "0.3",
            "--seed",
            "5",
            "--json",
            str(tmp_path / "load.json"),
            "--dump-requests",
            str(tmp_path / "prompts.jsonl"),
            "--no-progress",
        ]
        load = subprocess.Popen(
            load_cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        # /health and /metrics answer while the load runs.
        scrapes = 0
        with httpx.Client(base_url=url, timeout=30) as client:
            deadline = time.monotonic() + 300
            while load.poll() is None and time.monotonic() < deadline:
                health = client.get("/health")
                assert health.status_code == 200, health.text
                assert health.json() == {"status": "ok"}
                metrics = client.get("/metrics")
                assert metrics.status_code == 200
                kinds = {f.name: f.type for f in text_string_to_metric_families(metrics.text)}
                assert kinds["wavepp_results"] == "counter"  # wavepp_results_total
                assert sample(parse_exposition(metrics.text), "wavepp_up") == 1
                scrapes += 1
                time.sleep(1.0)
            stdout, stderr = load.communicate(timeout=300)
            assert load.returncode == 0, stderr[-4000:]
            assert scrapes >= 1
            # The abandoned requests settle: nothing stays queued or running.
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                samples = parse_exposition(client.get("/metrics").text)
                busy = [
                    sample(samples, "wavepp_engine_requests", state=s)
                    for s in ("queued", "admitted", "running")
                ]
                if busy == [0, 0, 0]:
                    break
                time.sleep(0.5)
            assert busy == [0, 0, 0], busy
            # ... and the autoscaling figures say nothing waits
            for state in ("queued", "admitted"):
                assert sample(samples, "wavepp_engine_tokens_waiting", state=state) == 0
            assert sample(samples, "wavepp_engine_queue_oldest_seconds") == 0
            assert sample(samples, "wavepp_drain_seconds") == 0
            check_bad_input(client)
        record = json.loads((tmp_path / "load.json").read_text())
        assert record["simulated"] is False  # a torch server's answers say real waves
        requests = [r for r in record["requests"] if not r["warmup"]]
        assert len(requests) == 200
        picked = [r for r in requests if r["to_cancel"]]
        kept = [r for r in requests if not r["to_cancel"]]
        assert len(picked) == 60
        assert {r["status"] for r in kept} == {"done"}, [r for r in kept if r["status"] != "done"]
        assert {r["status"] for r in picked} <= {"done", "disconnected", "cancelled"}
        assert sum(r["status"] == "disconnected" for r in picked) >= 10  # really abandoned
        assert record["reused_share"] > 0.3  # the shared prefixes were reused
        assert "throughput" in stdout
    finally:
        # SIGTERM to the launcher, as a supervisor would: it passes it to the serving rank
        # (pid on the ready line), which drains; then every rank ends.
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(timeout=180)
        except subprocess.TimeoutExpired:
            server.kill()
            raise
    err = (tmp_path / "server.err").read_text()
    assert code == 0, err[-4000:]
    assert "draining" in err and "[wavepp serve] stopped" in err
    final = json.loads((tmp_path / "server.json").read_text())
    assert [leak["balanced"] for leak in final["leak_check"]] == [True, True]
    assert all(
        leak["leases"] == leak["escrowed"] == leak["pending"] == 0 for leak in final["leak_check"]
    )

    # The same prompts offline: every request the server completed has the same first token.
    offline_json = tmp_path / "offline.json"
    torchrun(
        2,
        [
            "-m",
            "wavepp.main",
            "--requests-file",
            str(tmp_path / "prompts.jsonl"),
            *MODEL,
            "--concurrency",
            "8",
            "--no-progress",
            "--json",
            str(offline_json),
        ],
    )
    offline = {r["id"]: r for r in json.loads(offline_json.read_text())["requests"]}
    done = [r for r in record["requests"] if r["status"] == "done"]
    assert sum(not r["warmup"] for r in done) >= 140
    assert all(r["id"] in offline for r in done if not r["warmup"])
    compared = [r for r in done if r["id"] in offline]  # warm-up lines are not in the record
    mismatched = [
        (r["id"], r["first_token"], offline[r["id"]]["first_token"])
        for r in compared
        if r["first_token"] != offline[r["id"]]["first_token"]
    ]
    assert not mismatched, mismatched[:10]
