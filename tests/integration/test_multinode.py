"""Two torchrun agents on localhost as two nodes (c10d rendezvous, 2 ranks each) run a
4-stage pipeline to completion with the same first tokens as one 4-rank agent (whose
rounds go over Unix sockets, where the two nodes' go over Gloo)."""

import json
import socket
import subprocess
import sys

import pytest

from tests.helpers.run import ROOT, torchrun

pytestmark = pytest.mark.slow

OPTIONS = ["--model", "tiny-hybrid", "--workload", "seeded", "--requests", "8",
           "--prompt-tokens", "512", "--concurrency", "4", "--no-progress"]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_tokens(record: dict) -> dict[str, int]:
    return {r["id"]: r["first_token"] for r in record["requests"]}


def test_two_nodes_of_two_ranks_equal_one_node_of_four(tmp_path):
    single = tmp_path / "single.json"
    torchrun(4, ["-m", "wavepp.main", *OPTIONS, "--json", str(single)], timeout=300)

    port = free_port()
    multi = tmp_path / "multi.json"
    agents = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--node-rank", str(node), "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"wavepp-{port}",
               "-m", "wavepp.main", *OPTIONS, "--json", str(multi)]  # fmt: skip
        log = open(tmp_path / f"node{node}.log", "w")  # noqa: SIM115 - closed below
        agents.append((subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=log), log))
    try:
        codes = [proc.wait(timeout=300) for proc, _ in agents]
    finally:
        for proc, log in agents:
            if proc.poll() is None:
                proc.kill()
            log.close()
    logs = "\n".join((tmp_path / f"node{n}.log").read_text()[-3000:] for n in (0, 1))
    assert codes == [0, 0], logs
    one, two = json.loads(single.read_text()), json.loads(multi.read_text())
    assert two["config"]["stages"] == 4
    # --rounds-plane / --data-plane auto: Unix sockets on one host, Gloo across the two
    # "nodes" (the same first tokens over either transport)
    assert one["config"]["rounds_plane"] == one["config"]["data_plane"] == "local"
    assert two["config"]["rounds_plane"] == two["config"]["data_plane"] == "gloo"
    assert len(first_tokens(one)) == 8
    assert first_tokens(two) == first_tokens(one)
    assert all(stage["balanced"] for stage in two["leak_check"]), two["leak_check"]
