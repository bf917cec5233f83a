"""The fleet launcher's ``--threads`` default: the cores it may run on (its affinity
mask, as the runtime counts them) over every replica's ranks; the replicas'
``--handoff-secret`` reaches the router."""

import argparse
import os
import subprocess
import sys

import pytest

import wavepp.fleet.__main__ as fleet

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def threads(cmd: list[str]) -> int:
    return int(cmd[cmd.index("--threads") + 1])


def test_threads_default_to_the_allowed_cores_over_the_ranks():
    cores = len(os.sched_getaffinity(0))
    one = fleet.replica_command(argparse.Namespace(replicas=1, nproc_per_node=1), [], 0)
    assert threads(one) == cores
    crowded = fleet.replica_command(argparse.Namespace(replicas=cores, nproc_per_node=2), [], 0)
    assert threads(crowded) == 1  # never 0
    given = fleet.replica_command(argparse.Namespace(replicas=1, nproc_per_node=1),
                                  ["--threads", "3"], 0)  # fmt: skip
    assert given.count("--threads") == 1 and threads(given) == 3  # the user's, alone


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to restrict")
def test_a_launcher_confined_to_one_core_gives_each_rank_one_thread():
    script = ("import argparse, os, sys; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))});"
              "import wavepp.fleet.__main__ as f;"
              "cmd = f.replica_command(argparse.Namespace(replicas=1, nproc_per_node=1), [], 0);"
              "print(cmd[cmd.index('--threads') + 1])")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True)  # fmt: skip
    assert out.stdout.strip() == "1"


def test_the_replicas_handoff_secret_reaches_the_router():
    args = argparse.Namespace(host="127.0.0.1", port=0, route_policy="prefix", route_option=[])
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    plain = fleet.router_command(args, ["--model", "tiny-llama"], urls)
    assert "--handoff-secret" not in plain and plain.count("--replica") == 2
    for rest in (["--handoff-secret", "/run/s"], ["--handoff-secret=/run/s"]):
        cmd = fleet.router_command(args, rest, urls)
        assert cmd[cmd.index("--handoff-secret") + 1] == "/run/s"
    args.route_option = ["--handoff-secret=/run/other"]  # the user's own, alone
    cmd = fleet.router_command(args, ["--handoff-secret", "/run/s"], urls)
    assert "--handoff-secret" not in cmd and "--handoff-secret=/run/other" in cmd
