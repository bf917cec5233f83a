"""Both planes over Unix domain sockets, for ranks that share one host.

**Rounds plane.** On the development machine a Gloo MIN among four processes takes 0.9 ms
for one int64 and 3.1-3.4 ms for 256 (docs/design.md §10), and every call also hops to a
worker thread and back, because Gloo cannot be awaited. An admission round is two
collectives, so rounds cost milliseconds of wall time even when every rank is idle.
:class:`SocketRoundsPlane` does the same four operations over Unix sockets in a star
around rank 0, inside each rank's event loop: a MIN is one frame from each peer to rank 0
and one frame back; a broadcast one frame out. The socket lives in a fresh directory
only this user can enter, and is unlinked once every peer has connected.

**Data plane.** :class:`SocketLink` carries one direction of a link over a connected
socket, around the ring of ranks (:func:`connect_ring`).

The frames and their checks, before anything is read or allocated, are
:mod:`wavepp.transport.frames`'; nothing is unpickled.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Sequence

import anyio
import anyio.abc
import torch

from wavepp.transport.base import PlaneError, no_status
from wavepp.transport.frames import (
    AND,
    BROADCAST,
    FRAME,
    GATHER,
    HEADER,
    HELLO,
    MAX_FRAME_BYTES,
    MIN,
    OPS,
    DataLimits,
    check_frame,
    frame,
    ints,
    make_header,
    parse_header,
    unints,
)


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


class _Peer:
    """One connected socket: frames out, frames in (each header checked first).

    Frames go to and come from the raw socket straight away (:func:`send_all`,
    :func:`recv_exactly`): an anyio stream's ``send`` and ``receive`` first yield to the
    event loop, which here let a rank's wave work run between a round's frames (a round
    waited on it: 2.1-3.1 ms p50 a round on the ``seeded-8k`` smoke cell)."""

    def __init__(self, stream: anyio.abc.SocketStream, who: str) -> None:
        self.stream = stream
        self.sock = stream.extra(anyio.abc.SocketAttribute.raw_socket)
        self.who = who

    async def send(self, op: int, payload: bytes) -> None:
        try:
            await send_all(self.sock, frame(op, payload))
        except OSError as error:
            raise PlaneError(f"{self.who} is gone ({OPS[op]}): {error!r}") from None

    async def _exactly(self, n: int) -> bytes:
        """The next ``n`` bytes (the caller bounds ``n`` before asking)."""
        buf = bytearray(n)
        await recv_exactly(self.sock, memoryview(buf))
        return bytes(buf)

    async def receive(self, op: int, exact: int | None = None) -> bytes:
        """The next frame's payload; it must be ``op``, and ``exact`` bytes if given."""
        try:
            n = check_frame(await self._exactly(FRAME.size), op, exact, self.who)
            return await self._exactly(n) if n else b""
        except (anyio.IncompleteRead, OSError) as error:
            raise PlaneError(f"{self.who} is gone ({OPS[op]}): {error!r}") from None

    async def close(self) -> None:
        await self.stream.aclose()


