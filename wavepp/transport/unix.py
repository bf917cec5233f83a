"""The rounds plane over Unix domain sockets, for ranks that share one host.

On the development machine a Gloo MIN among four processes takes 0.9 ms for one int64
and 3.1-3.4 ms for 256 (docs/design.md §10), and every call also hops to a worker thread
and back, because Gloo cannot be awaited. An admission round is two collectives, so
rounds cost milliseconds of wall time even when every rank is idle. Where every rank
runs on one host, :class:`LocalRoundsPlane` does the same four operations over Unix
sockets in a star around rank 0, inside each rank's event loop: a MIN is one frame from
each peer to rank 0 and one frame back; a broadcast one frame out.

The wire: every frame is a 16-byte header — magic, operation, payload length — and the
payload. A header is checked before anything is read or allocated: the magic, the
operation this rank expects now (a peer in another operation is a protocol error, not
data to misread), and the length (a reduction's exact size, or at most
:data:`MAX_FRAME_BYTES`). Payloads are raw bytes or little-endian int64; nothing is
unpickled. The socket lives in a fresh directory only this user can enter, and is
unlinked once every peer has connected.
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
import sys
import tempfile
from collections.abc import Callable, Sequence

import anyio
import anyio.abc

MAGIC = 0x52505057  # "WPPR"
HELLO, BROADCAST, MIN, AND, GATHER = 1, 2, 3, 4, 5
_OPS = {HELLO: "hello", BROADCAST: "broadcast", MIN: "all_reduce MIN", AND: "all_reduce AND",
        GATHER: "gather"}  # fmt: skip
_HEADER = struct.Struct("<IB3xQ")  # magic, op, length
MAX_FRAME_BYTES = 64 << 20  # the largest payload a frame may announce (a broadcast's cap)


class PlaneError(RuntimeError):
    """A collective or transfer failed: a peer died, hung past the timeout, or sent junk.

    (Defined here, where the torch-free plane needs it; ``wavepp.transport.planes`` exports it.)"""


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
            await send_all(self.sock, _HEADER.pack(MAGIC, op, len(payload)) + payload)
        except OSError as error:
            raise PlaneError(f"{self.who} is gone ({_OPS[op]}): {error!r}") from None

    async def _exactly(self, n: int) -> bytes:
        """The next ``n`` bytes (the caller bounds ``n`` before asking)."""
        buf = bytearray(n)
        await recv_exactly(self.sock, memoryview(buf))
        return bytes(buf)

    async def receive(self, op: int, exact: int | None = None) -> bytes:
        """The next frame's payload; it must be ``op``, and ``exact`` bytes if given."""
        try:
            magic, got, n = _HEADER.unpack(await self._exactly(_HEADER.size))
            if magic != MAGIC:
                raise PlaneError(f"{self.who} sent a frame without WavePP's magic")
            if got != op:
                raise PlaneError(f"{self.who} sent {_OPS.get(got, f'operation {got}')} "
                                 f"while this rank runs {_OPS[op]}")  # fmt: skip
            if exact is not None and n != exact:
                raise PlaneError(f"{self.who} sent {n:,} bytes for {_OPS[op]}; "
                                 f"{exact:,} expected")  # fmt: skip
            if n > MAX_FRAME_BYTES:
                raise PlaneError(f"{self.who} announced {n:,} bytes; at most "
                                 f"{MAX_FRAME_BYTES:,} are accepted")  # fmt: skip
            return await self._exactly(n) if n else b""
        except (anyio.IncompleteRead, OSError) as error:
            raise PlaneError(f"{self.who} is gone ({_OPS[op]}): {error!r}") from None

    async def close(self) -> None:
        await self.stream.aclose()


def _ints(values: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(values)}q", *values)


def _unints(raw: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(raw) // 8}q", raw))


class LocalRoundsPlane:
    """The rounds plane's four operations over Unix sockets, a star around rank 0.

    Build it with :meth:`connect` (every rank at once). Every rank calls the same
    operations in the same order, as with collectives; each one is bounded by
    ``timeout_s`` and fails with :class:`PlaneError`, never hangs.
    """

    kind = "local"

    def __init__(self, rank: int, world_size: int, peers: dict[int, _Peer], timeout_s: float):
        self.rank = rank
        self.world_size = world_size
        self.peers = peers  # rank 0: every other rank; elsewhere: {0: rank 0}
        self.timeout_s = timeout_s
        self.lock = anyio.Lock(fast_acquire=True)  # no yield when free: rounds are on the clock
        self.on_wait: Callable[[str], None] = lambda status: None  # the watchdog's status

    @staticmethod
    def listen_path() -> str:
        """A fresh socket path in a directory only this user may enter (rank 0)."""
        return os.path.join(tempfile.mkdtemp(prefix="wavepp-rounds-"), "rounds.sock")

    @classmethod
    async def connect(
        cls, rank: int, world_size: int, path: str, timeout_s: float,
        listener: anyio.abc.SocketListener | None = None,
    ) -> LocalRoundsPlane:  # fmt: skip
        """Rank 0 accepts every other rank on ``listener`` (bound to ``path``); the
        others connect to ``path`` and say which rank they are. The socket file and its
        directory are removed once everyone is in (or the attempt failed)."""
        try:
            with anyio.fail_after(timeout_s):
                if rank != 0:
                    stream = await anyio.connect_unix(path)
                    peer = _Peer(stream, "rank 0")
                    await peer.send(HELLO, _ints([rank]))
                    return cls(rank, world_size, {0: peer}, timeout_s)
                assert listener is not None
                peers: dict[int, _Peer] = {}
                try:
                    while len(peers) < world_size - 1:
                        peer = _Peer(await listener.accept(), "a connecting rank")
                        raw = await peer.receive(HELLO, exact=8)
                        (who,) = _unints(raw)
                        if not 0 < who < world_size or who in peers:
                            await peer.close()
                            raise PlaneError(f"a peer said it is rank {who}; expected one "
                                             f"of 1..{world_size - 1}, once each")  # fmt: skip
                        peer.who = f"rank {who}"
                        peers[who] = peer
                finally:
                    await listener.aclose()
                return cls(rank, world_size, peers, timeout_s)
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
                await self.peers[0].send(op, _ints(mine))
                return _unints(await self.peers[0].receive(op, exact=size))
            out = mine
            for peer in self.peers.values():
                theirs = _unints(await peer.receive(op, size))
                out = [combine(a, b) for a, b in zip(out, theirs, strict=True)]
            raw = _ints(out)
            for peer in self.peers.values():
                await peer.send(op, raw)
            return out

        return await self._bounded(_OPS[op], work)

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
