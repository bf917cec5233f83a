"""``python -m wavepp.serve.launch --nproc-per-node P [server and run options]``.

One-node launcher for supervisors (systemd, Kubernetes, a shell's ``kill``) that stop a
service with SIGTERM to its main process. Under plain ``torchrun`` that signal reaches
every rank (they drain) but torchrun itself then exits 1 by its own convention. This
launcher runs ``torchrun --standalone`` as a child, finds the serving rank's pid on its
``listening on ... (pid N)`` line, and on SIGTERM or SIGINT sends SIGTERM to that rank
only: the server drains, the leak check runs, every rank ends, and the exit status is
torchrun's — 0 when the check held. A signal that comes before the server is listening
goes to torchrun as usual.

Every check that does not need the ranks (server and run options, the split of layers and
pools over P stages, the model's name) runs here first: a bad option is one line and
exit 2, before torchrun starts. When a run fails, the launcher's last line repeats the
rank's own line naming the cause (torchrun's summary names whichever rank ended first),
and torchrun ends ranks left behind (a stopped one) 5 s after the first rank ended
(``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, unless set).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading

READY = re.compile(r"\[wavepp serve\] listening on \S+ \(pid (\d+)\)")
CAUSE = re.compile(r"^\[wavepp rank \d+\] (failed: |rank \d+: ).*")
SHUTDOWN_TIMEOUT_S = "5"  # torchrun's wait for the other ranks once one has ended


def command(nproc: int, rest: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", "wavepp.serve", *rest]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m wavepp.serve.launch",
        description="Run the WavePP server on one node; SIGTERM drains it and exits 0.",
    )
    p.add_argument("--nproc-per-node", type=int, required=True, help="pipeline stages P")
    args, rest = p.parse_known_args(argv)
    if args.nproc_per_node < 1:
        raise SystemExit(f"--nproc-per-node must be ≥ 1, got {args.nproc_per_node}")
    if "-h" in rest or "--help" in rest:
        from wavepp.serve.__main__ import main as serve_main

        serve_main(["--help"])
    from wavepp.serve.__main__ import check

    check(rest, args.nproc_per_node)  # SystemExit with one line: nothing started
    env = {**os.environ}
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", SHUTDOWN_TIMEOUT_S)
    child = subprocess.Popen(command(args.nproc_per_node, rest), stderr=subprocess.PIPE,
                             text=True, errors="replace", env=env)  # fmt: skip
    serving: list[int] = []
    causes: list[str] = []

    def relay() -> None:  # torchrun's stderr to ours, watching for the serving rank's pid
        assert child.stderr is not None
        for line in child.stderr:
            sys.stderr.write(line)
            match = READY.search(line)
            if match and not serving:
                serving.append(int(match.group(1)))
            if CAUSE.match(line) and not causes:
                causes.append(line.strip())
        sys.stderr.flush()

    def stop(signum, frame) -> None:
        target, sent = (serving[0], signal.SIGTERM) if serving else (child.pid, signum)
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.kill(target, sent)

    thread = threading.Thread(target=relay, name="wavepp-launch-relay", daemon=True)
    thread.start()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = child.wait()
    thread.join(timeout=5)
    if code and causes:
        sys.stderr.write(f"wavepp serve.launch: exit {code}; the cause, as the rank said it: "
                         f"{causes[0]}\n")  # fmt: skip
    sys.exit(code)


if __name__ == "__main__":
    main()
