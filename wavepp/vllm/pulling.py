"""One stage's band, pulled by the connector (``docs/handoff.md``, one pull on the
wire): a blocking socket in one of the connector's threads. Nothing of the band is handed
on before its header has passed the receiver's checks (``wavepp.handoff.gate.Gate``:
the wire version and bounds, the band's fingerprint against the decoder's field by field,
every layer's tensors for the prompt's length) and matches what the request's
``kv_transfer_params`` named (request, stage, stages, prompt length); given the shared
secret, the header's signature is checked first (``verify``: ``wavepp.handoff.auth``).
Then each tensor is read whole and given to ``take``, in the band's order. No vLLM
import.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import torch

from wavepp.handoff import wire
from wavepp.handoff.auth import AuthError
from wavepp.handoff.gate import Gate

LINGER_BYTES = 1 << 21  # of a band refused for its signature, dropped before closing
LINGER_S = 2.0  # ... for at most this long


class PullFailed(Exception):
    """A band that did not come, or came wrong (the message says why, in one line);
    ``kind`` says which way, for the connector's metrics: ``connect`` (the stage cannot
    be reached), ``refused`` (the stage refused the pull), ``auth`` (the band's signature
    does not verify), ``band`` (the band failed another check), ``broken`` (the
    connection closed, stalled or failed mid-band)."""

    def __init__(self, message: str, kind: str = "broken") -> None:
        super().__init__(message)
        self.kind = kind


class PullRefused(PullFailed):
    """The stage refused the pull (its ack says why: an expired lease, an unknown
    request, another model, an unsigned pull, ...)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "refused")


class _Refused(ValueError):
    """The decoder refuses a band it needs none of (``pull_band``'s ``refuse``)."""


def _connect(address: str, timeout_s: float) -> socket.socket:
    where = wire.parse_address(address)
    if where.kind == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            sock.connect(where.path)
        except BaseException:
            sock.close()
            raise
        return sock
    return socket.create_connection((where.host, where.port), timeout=timeout_s)


