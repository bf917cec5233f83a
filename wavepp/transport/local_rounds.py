"""The rounds plane over Unix sockets, a star around rank 0, in each rank's event loop.

On the development machine a Gloo MIN among four processes takes 0.9 ms for one int64
and 3.1-3.4 ms for 256 (docs/design.md §10), and every call also hops to a worker thread
and back, because Gloo cannot be awaited. :class:`SocketRoundsPlane` does the plane's
operations over Unix sockets inside each rank's event loop: a reduction is one frame from
each peer to rank 0 and one frame back; a broadcast one frame out. The socket lives in a
fresh directory only this user can enter, and is unlinked once every peer has connected.

**What an operation costs.** With four ranks on two cores a round's wall time is mostly
the CPU its operations take on every rank (each rank's turn waits for a core the others
hold) and the wake-ups between them (docs/design.md §10). So an operation does no more
than its frames need: it reads a peer's socket into a buffer of its own (a frame's header
and payload usually in one ``recv``), waits for readability straight on the event loop
(``add_reader``, one future; no task, thread or cancel scope of its own) and arms its
timeout only when it must wait. A peer's bytes beyond the frame asked for stay in the
buffer for the next one; the buffer holds at most the frame asked for plus
:data:`READ_AHEAD` bytes, so a peer cannot make a rank allocate more than
:func:`~wavepp.transport.frames.check_frame` allows. Every header is checked before its
payload is read. The frames are :mod:`wavepp.transport.frames`'; nothing is unpickled.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Sequence

import anyio
import anyio.abc
import numpy as np

from wavepp.rounds.trace import NO_TRACE, RoundTrace
from wavepp.transport.base import PlaneError, no_status
from wavepp.transport.frames import (
    BROADCAST,
    FRAME,
    GATHER,
    HELLO,
    MAX_FRAME_BYTES,
    OPS,
    REDUCE,
    check_frame,
    frame,
    ints,
    unints,
)

READ_AHEAD = 1 << 16  # bytes a read may take beyond the frame asked for
_INT64 = np.dtype("<i8")


class _Expired(Exception):
    """An operation's deadline passed (not an OSError, as TimeoutError is: a socket's
    errors mean a peer is gone)."""


class _Wait:
    """One operation's deadline and what it waits on, armed only when it must wait:
    a timer for the deadline, and the watchdog's status (``on_wait``) while blocked."""

    __slots__ = ("deadline", "on_wait", "status", "waited")

    def __init__(self, deadline: float | None, status: str = "",
                 on_wait: Callable[[str], None] = no_status) -> None:  # fmt: skip
        self.deadline = deadline  # the event loop's clock; None: no bound (the caller's)
        self.status = status
        self.on_wait = on_wait
        self.waited = False

    async def until(self, sock: socket.socket, writable: bool = False) -> None:
        """Wait until ``sock`` is readable (writable); :class:`_Expired` past the deadline."""
        if not self.waited:
            self.waited = True
            self.on_wait(self.status)
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        fd = sock.fileno()
        (loop.add_writer if writable else loop.add_reader)(fd, _settle, ready, None)
        timer = None
        if self.deadline is not None:
            timer = loop.call_at(self.deadline, _settle, ready, _Expired())
        try:
            await ready
        finally:
            (loop.remove_writer if writable else loop.remove_reader)(fd)
            if timer is not None:
                timer.cancel()

    def done(self) -> None:
        if self.waited:
            self.on_wait("running")


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if not future.done():
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)


