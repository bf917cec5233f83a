"""Test rig for handoffs: a real receiver (``wavepp.handoff.Receiver``) on a Unix socket in
a thread of the test process, and a pipeline run under torchrun whose requests hand
their caches to it."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import anyio.from_thread

from tests.helpers.run import torchrun
from wavepp.handoff.assembly import Handoff
from wavepp.handoff.receive import Receiver


def fill_backlog(path: str, most: int = 4096) -> list:
    """Connect non-blocking Unix sockets to the listener at ``path`` until its backlog
    is full (the next connect gets EAGAIN); the caller closes them."""
    import socket

    filled = []
    for _ in range(most):
        sock = socket.socket(socket.AF_UNIX)
        sock.setblocking(False)
        if sock.connect_ex(path) != 0:
            sock.close()
            break
        filled.append(sock)
    return filled


class ReceiverThread:
    """``with ReceiverThread(config, dtype, path) as rx:`` — ``rx.handoffs`` fills as
    requests' caches complete; the receiver's event loop runs in a thread (a portal)."""

    def __init__(self, config: dict, dtype: str, path: Path | None, *,
                 address: str | None = None, **options) -> None:  # fmt: skip
        self.address = address or f"unix:{path}"
        self.handoffs: dict[str, Handoff] = {}
        self.receiver = Receiver(config, dtype, on_complete=self._complete, **options)
        self._portal = None
        self._future = None

    def _complete(self, handoff: Handoff) -> None:
        self.handoffs[handoff.request_id] = handoff

    def __enter__(self) -> ReceiverThread:
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        self._future, _ = self._portal.start_task(self.receiver.serve, self.address)
        return self

    def __exit__(self, *exc) -> None:
        self._future.cancel()
        self._portal_cm.__exit__(None, None, None)


def write_requests(path: Path, prompts: dict[str, list[int]], handoff: str | bool) -> Path:
    with open(path, "w") as f:
        for rid, tokens in prompts.items():
            f.write(json.dumps({"id": rid, "tokens": tokens, "handoff": handoff}) + "\n")
    return path


def run_pipeline(nproc: int, model: str, requests_file: Path, out: Path, *options: str,
                 timeout: float = 300) -> dict:  # fmt: skip
    torchrun(nproc, ["-m", "wavepp.main", "--no-progress", "--model", model, "--requests-file",
                     str(requests_file), "--json", str(out), *options], timeout)  # fmt: skip
    return json.loads(out.read_text())
