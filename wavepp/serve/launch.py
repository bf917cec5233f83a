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
exit 1, before torchrun starts. When a run fails, the launcher's last line repeats the
rank's own line naming the cause (torchrun's summary names whichever rank ended first),
and ranks left behind (a stopped one, which torchrun would wait 30 s for) are killed
LEFT_BEHIND_S after the serving rank failed.
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
import time
from pathlib import Path

READY = re.compile(r"\[wavepp serve\] listening on \S+ \(pid (\d+)\)")
CAUSE = re.compile(r"^\[wavepp rank \d+\] (failed: |rank \d+: ).*")
LEFT_BEHIND_S = 1.0  # once the serving rank failed, how long the others get to end


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started (Linux; none where /proc does not say)."""
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    state = Path(f"/proc/{pid}/stat")
    with contextlib.suppress(OSError, IndexError):  # a zombie has ended
        return state.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def command(nproc: int, rest: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", "wavepp.serve", *rest]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m wavepp.serve.launch",
        description="Run the WavePP server on one node; SIGTERM drains it and exits 0.",
    )
    p.add_argument("--nproc-per-node", type=int, required=True,
                   help="ranks: pipeline stages P (x --tp T)")
    args, rest = p.parse_known_args(argv)
    if args.nproc_per_node < 1:
        raise SystemExit(f"--nproc-per-node must be ≥ 1, got {args.nproc_per_node}")
    if "-h" in rest or "--help" in rest:
        from wavepp.serve.__main__ import main as serve_main

        serve_main(["--help"])
    from wavepp.serve.__main__ import check

    check(rest, args.nproc_per_node)  # SystemExit with one line: nothing started
    child = subprocess.Popen(command(args.nproc_per_node, rest), stderr=subprocess.PIPE,
                             text=True, errors="replace")  # fmt: skip
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
    failed_at = None
    while child.poll() is None:
        time.sleep(0.2)
        if causes and serving and not _alive(serving[0]):
            failed_at = failed_at or time.monotonic()
            if time.monotonic() - failed_at > LEFT_BEHIND_S:
                for pid in _children(child.pid):  # a stopped rank ignores torchrun's SIGTERM
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
    code = child.wait()
    thread.join(timeout=5)
    if code and causes:
        sys.stderr.write(f"wavepp serve.launch: exit {code}; the cause, as the rank said it: "
                         f"{causes[0]}\n")  # fmt: skip
    sys.exit(code)


if __name__ == "__main__":
    main()
