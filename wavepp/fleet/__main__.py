"""``python -m wavepp.fleet --replicas N --nproc-per-node P --port 8000 [--route-policy NAME]
[server and run options]``: N pipelines and a router on one node.

Each replica is ``python -m wavepp.serve.launch --nproc-per-node P`` (its own ``torchrun
--standalone``) on a free port of 127.0.0.1, publishing its KV events on
``--kv-events tcp://127.0.0.1:0`` (free ports bound by the replica itself, which names them
to the router in its ``/v1/models``); every other option goes to every
replica as it is (``--json PATH`` becomes ``PATH`` with ``-r<i>`` before its suffix, one
record per replica; ``--threads`` defaults to the cores the launcher may run on over
the N × P ranks). Once every replica listens, ``python -m wavepp.route`` starts over
their URLs on ``--host`` and ``--port`` (with the replicas' ``--handoff-secret``, to
apply only the KV events it signed; ``$WAVEPP_HANDOFF_SECRET`` reaches every child).
Each child's stderr is relayed with its name in front.

SIGTERM or SIGINT drains the fleet: SIGTERM to the router (new requests 503, the ones in
flight answer) and to each replica's launcher (which drains its server); the exit status
is 0 when every child exited 0. A replica that fails to start stops everything with one
line naming it and its cause; a replica that fails later is taken out by the router, and
the fleet runs on (its exit status then says so).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from wavepp.host import usable_cores

READY = re.compile(r"listening on (http://\S+) \(pid (\d+)\)")
CAUSE = re.compile(r"(\[wavepp rank \d+\] (failed: |rank \d+: )|wavepp serve(\.launch)?: ).*")
DRAIN_WAIT_S = 60.0  # after the drain's SIGTERM, how long children get before SIGKILL


def log(message: str) -> None:
    print(f"[wavepp fleet] {message}", file=sys.stderr, flush=True)


class Child:
    """A child process whose stderr is relayed with a name, watched for its ready line."""

    def __init__(self, name: str, cmd: list[str]) -> None:
        self.name = name
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, errors="replace")
        self.url: str | None = None
        self.pid: int | None = None  # the serving process's pid (rank 0, or the router)
        self.cause: str | None = None  # its first line naming a failure
        self.last_line = ""
        self.ready = threading.Event()
        self._thread = threading.Thread(target=self._relay, name=f"fleet-{name}", daemon=True)
        self._thread.start()

    def _relay(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            sys.stderr.write(f"[{self.name}] {line}")
            stripped = line.strip()
            if stripped:
                self.last_line = stripped
            match = READY.search(line)
            if match and not self.ready.is_set():
                self.url, self.pid = match.group(1), int(match.group(2))
                self.ready.set()
            if self.cause is None and CAUSE.search(stripped):
                self.cause = stripped
        sys.stderr.flush()

    def why(self) -> str:
        return self.cause or self.last_line or "no message"

    def signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signum)

    def join(self) -> None:
        self._thread.join(timeout=5)


def _option(rest: list[str], name: str) -> str | None:
    for i, arg in enumerate(rest):
        if arg == name and i + 1 < len(rest):
            return rest[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _per_replica(rest: list[str], index: int) -> list[str]:
    """``rest`` with ``--json PATH`` made ``PATH`` with ``-r<index>`` before its suffix."""
    out, i = [], 0
    while i < len(rest):
        arg = rest[i]
        if arg == "--json" and i + 1 < len(rest):
            path = Path(rest[i + 1])
            out += [arg, str(path.with_name(f"{path.stem}-r{index}{path.suffix}"))]
            i += 2
            continue
        if arg.startswith("--json="):
            path = Path(arg.split("=", 1)[1])
            arg = "--json=" + str(path.with_name(f"{path.stem}-r{index}{path.suffix}"))
        out.append(arg)
        i += 1
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m wavepp.fleet",
        description="N WavePP pipelines and a router on one node. Every other option is a "
        "server or run option given to every replica (python -m wavepp.serve --help).",
    )
    p.add_argument("--replicas", type=int, required=True, help="pipelines N")
    p.add_argument("--nproc-per-node", type=int, required=True, help="stages P of each")
    p.add_argument("--host", default="127.0.0.1", help="the router's address [127.0.0.1]")
    p.add_argument("--port", type=int, default=8000, help="the router's port [8000]")
    p.add_argument("--route-policy", default="prefix",
                   help="the router's --policy (python -m wavepp.route --help) [prefix]")
    p.add_argument("--route-option", action="append", default=[], metavar="OPTION",
                   help="an option passed to the router as is, e.g. "
                   "--route-option=--fail-after=2 (repeatable)")
    p.add_argument("--start-timeout-s", type=float, default=600.0,
                   help="how long the replicas may take to listen, seconds [600]")
    return p  # fmt: skip


def check(args: argparse.Namespace, rest: list[str]) -> None:
    """Every check that needs no process: one line, exit 2."""
    def need(ok: bool, message: str) -> None:
        if not ok:
            print(f"wavepp fleet: {message}", file=sys.stderr)
            raise SystemExit(2)

    need(args.replicas >= 1, f"--replicas must be ≥ 1, got {args.replicas}")
    need(args.nproc_per_node >= 1, f"--nproc-per-node must be ≥ 1, got {args.nproc_per_node}")
    need(0 <= args.port <= 65535, f"--port must be in 0..65535, got {args.port}")
    need(_option(rest, "--kv-events") is None,
         "--kv-events is set per replica by the fleet; leave it out")  # fmt: skip
    from wavepp.policy.load import PolicyError
    from wavepp.route.policies import load_route_policy

    try:
        load_route_policy(args.route_policy)
    except PolicyError as error:
        need(False, f"--route-policy: {error}")
    from wavepp.serve.__main__ import check as check_server

    try:
        check_server(rest, args.nproc_per_node)
    except SystemExit as error:
        if error.code not in (None, 0, 2):
            print(error.code, file=sys.stderr)
        raise SystemExit(2) from None


def replica_command(args: argparse.Namespace, rest: list[str], index: int) -> list[str]:
    cmd = [sys.executable, "-m", "wavepp.serve.launch", "--nproc-per-node",
           str(args.nproc_per_node), "--host", "127.0.0.1", "--port", "0"]  # fmt: skip
    cmd += ["--kv-events", "tcp://127.0.0.1:0"]  # free ports, bound by the replica
    if _option(rest, "--threads") is None:
        ranks = args.replicas * args.nproc_per_node
        cmd += ["--threads", str(max(1, usable_cores() // ranks))]
    return cmd + _per_replica(rest, index)


def router_command(args: argparse.Namespace, rest: list[str], urls: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "wavepp.route", "--host", args.host, "--port",
           str(args.port), "--policy", args.route_policy, *args.route_option]  # fmt: skip
    for url in urls:
        cmd += ["--replica", url]
    secret = _option(rest, "--handoff-secret")  # the replicas sign their events with it
    if secret is not None and not any(o.startswith("--handoff-secret") for o in args.route_option):
        cmd += ["--handoff-secret", secret]
    return cmd


def _stop(children: list[Child], signum: int = signal.SIGTERM) -> None:
    for child in children:
        if child.proc.poll() is None:
            child.signal(signum)


def _wait_all(children: list[Child], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for child in children:
        try:
            child.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            log(f"{child.name} did not end within {timeout_s:g} s of SIGTERM: killed")
            child.proc.kill()
            child.proc.wait()
        child.join()


def _give_up(children: list[Child], message: str) -> None:
    _stop(children)
    _wait_all(children, DRAIN_WAIT_S)
    print(f"wavepp fleet: {message}", file=sys.stderr, flush=True)  # last, after the children
    sys.exit(1)


def _start_replicas(args, rest, children: list[Child], stopping: threading.Event) -> None:
    for i in range(args.replicas):
        children.append(Child(f"replica r{i}", replica_command(args, rest, i)))
    deadline = time.monotonic() + args.start_timeout_s
    while not all(c.ready.is_set() for c in children):
        for i, child in enumerate(children):
            code = child.proc.poll()
            if code is not None and not child.ready.is_set():
                child.join()
                _give_up(children, f"replica r{i} failed to start (exit {code}): {child.why()}")
        if stopping.is_set():
            _give_up(children, "stopped by a signal while the replicas started")
        if time.monotonic() > deadline:
            late = [c.name for c in children if not c.ready.is_set()]
            _give_up(children, f"{', '.join(late)} not listening after {args.start_timeout_s:g} s "
                     "(--start-timeout-s)")  # fmt: skip
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> None:
    args, rest = parser().parse_known_args(argv)
    check(args, rest)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    replicas: list[Child] = []
    _start_replicas(args, rest, replicas, stopping)
    router = Child("router", router_command(args, rest, [c.url for c in replicas]))
    children = [router, *replicas]
    while not router.ready.is_set():
        if router.proc.poll() is not None:
            router.join()
            _give_up(children, f"the router failed to start (exit {router.proc.returncode}): "
                     f"{router.why()}")  # fmt: skip
        if stopping.is_set():
            break
        time.sleep(0.1)
    if router.ready.is_set():
        log(f"ready: router {router.url} (pid {router.pid}), policy {args.route_policy}, "
            f"{args.replicas} replicas × {args.nproc_per_node} stages: "
            + " ".join(f"r{i}={c.url}" for i, c in enumerate(replicas)))  # fmt: skip
    reported: set[int] = set()
    while not stopping.is_set():
        if router.proc.poll() is not None:
            router.join()
            _give_up(children, f"the router exited ({router.proc.returncode}): {router.why()}")
        for i, child in enumerate(replicas):
            code = child.proc.poll()
            if code is not None and i not in reported:
                reported.add(i)
                log(f"replica r{i} exited ({code}): {child.why()}; the router takes it out")
        time.sleep(0.2)
    log("draining: SIGTERM to the router and every replica")
    _stop(children)
    _wait_all(children, DRAIN_WAIT_S)
    failed = [f"{c.name} exit {c.proc.returncode}" for c in children if c.proc.returncode]
    if failed:
        print(f"wavepp fleet: drained; not every child exited 0: {', '.join(failed)}",
              file=sys.stderr, flush=True)  # fmt: skip
        sys.exit(1)
    log("drained: every child exited 0")
    sys.exit(0)


if __name__ == "__main__":
    main()
