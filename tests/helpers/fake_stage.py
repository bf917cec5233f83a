"""A fake WavePP band server: a thread on a Unix socket that answers every pull frame
with the band it was given (built with ``wavepp.handoff.client.build_band``, and then
made wrong on purpose by the test), and counts the pulls and acks it got. Given a
``secret``, it refuses a pull not signed with it (as a band server does) and signs each
band's header with it (a header the test signed already goes as it is)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections import Counter
from pathlib import Path

import torch

from tests.helpers.puller import exactly
from wavepp.handoff import wire
from wavepp.handoff.auth import Verifier, sign_header


class FakeStage:
    """Serves ``bands[request_id]`` = (header, payload tensors) at ``unix:{path}``."""

    def __init__(self, path: Path, bands: dict[str, tuple[wire.BandHeader, list[torch.Tensor]]],
                 secret: bytes | None = None):  # fmt: skip
        self.path, self.bands, self.secret = path, bands, secret
        self._verifier = Verifier(secret) if secret else None
        self._lock = threading.Lock()  # the verifier's, across connections
        self.address = f"unix:{path}"
        self.counts: Counter[str] = Counter()
        self.acks: list[wire.Ack] = []  # the decoder's answers, in order
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(path))
        self._sock.listen(16)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError, EOFError, wire.WireError):
            conn.settimeout(30)
            length = wire.pull_length(exactly(conn, wire.PULL_PREFIX_BYTES))
            pull = wire.decode_pull(exactly(conn, length))
            self.counts["pulls"] += 1
            if self._verifier is not None:
                try:
                    with self._lock:
                        self._verifier.pull(pull)
                except wire.WireError as error:
                    self.counts["pulls refused"] += 1
                    conn.sendall(wire.encode_ack(wire.Ack(pull.request_id, pull.stage, False,
                                                          str(error))))  # fmt: skip
                    return
            header, payload = self.bands[pull.request_id]
            if not header.auth:
                header = sign_header(header, self.secret)
            conn.sendall(wire.encode_band_prefix(header))
            for tensor in payload:
                conn.sendall(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            magic = exactly(conn, 4)
            ack = wire.decode_ack(exactly(conn, wire.ack_length(magic + exactly(conn, 4))))
            self.acks.append(ack)
            self.counts["acked ok" if ack.ok else "acked refused"] += 1

    def close(self) -> None:
        self._sock.close()
        with contextlib.suppress(OSError):
            self.path.unlink()