class _Reader:
    """Exact reads before a deadline; each recv waits at most ``timeout_s``."""

    def __init__(self, sock: socket.socket, deadline: float, timeout_s: float) -> None:
        self.sock, self.deadline, self.timeout_s = sock, deadline, timeout_s

    def into(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise PullFailed(f"the band did not arrive in time ({got} of {len(view)} "
                                 "bytes of a read)")  # fmt: skip
            self.sock.settimeout(min(self.timeout_s, left))
            n = self.sock.recv_into(view[got:])
            if not n:
                raise PullFailed(f"the stage closed the connection after {got} of "
                                 f"{len(view)} bytes of a read")  # fmt: skip
            got += n

    def drop(self, n: int) -> None:
        """Read ``n`` bytes and drop them; quietly stop at the deadline or a closed peer."""
        chunk = memoryview(bytearray(min(n, 1 << 20)))
        try:
            while n > 0:
                step = min(n, len(chunk))
                self.into(chunk[:step])
                n -= step
        except (PullFailed, OSError):
            pass

    def exactly(self, n: int) -> bytes:
        buf = bytearray(n)
        self.into(memoryview(buf))
        return bytes(buf)


def pull_band(address: str, pull: wire.Pull, gate: Gate, *, num_stages: int, num_tokens: int,
              take: Callable[[wire.TensorSpec, torch.Tensor], None], deadline: float,
              read_timeout_s: float = 10.0, opened: Callable[[socket.socket], None] | None = None,
              refuse: str = "", verify: Callable[[wire.BandHeader], None] | None = None
              ) -> wire.BandHeader:  # fmt: skip
    """Pull stage ``pull.stage``'s band of ``pull.request_id`` from ``address``, check it
    and give each tensor to ``take``; acknowledge it once every tensor is taken, or
    answer ``ok: false`` with the error when ``take`` or a check raises. Returns the
    header; PullFailed naming why otherwise (a refusal carries the stage's own words).
    ``opened``: called with the socket once connected (the caller may shut it down to
    stop a pull that has run out of time). ``refuse``: the decoder needs none of the band
    (vLLM had the prompt cached itself): its header is read, and the band refused with
    this reason, which releases it on the stage at once instead of at its lease's end.
    ``verify``: the header's signature check (``auth.Verifier.header``; raises
    ``auth.AuthError``), made before any other check and before any of the payload is
    read; a band that fails it is refused. ``pull`` goes as given (signed by the caller
    when the stages need it). PullRefused: the stage refused the pull."""
    try:
        sock = _connect(address, read_timeout_s)
    except (OSError, ValueError) as error:
        raise PullFailed(
            f"stage {pull.stage} at {address}: cannot connect ({error})", "connect"
        ) from None
    header = None
    try:
        if opened is not None:
            opened(sock)
        reader = _Reader(sock, deadline, read_timeout_s)
        try:
            sock.sendall(wire.encode_pull(pull))
            magic = reader.exactly(4)
            if magic == wire.ACK_MAGIC:
                length = wire.ack_length(magic + reader.exactly(wire.ACK_PREFIX_BYTES - 4))
                ack = wire.decode_ack(reader.exactly(length))
                raise PullRefused(f"stage {pull.stage} refused the pull: {ack.error}")
            length = wire.header_length(magic + reader.exactly(wire.PREFIX_BYTES - 4))
            header = wire.decode_header(reader.exactly(length))
            left = wire.band_bytes(header)  # of the payload, not read yet
            if verify is not None:
                verify(header)
            if refuse:
                raise _Refused(refuse)
            gate.check(header)
            _check_named(header, pull, num_stages, num_tokens)
            for spec in header.tensors:
                # read straight into the tensor's memory (torch.empty: no zeroing pass)
                raw = torch.empty(spec.nbytes, dtype=torch.uint8)
                reader.into(memoryview(raw.numpy()))
                left -= spec.nbytes
                tensor = raw.view(getattr(torch, spec.dtype)).view(spec.shape)
                if spec.layer == -1:
                    gate.check_tokens({(-1, spec.name): tensor})
                take(spec, tensor)
        except (PullFailed, wire.WireError, ValueError) as error:
            why = str(error)
            if isinstance(error, AuthError):
                # a stranger: refused at once, its payload not read, only some of it
                # dropped for a moment so that a small band's sender sees the refusal
                # rather than a reset (as WavePP's receiver does)
                _answer(sock, header, False, why)
                reader.deadline = min(reader.deadline, time.monotonic() + LINGER_S)
                reader.drop(min(left, LINGER_BYTES))
            elif header is not None and not isinstance(error, PullFailed):
                # as a receiver does: the rest of the payload read and dropped (up to the
                # band limit), so the stage reads the refusal rather than a broken pipe
                if left <= gate.max_band_bytes:
                    reader.drop(left)
                _answer(sock, header, False, why)
            if isinstance(error, _Refused):
                return header
            if isinstance(error, PullFailed):
                raise
            kind = "auth" if isinstance(error, AuthError) else "band"
            raise PullFailed(f"stage {pull.stage}'s band refused: {why}", kind) from None
        except OSError as error:
            raise PullFailed(f"stage {pull.stage} at {address}: {error}") from None
        if not _answer(sock, header, True, ""):
            raise PullFailed(f"stage {pull.stage}: the acknowledgement could not be sent")
        return header
    finally:
        sock.close()


def _check_named(header: wire.BandHeader, pull: wire.Pull, num_stages: int,
                 num_tokens: int) -> None:  # fmt: skip
    """The band is the one asked for, of the request kv_transfer_params named."""
    got = (header.request_id, header.stage, header.num_stages, header.num_tokens)
    want = (pull.request_id, pull.stage, num_stages, num_tokens)
    for name, a, b in zip(("request_id", "stage", "num_stages", "num_tokens"), got, want,
                          strict=True):  # fmt: skip
        if a != b:
            raise wire.WireError(f"the band's {name} is {a!r}, kv_transfer_params name {b!r}")


def _answer(sock: socket.socket, header: wire.BandHeader, ok: bool, error: str) -> bool:
    try:
        sock.settimeout(5.0)
        sock.sendall(wire.encode_ack(wire.Ack(header.request_id, header.stage, ok, error)))
        return True
    except (OSError, wire.WireError):
        return False