class SocketRoundsPlane:
    """The rounds plane's four operations over Unix sockets, a star around rank 0.

    Build it with :meth:`connect` (every rank at once). Every rank calls the same
    operations in the same order, as with collectives; each one is bounded by
    ``timeout_s`` and fails with :class:`PlaneError`, never hangs.
    """

    kind = "local"

    def __init__(
        self, rank: int, world_size: int, peers: dict[int, _Peer], timeout_s: float,
        on_wait: Callable[[str], None] = no_status,
    ) -> None:  # fmt: skip
        self.rank = rank
        self.world_size = world_size
        self.peers = peers  # rank 0: every other rank; elsewhere: {0: rank 0}
        self.timeout_s = timeout_s
        self.on_wait = on_wait  # the watchdog's status
        self.lock = anyio.Lock(fast_acquire=True)  # no yield when free: rounds are on the clock

    @staticmethod
    def listen_path() -> str:
        """A fresh socket path in a directory only this user may enter (rank 0)."""
        return os.path.join(tempfile.mkdtemp(prefix="wavepp-rounds-"), "rounds.sock")

    @classmethod
    async def connect(
        cls, rank: int, world_size: int, path: str, timeout_s: float,
        listener: anyio.abc.SocketListener | None = None,
        on_wait: Callable[[str], None] = no_status,
    ) -> SocketRoundsPlane:  # fmt: skip
        """Rank 0 accepts every other rank on ``listener`` (bound to ``path``); the
        others connect to ``path`` and say which rank they are. The socket file and its
        directory are removed once everyone is in (or the attempt failed)."""
        try:
            with anyio.fail_after(timeout_s):
                if rank != 0:
                    stream = await anyio.connect_unix(path)
                    peer = _Peer(stream, "rank 0")
                    await peer.send(HELLO, ints([rank]))
                    return cls(rank, world_size, {0: peer}, timeout_s, on_wait)
                assert listener is not None
                peers: dict[int, _Peer] = {}
                try:
                    while len(peers) < world_size - 1:
                        peer = _Peer(await listener.accept(), "a connecting rank")
                        raw = await peer.receive(HELLO, exact=8)
                        (who,) = unints(raw)
                        if not 0 < who < world_size or who in peers:
                            await peer.close()
                            raise PlaneError(f"a peer said it is rank {who}; expected one "
                                             f"of 1..{world_size - 1}, once each")  # fmt: skip
                        peer.who = f"rank {who}"
                        peers[who] = peer
                finally:
                    await listener.aclose()
                return cls(rank, world_size, peers, timeout_s, on_wait)
        except TimeoutError:
            raise PlaneError(f"rounds plane: not every rank connected within {timeout_s:g} s "
                             f"(rank {rank})") from None  # fmt: skip
        finally:
            if rank == 0:
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)

    async def _bounded(self, what: str, work):
        self.on_wait(f"waiting on the rounds plane ({what}, all ranks)")
        try:
            with anyio.fail_after(self.timeout_s):
                return await work()
        except TimeoutError:
            raise PlaneError(f"rounds plane {what}: no answer within {self.timeout_s:g} s"
                             ) from None  # fmt: skip
        finally:
            self.on_wait("running")

    async def broadcast(self, payload: bytes | None) -> bytes:
        async def work() -> bytes:
            if self.rank != 0:
                return await self.peers[0].receive(BROADCAST)
            assert payload is not None
            if len(payload) > MAX_FRAME_BYTES:  # the peers would refuse it: say so here
                raise PlaneError(f"a broadcast of {len(payload):,} bytes; at most "
                                 f"{MAX_FRAME_BYTES:,} are accepted")  # fmt: skip
            for peer in self.peers.values():
                await peer.send(BROADCAST, payload)
            return payload

        return await self._bounded("broadcast from rank 0", work)

    async def _reduce(self, op: int, values: Sequence[int], combine) -> list[int]:
        if not values:
            return []
        mine = list(values)

        async def work() -> list[int]:
            size = 8 * len(mine)
            if self.rank != 0:
                await self.peers[0].send(op, ints(mine))
                return unints(await self.peers[0].receive(op, exact=size))
            out = mine
            for peer in self.peers.values():
                theirs = unints(await peer.receive(op, size))
                out = [combine(a, b) for a, b in zip(out, theirs, strict=True)]
            raw = ints(out)
            for peer in self.peers.values():
                await peer.send(op, raw)
            return out

        return await self._bounded(OPS[op], work)

    async def all_min(self, values: Sequence[int]) -> list[int]:
        return await self._reduce(MIN, values, min)

    async def all_and(self, values: Sequence[int]) -> list[int]:
        return await self._reduce(AND, values, lambda a, b: a & b)

    async def gather(self, payload: bytes) -> list[bytes] | None:
        async def work() -> list[bytes] | None:
            if self.rank != 0:
                await self.peers[0].send(GATHER, payload)
                return None
            got = {0: payload}
            for who, peer in self.peers.items():
                got[who] = await peer.receive(GATHER)
            return [got[r] for r in range(self.world_size)]

        return await self._bounded("gather of stage reports", work)

    async def aclose(self) -> None:
        for peer in self.peers.values():
            await peer.close()


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