class _Peer:
    """One connected socket: frames out, frames in (each header checked first).

    Frames go straight to the raw socket; reads go into this peer's buffer, whose unread
    bytes ``[lo, hi)`` are the start of the next frame."""

    def __init__(self, stream: anyio.abc.SocketStream, who: str) -> None:
        self.stream = stream
        self.sock: socket.socket = stream.extra(anyio.abc.SocketAttribute.raw_socket)
        self.who = who
        self._buf = bytearray(READ_AHEAD)
        self._lo = self._hi = 0

    async def send(self, op: int, payload: bytes | memoryview, wait: _Wait) -> None:
        view = memoryview(frame(op, payload))
        try:
            while view:
                try:
                    view = view[self.sock.send(view) :]
                except BlockingIOError:
                    await wait.until(self.sock, writable=True)
        except OSError as error:
            raise PlaneError(f"{self.who} is gone ({OPS[op]}): {error!r}") from None

    async def _fill(self, n: int, wait: _Wait) -> None:
        """Until ``n`` unread bytes are buffered. The buffer holds ``max(n, READ_AHEAD)``
        bytes: what a header allowed, or a little read ahead."""
        while self._hi - self._lo < n:
            if len(self._buf) - self._lo < n:  # no room after the unread bytes: move, grow
                kept = bytes(memoryview(self._buf)[self._lo : self._hi])
                if len(self._buf) < n:
                    self._buf = bytearray(n)
                self._buf[: len(kept)] = kept
                self._lo, self._hi = 0, len(kept)
            try:
                got = self.sock.recv_into(memoryview(self._buf)[self._hi :])
            except BlockingIOError:
                await wait.until(self.sock)
                continue
            if got == 0:
                raise anyio.IncompleteRead
            self._hi += got

    async def receive(self, op: int, wait: _Wait, exact: int | None = None) -> bytes:
        """The next frame's payload; it must be ``op``, and ``exact`` bytes if given."""
        try:
            await self._fill(FRAME.size, wait)
            n = check_frame(bytes(memoryview(self._buf)[self._lo : self._lo + FRAME.size]),
                            op, exact, self.who)  # fmt: skip
            await self._fill(FRAME.size + n, wait)
            start = self._lo + FRAME.size
            payload = bytes(memoryview(self._buf)[start : start + n])
        except (anyio.IncompleteRead, OSError) as error:
            raise PlaneError(f"{self.who} is gone ({OPS[op]}): {error!r}") from None
        self._lo = start + n
        if self._lo == self._hi:  # all read: start from the front again
            self._lo = self._hi = 0
            if len(self._buf) > READ_AHEAD:  # a big frame came: give its room back
                self._buf = bytearray(READ_AHEAD)
        return payload

    async def close(self) -> None:
        await self.stream.aclose()


