"""Sockets for handoffs, both sides: every write-all and read-exactly loop of the package.

Async (an event loop's non-blocking socket, :class:`Connection`): exact reads straight
into caller memory and scatter-gather writes, each wait for the peer bounded by
``timeout_s`` without a byte (reads: up to 1.25 x), so a peer that stops half way costs
that timeout, no more. Blocking (a worker thread's socket, whose deadline the caller
keeps by the socket's timeout or by shutting it): :func:`sendmsg_all` and
:func:`recv_exactly`. Reads and writes go to the raw socket (no intermediate buffer), so
a band's payload lands directly in the tensors allocated for it and leaves straight from
the pool. Errors: ``TimeoutError`` (no progress in time), ``ConnectionError`` (closed
early), any other ``OSError`` as the socket raises it.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import socket
import stat
import struct
import time
from collections.abc import Callable

import anyio

from wavepp.handoff.wire import Address

DRAIN_CHUNK = 1 << 20
UNIX_RETRY_S = 0.002  # a connect to a Unix listener whose backlog is full, tried again
IOV_MAX = 1024  # buffers per sendmsg call (Linux)


class DeadlineError(TimeoutError):
    """A read that the connection's deadline (:meth:`Connection.set_deadline`) ended,
    however steadily bytes came: the message says whose deadline."""


class Connection:
    """A connected non-blocking socket with bounded, exact reads. (Raw sockets, not
    anyio streams: anyio's TCP stream reads through an asyncio transport, which would
    race reads made straight into the socket.)

    Besides ``timeout_s`` without a byte, reads (and drains) may have a deadline for
    everything read until it is lifted (:meth:`set_deadline`): a peer that trickles a
    byte every few seconds would otherwise hold the connection for ever."""

    def __init__(self, sock: socket.socket, timeout_s: float,
                 on_admitted: Callable[[], None] | None = None) -> None:  # fmt: skip
        """``on_admitted``: a server's, run once when the peer is admitted."""
        sock.setblocking(False)
        self.sock = sock
        self.timeout_s = timeout_s
        self.deadline = math.inf  # anyio's clock: reads end with DeadlineError then
        self.deadline_why = ""
        self.on_admitted = on_admitted

    def admitted(self) -> None:
        """The peer's frame has passed its checks (a server's handler says so): the
        deadline for it is lifted and the server's ``on_admitted`` runs, once."""
        self.set_deadline(None)
        hook, self.on_admitted = self.on_admitted, None
        if hook is not None:
            hook()

    def set_deadline(self, seconds: float | None, why: str = "") -> None:
        """Every read from now must be done within ``seconds`` (None: no deadline);
        ``why`` is the DeadlineError's message."""
        self.deadline = math.inf if seconds is None else anyio.current_time() + seconds
        self.deadline_why = why

    def _check_deadline(self) -> None:
        if anyio.current_time() >= self.deadline:
            raise DeadlineError(self.deadline_why or "the connection's deadline passed")

    async def read_into(self, view: memoryview) -> None:
        """Fill ``view``; ``TimeoutError`` once ``timeout_s`` (to 1.25 x ``timeout_s``)
        passed without a byte.

        One deadline for the whole read, pushed on when bytes came and a quarter of
        ``timeout_s`` has passed since it was last pushed: a 64 MiB band waits for the
        socket hundreds of times, and a timer per wait (``fail_after``) cost the event
        loop more than the copy (a band read at 0.6 of a plain socket copy's speed).
        Bytes already there are taken first, without a scope or a wait: a band's prefix
        and header usually are."""
        got = 0
        with contextlib.suppress(BlockingIOError):
            got = self.sock.recv_into(view)
            if got == len(view):
                return
            if got == 0 and len(view):
                raise ConnectionError(f"peer closed after 0 of {len(view)} bytes")
        slack = self.timeout_s / 4
        with anyio.CancelScope() as scope:
            pushed = time.monotonic()
            scope.deadline = min(anyio.current_time() + self.timeout_s + slack, self.deadline)
            while got < len(view):
                try:
                    n = self.sock.recv_into(view[got:])
                except BlockingIOError:
                    await anyio.wait_readable(self.sock)
                    continue
                if n == 0:
                    raise ConnectionError(f"peer closed after {got} of {len(view)} bytes")
                got += n
                now = time.monotonic()  # not anyio's clock: that looks up the event loop
                if now - pushed > slack:
                    pushed = now
                    scope.deadline = min(anyio.current_time() + self.timeout_s + slack,
                                         self.deadline)  # fmt: skip
        if got < len(view):
            self._check_deadline()
            raise TimeoutError(f"no byte for {self.timeout_s:g} s ({got} of {len(view)} read)")

    async def read_exactly(self, n: int) -> bytes:
        """The next ``n`` bytes (the caller bounds ``n`` before asking)."""
        buf = bytearray(n)
        await self.read_into(memoryview(buf))
        return bytes(buf)

    async def send(self, data: bytes | memoryview) -> None:
        await self.sendmsg([data])

    async def sendmsg(self, views: list[memoryview]) -> None:
        """Every byte of ``views``, in order: as many as the send buffer takes per
        ``sendmsg`` (``IOV_MAX`` buffers a call); a wait for room is bounded by
        ``timeout_s``."""
        queue = _queue(views)
        first = 0
        while first < len(queue):
            try:
                sent = self.sock.sendmsg(queue[first : first + IOV_MAX])
            except BlockingIOError:
                with anyio.fail_after(self.timeout_s):
                    await anyio.wait_writable(self.sock)
                continue
            first = _step(queue, first, sent)

    async def drain(self, n: int) -> None:
        """Read and drop up to ``n`` bytes (a refused band's payload), so that closing
        does not reset a sender still writing; stops early if the peer closes."""
        buf = memoryview(bytearray(min(n, DRAIN_CHUNK)))
        left = n
        while left > 0:
            try:
                got = self.sock.recv_into(buf[: min(left, len(buf))])
            except BlockingIOError:
                got = -1
            if got < 0:
                wait = min(self.timeout_s, self.deadline - anyio.current_time())
                with anyio.move_on_after(max(wait, 0.0)) as scope:
                    await anyio.wait_readable(self.sock)
                if scope.cancelled_caught:
                    self._check_deadline()
                    raise TimeoutError(f"no byte for {self.timeout_s:g} s while draining")
                continue
            if got == 0:
                return
            left -= got

    def shutdown_write(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        close_socket(self.sock)


def sendmsg_all(sock: socket.socket, views: list[memoryview]) -> None:
    """Every byte of ``views`` through a blocking socket, in as few ``sendmsg`` calls as
    the iovec limit allows: the calling thread wakes (and takes the GIL) once per call,
    not once per socket buffer's worth."""
    queue = _queue(views)
    first = 0  # an index, not pops from the front: a 32K-token band has 16K buffers
    while first < len(queue):
        first = _step(queue, first, sock.sendmsg(queue[first : first + IOV_MAX]))


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    """The next ``n`` bytes from a blocking socket; ``ConnectionError`` if the peer closes
    first."""
    data = bytearray(n)
    view, got = memoryview(data), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError(f"peer closed after {got} of {n} bytes")
        got += k
    return bytes(data)


def _queue(views: list) -> list[memoryview]:
    """Flat byte views of ``views`` (buffers of any kind), the empty ones left out."""
    return [m for v in views if (m := memoryview(v).cast("B")).nbytes]


def _step(queue: list[memoryview], first: int, sent: int) -> int:
    """Step over ``sent`` bytes of ``queue[first:]``; a partly sent buffer keeps its
    tail. Returns the new first index."""
    while sent:
        if sent >= queue[first].nbytes:
            sent -= queue[first].nbytes
            first += 1
        else:
            queue[first] = queue[first][sent:]
            sent = 0
    return first


def close_socket(sock: socket.socket) -> None:
    """Close a socket other tasks may be waiting on (they see ClosedResourceError)."""
    if sock.fileno() >= 0:
        anyio.notify_closing(sock)
        sock.close()


async def connect(address: Address, timeout_s: float) -> Connection:
    """Connect to a ``unix`` or ``tcp`` address within ``timeout_s``."""
    if address.kind not in ("unix", "tcp"):
        raise ValueError(f"{address} is not a socket address (unix: or tcp://)")
    with anyio.fail_after(timeout_s):
        if address.kind == "unix":
            family, target = socket.AF_UNIX, address.path
        else:
            # the family ``listen`` binds for the same host (a name: IPv4), not whichever
            # the resolver lists first (often ::1 for localhost)
            family = socket.AF_INET6 if ":" in address.host else socket.AF_INET
            infos = await anyio.getaddrinfo(address.host, address.port, family=family,
                                            type=socket.SOCK_STREAM)  # fmt: skip
            if not infos:
                raise ConnectionError(f"{address}: the host does not resolve")
            family, _, _, _, target = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            # A Unix socket connects at once or, its listener's backlog full, not at all
            # (EAGAIN): tried again shortly. TCP connects in the background.
            while (code := sock.connect_ex(target)) == errno.EAGAIN and family == socket.AF_UNIX:
                await anyio.sleep(UNIX_RETRY_S)
            if code == errno.EINPROGRESS:  # connected (or refused) once writable
                await anyio.wait_writable(sock)
                error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if error:
                    raise ConnectionError(f"{address}: {os.strerror(error)}")
            elif code != 0:
                sock.connect(target)  # raises the real error
        except BaseException:
            close_socket(sock)
            raise
    return Connection(sock, timeout_s)


def listen(address: Address, backlog: int = 128) -> tuple[socket.socket, Address]:
    """A listening non-blocking socket at ``address`` and the address it got (a tcp
    port 0 becomes the port the kernel chose). A stale Unix socket file is replaced;
    any other file at that path is an error."""
    if address.kind == "unix":
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISSOCK(os.lstat(address.path).st_mode):
                raise FileExistsError(f"{address.path} exists and is not a socket")
            os.unlink(address.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        target: object = address.path
        bound = address
    elif address.kind == "tcp":
        family = socket.AF_INET6 if ":" in address.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        target = (address.host, address.port)
    else:
        raise ValueError(f"{address} is not a socket address (unix: or tcp://)")
    try:
        sock.bind(target)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    if address.kind == "tcp":
        bound = Address("tcp", host=address.host, port=sock.getsockname()[1])
    return sock, bound


def peer_of(sock: socket.socket) -> str:
    """Who is at the other end, as per-peer limits count it: a TCP peer's host (IPv4
    mapped into IPv6 as IPv4), a Unix socket peer's user id (``SO_PEERCRED``; ``unix``
    where the kernel does not say)."""
    try:
        if sock.family == socket.AF_UNIX:
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            return f"unix uid {struct.unpack('3i', creds)[1]}"
        host = str(sock.getpeername()[0])
    except (OSError, AttributeError, struct.error):
        return "unix" if sock.family == socket.AF_UNIX else "unknown"
    return host.removeprefix("::ffff:") if "." in host else host


async def accept(listener: socket.socket) -> socket.socket:
    while True:
        try:
            sock, _ = listener.accept()
            return sock
        except BlockingIOError:
            await anyio.wait_readable(listener)
