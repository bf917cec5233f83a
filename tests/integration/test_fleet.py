"""A real fleet: ``python -m wavepp.fleet`` with 2 replicas × P = 2 (torch executor, tiny-llama)
behind the router.

One fleet serves the module. First, prefix routing: a prompt sharing a prefix cached on one
replica goes there, the router's predicted reuse equals the ``cached_tokens`` that replica
answers, and every first token equals a single pipeline's (``wavepp.main`` on the same
prompts). Then a replica's ranks are killed under light load: every request completes
(on the other replica once it is out), none twice, and the router's ``/health`` names the
replica that is out; SIGTERM drains what is left — the router and the live replica end 0
after their drains, and the launcher's exit 1 names the killed replica alone. A fleet
that still has every replica ends 0 on SIGTERM: the launcher over the real router and two
stand-in replicas (ready lines and a clean exit, no ranks: a second real fleet would
take about 25 s more of the suite's time).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.helpers.run import ROOT, torchrun
from wavepp.serve.prom import parse_exposition, sample

pytestmark = pytest.mark.slow

BLOCK = 16
MODEL = ["--model", "tiny-llama", "--seed", "0", "--block-size", str(BLOCK),
         "--capacity-blocks", "256", "--concurrency", "4", "--no-progress"]  # fmt: skip
READY = re.compile(r"\[wavepp fleet\] ready: router (http://\S+) .*?: (r0=\S+) (r1=\S+)")
RANK0 = re.compile(r"\[replica (r\d)\] \[wavepp serve\] listening on \S+ \(pid (\d+)\)")
VOCAB = 512


def _prompt(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(1, VOCAB, n).tolist()


class FleetRun:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.err = tmp / "fleet.err"
        cmd = [sys.executable, "-m", "wavepp.fleet", "--replicas", "2", "--nproc-per-node", "2",
               "--port", "0", "--route-policy", "prefix", *MODEL, "--json",
               str(tmp / "rec.json")]  # fmt: skip
        with open(self.err, "w") as err, open(tmp / "fleet.out", "w") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            match = READY.search(self.err.read_text())
            if match:
                self.url = match.group(1)
                self.replicas = dict(part.split("=", 1) for part in match.groups()[1:])
                self.rank0 = {m[0]: int(m[1]) for m in RANK0.findall(self.err.read_text())}
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        self.proc.kill()
        raise AssertionError(f"fleet not ready (exit {self.proc.poll()}):\n"
                             f"{self.err.read_text()[-5000:]}")  # fmt: skip

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    run = FleetRun(tmp_path_factory.mktemp("fleet"))
    yield run
    if run.proc.poll() is None:
        run.stop()


def _health(client: httpx.Client) -> dict:
    return {r["name"]: r for r in client.get("/health").json()["replicas"]}


def _wait_for_blocks(client: httpx.Client, replica: str, blocks: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        events = _health(client)[replica]["events"]
        if events and (events.get("blocks") or 0) >= blocks:
            return
        time.sleep(0.1)
    raise AssertionError(f"{replica}'s events never announced {blocks} blocks: "
                         f"{_health(client)[replica]}")  # fmt: skip


def test_prefix_routing_predicts_the_reuse_replicas_grant(fleet, tmp_path):
    pytest.importorskip("wavepp.kv_events.index", reason="the KV-event index")
    rng = np.random.default_rng(7)
    doc_a, doc_b = _prompt(rng, 40), _prompt(rng, 40)  # 2 full blocks each, 8 tokens over
    prompts = {"a": doc_a, "b": doc_b, "a2": doc_a + _prompt(rng, 13),
               "b2": doc_b + _prompt(rng, 9), "c": _prompt(rng, 30)}  # fmt: skip
    answers: dict[str, tuple[dict, httpx.Headers]] = {}
    with httpx.Client(base_url=fleet.url, timeout=120) as client:
        health = client.get("/health").json()
        assert all(r["events"] for r in health["replicas"]), health
        # seed each replica with one document: a through the router (an idle fleet, ties
        # to r0), b straight to r1
        reply = client.post("/v1/prefill", json={"tokens": prompts["a"], "id": "a"})
        answers["a"] = reply.json(), reply.headers
        reply = httpx.post(fleet.replicas["r1"] + "/v1/prefill", timeout=120,
                           json={"tokens": prompts["b"], "id": "b"})  # fmt: skip
        answers["b"] = reply.json(), httpx.Headers({"x-wavepp-replica": "r1"})
        _wait_for_blocks(client, "r0", 2)
        _wait_for_blocks(client, "r1", 2)
        for rid in ("b2", "a2", "c"):
            # c with a deadline: the replica is given what is left of it, and says if met
            deadline = {"deadline_s": 600} if rid == "c" else {}
            reply = client.post("/v1/prefill", json={"tokens": prompts[rid], "id": rid,
                                                     **deadline})  # fmt: skip
            assert reply.status_code == 200, reply.text
            answers[rid] = reply.json(), reply.headers
        metrics = parse_exposition(client.get("/metrics").text)
    assert answers["a"][1]["x-wavepp-replica"] == "r0"
    assert answers["b2"][1]["x-wavepp-replica"] == "r1"  # b's blocks are on r1 only
    assert answers["a2"][1]["x-wavepp-replica"] == "r0"
    for rid in ("b2", "a2"):
        body, headers = answers[rid]
        assert body["cached_tokens"] == 2 * BLOCK
        assert int(headers["x-wavepp-predicted-cached-tokens"]) == body["cached_tokens"]
    assert answers["c"][0]["cached_tokens"] == 0
    assert answers["c"][0]["deadline_met"] is True and answers["c"][0]["deadline_s"] < 600
    replica_c = {"replica": answers["c"][1]["x-wavepp-replica"], "policy": "prefix"}
    assert sample(metrics, "wavepp_route_with_deadline_total", **replica_c) == 1
    assert sample(metrics, "wavepp_route_deadlines_met_total", **replica_c) == 1
    assert sample(metrics, "wavepp_route_slo_attainment") == 1
    assert answers["c"][1]["x-wavepp-predicted-cached-tokens"] == "0"
    exact = sum(v for k, v in metrics.items() if k.startswith("wavepp_route_predicted_exact_total"))
    predicted = sum(v for k, v in metrics.items()
                    if k.startswith("wavepp_route_predicted_answers_total"))  # fmt: skip
    assert exact == predicted == 4  # a, a2, b2, c went through the router

    # a single pipeline's first tokens for the same prompts
    requests = tmp_path / "prompts.jsonl"
    requests.write_text("".join(json.dumps({"id": k, "tokens": v}) + "\n"
                                for k, v in prompts.items()))  # fmt: skip
    out = tmp_path / "single.json"
    torchrun(2, ["-m", "wavepp.main", *MODEL, "--requests-file", str(requests),
                 "--json", str(out)])  # fmt: skip
    single = {r["id"]: r["first_token"] for r in json.loads(out.read_text())["requests"]}
    assert {rid: body["first_token"] for rid, (body, _) in answers.items()} == single


def _ranks_of(rank0: int) -> list[int]:
    """Every rank of the pipeline whose rank 0 is ``rank0``: the children of its torchrun."""
    stat = Path(f"/proc/{rank0}/stat").read_text()
    agent = int(stat.rsplit(")", 1)[1].split()[1])
    children = Path(f"/proc/{agent}/task/{agent}/children").read_text().split()
    return [int(pid) for pid in children]


def test_a_killed_replica_is_taken_out_and_every_request_completes_once(fleet):
    rng = np.random.default_rng(11)
    prompts = {f"k{i}": _prompt(rng, 120) for i in range(24)}
    answers: dict[str, httpx.Response] = {}
    killed_at = None

    def send(rid: str) -> None:
        with httpx.Client(base_url=fleet.url, timeout=120) as client:
            answers[rid] = client.post("/v1/prefill", json={"tokens": prompts[rid], "id": rid})

    with ThreadPoolExecutor(3) as pool:
        futures = []
        for i, rid in enumerate(prompts):
            futures.append(pool.submit(send, rid))
            if i == 8:  # light load under way: kill every rank of r1
                while sum(1 for f in futures if f.done()) < 4:
                    time.sleep(0.01)
                ranks = _ranks_of(fleet.rank0["r1"])
                assert len(ranks) == 2, ranks
                for pid in ranks:
                    os.kill(pid, signal.SIGKILL)
                killed_at = len(answers)
        for future in futures:
            future.result()
    assert killed_at is not None
    assert {rid: reply.status_code for rid, reply in answers.items()} == dict.fromkeys(prompts, 200)
    assert all(reply.json()["status"] == "done" for reply in answers.values())
    by = {rid: reply.headers["x-wavepp-replica"] for rid, reply in answers.items()}
    with httpx.Client(base_url=fleet.url, timeout=30) as client:
        health = client.get("/health")
        metrics = parse_exposition(client.get("/metrics").text)
    assert health.status_code == 200
    replicas = {r["name"]: r for r in health.json()["replicas"]}
    assert replicas["r1"]["state"] == "out" and replicas["r1"]["reason"]
    assert replicas["r0"]["state"] == "up"
    retries = sum(v for k, v in metrics.items() if k.startswith("wavepp_route_retries_total"))
    assert retries >= 1  # requests routed to r1 after the kill went on to r0
    code = fleet.stop()
    assert code == 1  # r1's launcher exited non-zero, and the fleet says so ...
    err = fleet.err.read_text()
    # ... naming r1 alone: SIGTERM drained the rest. r1's launcher may still be ending
    # (its interpreter shutting down, handlers gone) when the drain's SIGTERM comes: -15
    assert re.fullmatch(r"wavepp fleet: drained; not every child exited 0: replica r1 exit -?\d+",
                        err.splitlines()[-1])
    for child, name in (("router", "route"), ("replica r0", "serve")):
        assert f"[{child}] [wavepp {name}] draining: " in err, child
        assert f"[{child}] [wavepp {name}] stopped" in err, child
    survivor = json.loads((fleet.tmp / "rec-r0.json").read_text())
    done_r0 = [r["id"] for r in survivor["requests"] if r["status"] == "done"]
    assert len(done_r0) == len(set(done_r0))  # no id ran twice on r0
    on_r1 = {rid for rid, name in by.items() if name == "r1"}
    assert not on_r1 & set(done_r0)  # none answered by r1 also ran on r0
    assert {rid for rid, name in by.items() if name == "r0"} <= set(done_r0)


# A replica as the launcher sees one: its ready line (a port of its own, bound, refusing
# connections: the router never finds it up), then on SIGTERM its last line and exit 0.
STAND_IN_REPLICA = """
import os, signal, socket, sys
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
sock = socket.socket()
sock.bind(("127.0.0.1", 0))  # not listening
port = sock.getsockname()[1]
print(f"[wavepp serve] listening on http://127.0.0.1:{port} (pid {os.getpid()})",
      file=sys.stderr, flush=True)
signal.sigwait([signal.SIGTERM])
print("[wavepp serve] stopped", file=sys.stderr, flush=True)
"""
LAUNCHER = """
import sys
import wavepp.fleet.__main__ as fleet
fleet.replica_command = lambda args, rest, index: [sys.executable, "-c", sys.argv[1]]
fleet.main(["--replicas", "2", "--nproc-per-node", "1", "--port", "0"])
"""


def test_sigterm_drains_the_router_and_every_replica_and_the_launcher_exits_0(tmp_path):
    """The launcher's own SIGTERM path to exit 0, with the real router over two stand-in
    replicas (the real fleet above ends with a killed replica, so its exit is 1)."""
    err = tmp_path / "fleet.err"
    with open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, STAND_IN_REPLICA], cwd=ROOT,
                                stderr=stderr)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while "[wavepp fleet] ready: " not in err.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = err.read_text()
    assert code == 0, text
    assert text.splitlines()[-1] == "[wavepp fleet] drained: every child exited 0"
    for child in ("router", "replica r0", "replica r1"):
        assert re.search(rf"^\[{child}\] \[wavepp \w+\] stopped$", text, re.M), (child, text)