class SocketRoundsPlane:
    """The rounds plane's operations over Unix sockets, a star around rank 0.

    Build it with :meth:`connect` (every rank at once). Every rank calls the same
    operations in the same order, as with collectives; each one is bounded by
    ``timeout_s`` and fails with :class:`PlaneError`, never hangs.
    """

    kind = "local"

    def __init__(
        self, rank: int, world_size: int, peers: dict[int, _Peer], timeout_s: float,
        on_wait: Callable[[str], None] = no_status, trace: RoundTrace | None = None,
    ) -> None:  # fmt: skip
        self.rank = rank
        self.world_size = world_size
        self.peers = peers  # rank 0: every other rank; elsewhere: {0: rank 0}
        self.timeout_s = timeout_s
        self.on_wait = on_wait  # the watchdog's status, while an operation blocks
        self.trace = trace or NO_TRACE  # where a round's steps are timed (wavepp.rounds.trace)
        self.lock = anyio.Lock(fast_acquire=True)  # no yield when free: rounds are on the clock

    @staticmethod
    def listen_path() -> str:
        """A fresh socket path in a directory only this user may enter (rank 0)."""
        return os.path.join(tempfile.mkdtemp(prefix="wavepp-rounds-"), "rounds.sock")

    @classmethod
    async def connect(
        cls, rank: int, world_size: int, path: str, timeout_s: float,
        listener: anyio.abc.SocketListener | None = None,
        on_wait: Callable[[str], None] = no_status, trace: RoundTrace | None = None,
    ) -> SocketRoundsPlane:  # fmt: skip
        """Rank 0 accepts every other rank on ``listener`` (bound to ``path``); the
        others connect to ``path`` and say which rank they are. The socket file and its
        directory are removed once everyone is in (or the attempt failed)."""
        unbounded = _Wait(None)  # fail_after below bounds the whole connection
        try:
            with anyio.fail_after(timeout_s):
                if rank != 0:
                    stream = await anyio.connect_unix(path)
                    peer = _Peer(stream, "rank 0")
                    await peer.send(HELLO, ints([rank]), unbounded)
                    return cls(rank, world_size, {0: peer}, timeout_s, on_wait, trace)
                assert listener is not None
                peers: dict[int, _Peer] = {}
                try:
                    while len(peers) < world_size - 1:
                        peer = _Peer(await listener.accept(), "a connecting rank")
                        raw = await peer.receive(HELLO, unbounded, exact=8)
                        (who,) = unints(raw)
                        if not 0 < who < world_size or who in peers:
                            await peer.close()
                            raise PlaneError(f"a peer said it is rank {who}; expected one "
                                             f"of 1..{world_size - 1}, once each")  # fmt: skip
                        peer.who = f"rank {who}"
                        peers[who] = peer
                finally:
                    await listener.aclose()
                return cls(rank, world_size, peers, timeout_s, on_wait, trace)
        except TimeoutError:
            raise PlaneError(f"rounds plane: not every rank connected within {timeout_s:g} s "
                             f"(rank {rank})") from None  # fmt: skip
        finally:
            if rank == 0:
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)

    def _wait(self, what: str) -> _Wait:
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        return _Wait(deadline, f"waiting on the rounds plane ({what}, all ranks)", self.on_wait)

    async def _bounded(self, what: str, wait: _Wait, work):
        try:
            return await work
        except _Expired:
            raise PlaneError(f"rounds plane {what}: no answer within {self.timeout_s:g} s"
                             ) from None  # fmt: skip
        finally:
            wait.done()

    async def broadcast(self, payload: bytes | None) -> bytes:
        what = "broadcast from rank 0"
        wait = self._wait(what)
        return await self._bounded(what, wait, self._broadcast(payload, wait))

    async def _broadcast(self, payload: bytes | None, wait: _Wait) -> bytes:
        trace = self.trace
        if self.rank != 0:
            got = await self.peers[0].receive(BROADCAST, wait)
            trace.opened()
            trace.mark("bcast_recv")
            return got
        assert payload is not None
        if len(payload) > MAX_FRAME_BYTES:  # the peers would refuse it: say so here
            raise PlaneError(f"a broadcast of {len(payload):,} bytes; at most "
                             f"{MAX_FRAME_BYTES:,} are accepted")  # fmt: skip
        trace.opened()
        for peer in self.peers.values():
            await peer.send(BROADCAST, payload, wait)
        trace.mark("bcast_sent")
        return payload

    async def all_reduce(
        self, mins: Sequence[int], ands: Sequence[int] = ()
    ) -> tuple[list[int], list[int]]:
        """Element-wise MIN of ``mins`` and bitwise AND of ``ands`` over ranks (int64),
        in one frame each way."""
        if not mins and not ands:
            return [], []
        wait = self._wait(OPS[REDUCE])
        out = await self._bounded(OPS[REDUCE], wait, self._reduce(len(mins), [*mins, *ands], wait))
        return out[: len(mins)], out[len(mins) :]

    async def _reduce(self, split: int, values: list[int], wait: _Wait) -> list[int]:
        """``values[:split]`` MIN-ed, the rest AND-ed; the frame leads with ``split``."""
        trace, size = self.trace, 8 * (len(values) + 1)
        if self.rank != 0:
            await self.peers[0].send(REDUCE, ints([split, *values]), wait)
            trace.mark("sent")
            got = await self.peers[0].receive(REDUCE, wait, exact=size)
            trace.mark("reduced_recv")
            return unints(got)[1:]
        acc = np.array([split, *values], dtype=_INT64)
        for peer in self.peers.values():
            theirs = np.frombuffer(await peer.receive(REDUCE, wait, size), dtype=_INT64)
            trace.mark("peer_in")
            if theirs[0] != split:
                raise PlaneError(f"{peer.who} reduced {theirs[0]} values by MIN in a frame "
                                 f"where this rank reduces {split}")  # fmt: skip
            np.minimum(acc[1 : split + 1], theirs[1 : split + 1], out=acc[1 : split + 1])
            np.bitwise_and(acc[split + 1 :], theirs[split + 1 :], out=acc[split + 1 :])
        raw = acc.tobytes()
        for peer in self.peers.values():
            await peer.send(REDUCE, raw, wait)
        trace.mark("reduced")
        return acc[1:].tolist()

    async def all_min(self, values: Sequence[int]) -> list[int]:
        return (await self.all_reduce(values))[0]

    async def all_and(self, values: Sequence[int]) -> list[int]:
        return (await self.all_reduce((), values))[1]

    async def gather(self, payload: bytes) -> list[bytes] | None:
        what = "gather of stage reports"
        wait = self._wait(what)
        return await self._bounded(what, wait, self._gather(payload, wait))

    async def _gather(self, payload: bytes, wait: _Wait) -> list[bytes] | None:
        self.trace.write()  # the run's last operation on this plane
        if self.rank != 0:
            await self.peers[0].send(GATHER, payload, wait)
            return None
        got = {0: payload}
        for who, peer in self.peers.items():
            got[who] = await peer.receive(GATHER, wait)
        return [got[r] for r in range(self.world_size)]

    async def aclose(self) -> None:
        for peer in self.peers.values():
            await peer.close()
