"""A fake decoder that pulls bands: a plain blocking socket speaking the pull protocol
(``docs/handoff.md``) byte by byte, and behaving well or badly on request."""

from __future__ import annotations

import socket
import time

import attrs

from wavepp.handoff import wire


@attrs.frozen
class Pulled:
    """What a pull got: the band (header and payload bytes) or the stage's refusal."""

    header: wire.BandHeader | None = None
    payload: bytes = b""
    refusal: wire.Ack | None = None  # the stage refused the pull (ok=False)


def connect(address: str, timeout_s: float = 30.0) -> socket.socket:
    where = wire.parse_address(address)
    if where.kind == "unix":
        sock = socket.socket(socket.AF_UNIX)
        sock.settimeout(timeout_s)
        sock.connect(where.path)
    else:
        sock = socket.create_connection((where.host, where.port), timeout=timeout_s)
    return sock


def exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            raise EOFError(f"the stage closed after {len(data)} of {n} bytes")
        data += part
    return bytes(data)


def pull_frame(request_id: str, stage: int, fingerprint: wire.Fingerprint) -> bytes:
    return wire.encode_pull(wire.Pull(request_id, stage, fingerprint))


def pull(address: str, request_id: str, stage: int, fingerprint: wire.Fingerprint, *,
         frame: bytes | None = None, ack: str = "ok", hold_s: float = 0.0,
         timeout_s: float = 30.0) -> Pulled:  # fmt: skip
    """One pull. ``frame``: bytes to send instead of the proper pull frame. ``ack``: what
    the fake decoder does once the band's header is in — ``ok`` (reads the payload,
    acknowledges), ``refuse`` (reads it, answers ok=False), ``hang-up`` (closes before
    the payload), ``none`` (reads it, closes without an ack). ``hold_s``: waits this
    long before reading the payload."""
    with connect(address, timeout_s) as sock:
        sock.sendall(frame if frame is not None else pull_frame(request_id, stage, fingerprint))
        magic = exactly(sock, 4)
        if magic == wire.ACK_MAGIC:
            length = wire.ack_length(magic + exactly(sock, wire.ACK_PREFIX_BYTES - 4))
            return Pulled(refusal=wire.decode_ack(exactly(sock, length)))
        length = wire.header_length(magic + exactly(sock, wire.PREFIX_BYTES - 4))
        header = wire.decode_header(exactly(sock, length))
        if ack == "hang-up":
            return Pulled(header)
        time.sleep(hold_s)
        payload = exactly(sock, wire.band_bytes(header))
        if ack == "none":
            return Pulled(header, payload)
        answer = wire.Ack(header.request_id, header.stage, ack == "ok",
                          "" if ack == "ok" else "the decoder gave up")  # fmt: skip
        sock.sendall(wire.encode_ack(answer))
        return Pulled(header, payload)
