"""Both planes over Unix domain sockets, for ranks that share one host.

**Rounds plane.** :class:`SocketRoundsPlane`, a star around rank 0 inside each rank's
event loop (:mod:`wavepp.transport.local_rounds`).

**Data plane.** :class:`SocketLink` carries one direction of a link over a connected
socket, around the ring of ranks (:func:`connect_ring`).

The frames and their checks, before anything is read or allocated, are
:mod:`wavepp.transport.frames`'; nothing is unpickled.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile

import anyio
import torch

from wavepp.transport.base import PlaneError
from wavepp.transport.frames import HEADER, DataLimits, make_header, parse_header
from wavepp.transport.local_rounds import SocketRoundsPlane

__all__ = ["SocketLink", "SocketRoundsPlane", "available", "connect_ring", "link_directory",
           "listen_inbound", "recv_exactly", "send_all"]  # fmt: skip


async def send_all(sock: socket.socket, data: bytes | memoryview) -> None:
    """Write all of ``data`` to a non-blocking socket, waiting only when it would block
    (an anyio stream's ``send`` yields to the event loop first, even when it need not)."""
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view) :]
        except BlockingIOError:
            await anyio.wait_writable(sock)


async def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from a non-blocking socket, waiting only when it would block;
    :class:`anyio.IncompleteRead` if the peer closes first."""
    got = 0
    while got < len(view):
        try:
            n = sock.recv_into(view[got:])
        except BlockingIOError:
            await anyio.wait_readable(sock)
            continue
        if n == 0:
            raise anyio.IncompleteRead
        got += n


def available() -> bool:
    """Unix domain sockets exist here (not on Windows)."""
    return sys.platform != "win32"


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable buffer (shared, not copied)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


class SocketLink:
    """One direction of the data plane over a connected Unix socket, awaited in the
    rank's event loop.

    Over Gloo a hand-off is three pair messages (0.7-1.4 ms each here, DESIGN §10), each
    waited on in a worker thread, and a thread hop on each side; here it is one write of
    the header and descriptor, one of the tensor's bytes, and the reads straight into the
    received tensor, with no thread. The header and its checks before anything is
    allocated are :mod:`~wavepp.transport.frames`', the same bytes as over Gloo; tensors
    are CPU tensors (a CUDA tensor is staged through host memory, as over Gloo). A lock
    per direction keeps each message's parts together. A receive may wait for the next
    header as long as the link is idle; the rest of a message must follow within
    ``timeout_s``. A peer that exits closes its end: the wait fails at once with
    :class:`PlaneError`, where a Gloo receive waits out its timeout.
    """

    kind = "local"

    def __init__(
        self, src: int, dst: int, sock: socket.socket, timeout_s: float,
        limits: DataLimits | None = None, device: torch.device | None = None,
    ) -> None:  # fmt: skip
        sock.setblocking(False)
        self.src = src
        self.dst = dst
        self.sock = sock
        self.timeout_s = timeout_s
        self.limits = limits or DataLimits()
        self.device = device or torch.device("cpu")
        self._sending = anyio.Lock(fast_acquire=True)  # one message's parts together, whoever sends
        self._receiving = anyio.Lock(fast_acquire=True)

    def set_limits(self, limits: DataLimits) -> None:
        self.limits = limits

    async def _write(self, data: memoryview) -> None:
        try:
            await send_all(self.sock, data)
        except OSError as error:
            raise PlaneError(f"data plane: sending to rank {self.dst} failed: {error!r}"
                             ) from None  # fmt: skip

    async def _read_into(self, view: memoryview) -> None:
        try:
            await recv_exactly(self.sock, view)
        except anyio.IncompleteRead:
            raise PlaneError(f"data plane: rank {self.src} closed its link in a message "
                             f"part of {len(view)} bytes") from None  # fmt: skip
        except OSError as error:
            raise PlaneError(f"data plane: receiving from rank {self.src} failed: {error!r}"
                             ) from None  # fmt: skip

    async def send(self, descriptor: bytes, tensor: torch.Tensor | None) -> None:
        head = HEADER.pack(*make_header(self.src, descriptor, tensor)) + descriptor
        body = None
        if tensor is not None and tensor.numel():
            body = tensor.detach().cpu().contiguous()  # kept alive while it is written
        async with self._sending:
            try:
                with anyio.fail_after(self.timeout_s):
                    await self._write(memoryview(head))
                    if body is not None:
                        await self._write(_byte_view(body))
            except TimeoutError:
                raise PlaneError(f"data plane: rank {self.dst} took no message for "
                                 f"{self.timeout_s:g} s") from None  # fmt: skip

    async def recv(self, max_bytes: int | None = None) -> tuple[bytes, torch.Tensor | None]:
        async with self._receiving:
            raw = bytearray(HEADER.size)
            await self._read_into(memoryview(raw))  # the link may idle before a header
            header = parse_header(HEADER.unpack(raw), self.src, self.limits, max_bytes)
            try:
                with anyio.fail_after(self.timeout_s):
                    desc = bytearray(header.descriptor_bytes)
                    await self._read_into(memoryview(desc))
                    tensor = None
                    if header.dtype is not None:
                        with torch.inference_mode():  # like the sender's executor output
                            tensor = torch.empty(header.shape, dtype=header.dtype)
                        if tensor.numel():
                            await self._read_into(_byte_view(tensor))
                        with torch.inference_mode():
                            tensor = tensor.to(self.device)
            except TimeoutError:
                raise PlaneError(f"data plane: a message from rank {self.src} stopped short "
                                 f"for {self.timeout_s:g} s") from None  # fmt: skip
        return bytes(desc), tensor


def link_directory() -> str:
    """A fresh directory only this user may enter, for the links' sockets (rank 0)."""
    return tempfile.mkdtemp(prefix="wavepp-data-")


def listen_inbound(directory: str, rank: int) -> socket.socket:
    """This rank's listening socket for its one inbound link (rank 0: the completions
    from the last rank)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(os.path.join(directory, f"in-{rank}.sock"))
        listener.listen(1)
    except OSError:
        listener.close()
        raise
    return listener


def connect_ring(directory: str, rank: int, world: int, listener: socket.socket,
                 timeout_s: float) -> tuple[socket.socket, socket.socket]:  # fmt: skip
    """(to rank+1, from rank-1), around the ring: connect to the next rank's socket and
    say who this is; accept the previous rank and check who it says it is. Blocking:
    every rank connects before it accepts, so it runs in a worker thread."""
    send_to, recv_from = (rank + 1) % world, (rank - 1) % world
    out = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        out.settimeout(timeout_s)
        out.connect(os.path.join(directory, f"in-{send_to}.sock"))
        out.sendall(rank.to_bytes(8, "little"))
        listener.settimeout(timeout_s)
        into, _ = listener.accept()
    except OSError as error:
        out.close()
        raise PlaneError(f"data plane: rank {rank} could not connect its links: {error!r}"
                         ) from None  # fmt: skip
    into.settimeout(timeout_s)
    try:
        hello = into.recv(8, socket.MSG_WAITALL)  # fewer if the peer closes first
    except OSError:
        hello = b""
    if int.from_bytes(hello.ljust(8, b"\xff"), "little") != recv_from:
        out.close()
        into.close()
        raise PlaneError(f"data plane: rank {rank} expected rank {recv_from} on its inbound "
                         f"socket, got {hello!r}")  # fmt: skip
    return out, into
