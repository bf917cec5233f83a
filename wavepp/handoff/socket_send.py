"""A band over a socket: WavePP's wire (``wavepp.handoff.wire``) to a ``unix:`` or
``tcp://`` receiver, one connection per band (``docs/handoff.md``); and the same
exchange over a connection a decoder opened to pull the band (:meth:`SocketTransport.send`
with its socket, ``wavepp.handoff.pull``).

On a CPU stage the pool's rows go out without a copy (scatter-gather ``sendmsg`` of
runs of rows); a tensor without such buffers (a GPU stage's rows, a recurrent state) is
copied to host memory, sent and dropped before the next is read: one tensor (one layer's
keys, values, latents or state) at a time. A CPU stage's small bands (``inline_bytes``)
go out from the event loop: for them the thread hops cost more than the bytes. Every
other band's I/O runs in one of the sender's worker threads with blocking calls; a cancel
or the deadline shuts its socket, which ends them, and the band settles only once the
thread no longer reads the band's tensors.
"""

from __future__ import annotations

import contextlib
import math
import socket
import threading
import time
from collections.abc import Sequence

import anyio

from wavepp.handoff import _io, wire
from wavepp.handoff.base import Band, BandFailed, BandTensor, HandoffSettings, WorkerThreads

INLINE_BYTES = 1 << 20  # a CPU stage's bands up to this size skip the worker thread
# ...if each tensor not in the pool is at most this: copies of at most torch's grain size
# (32,768 elements of 2 bytes or more), which start no OpenMP team on the loop's thread
# (wavepp.exec.compute)
INLINE_COPY_BYTES = 64 << 10
FINISH_POLL_S = 0.005  # a given-up band's wait for its thread to stop reading the pool
SOCKET_BUFFER = 4 << 20  # bytes asked for the band's send buffer
REFUSAL_WAIT_S = 1.0  # a send cut short: how long the receiver's refusal is waited for


class SocketTransport:
    """Bands to ``unix:`` and ``tcp://`` receivers (``wavepp.handoff.base.Transport``)."""

    kinds = ("unix", "tcp")
    parks = False
    address = None

    def __init__(self, settings: HandoffSettings, threads: WorkerThreads) -> None:
        self.settings, self._threads = settings, threads

    async def run(self) -> None:
        """Nothing to serve: the transport connects to its receivers."""

    def figures(self) -> dict[str, float]:
        return {}

    async def deliver(self, band: Band) -> int:
        return await self.send(band)

    async def send(self, band: Band, sock: socket.socket | None = None) -> int:
        """The band's exchange with its receiver: over a new connection to the band's
        address, or over ``sock`` (connected by the receiver: a pull; the call owns it
        from then on and closes it). The payload bytes acknowledged, or BandFailed."""
        prefix = wire.encode_band_prefix(band.header(self.settings))
        if self.inline(band.tensors):
            ack = await self._on_loop(band, prefix, sock)
        else:
            ack = await self._in_thread(band, prefix, sock)
        return band.check_ack(ack, self.settings.stage)

    def inline(self, tensors: Sequence[BandTensor]) -> bool:
        """A small band whose bytes are views of the pool (or small copies, such as
        recurrent states): out from the event loop, which spares the thread hops —
        most of a small band's cost. Nothing reads the pool once a send has returned."""
        size = sum(t.num_bytes for t in tensors)
        return size <= self.settings.inline_bytes and all(
            t.pieces is not None or (t.num_bytes <= INLINE_COPY_BYTES and not t.waits)
            for t in tensors)  # fmt: skip

    async def _on_loop(self, band: Band, prefix: bytes, sock: socket.socket | None) -> wire.Ack:
        """A small band's exchange on the event loop (a non-blocking socket): connect
        (unless ``sock`` is connected), the band's buffers, the acknowledgement. The
        sender's scope bounds every wait."""
        target = band.peer
        started = time.perf_counter()
        try:
            try:
                conn = (_io.Connection(sock, math.inf) if sock is not None
                        else await _io.connect(band.address, math.inf))  # fmt: skip
            except OSError as error:
                raise BandFailed("connect", f"cannot connect to {target}: {error}") from None
            try:
                # the whole band in the send buffer at once, where the kernel allows: one
                # sendmsg, not one wakeup of this loop (and of the receiver) per default
                # buffer's worth
                with contextlib.suppress(OSError):
                    conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
                views = [memoryview(prefix)]
                for tensor in band.tensors:
                    views.extend(tensor.views())
                with _failures(target):
                    return await exchange(conn, views)
            finally:
                conn.close()
        finally:
            band.wire_s = time.perf_counter() - started

    async def _in_thread(self, band: Band, prefix: bytes, sock: socket.socket | None) -> wire.Ack:
        """The band's exchange from a worker thread (connecting first unless ``sock`` is
        connected)."""
        address = band.address
        connect = sock is None
        if sock is None:
            sock = socket.socket(socket.AF_UNIX if address.kind == "unix" else socket.AF_INET6
                                 if ":" in address.host else socket.AF_INET)  # fmt: skip
        claim, finished = threading.Lock(), threading.Event()
        try:
            # One worker thread does the band's whole I/O with blocking calls: scatter-
            # gather sends straight from the pool's blocks, no copy in between. A cancel
            # or the timeout shuts the socket, which ends the thread's blocking calls.
            return await self._threads.run(_send_band, sock, band, prefix, claim, finished,
                                           connect, abandon_on_cancel=True)  # fmt: skip
        finally:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            if claim.acquire(blocking=False):
                # given up before the thread began (waiting for a thread, or queued): it
                # never will touch the band; the socket is ours to close
                sock.close()
            else:
                # the thread began: the blocks stay held until it has stopped reading
                # them (the shut socket ends it at once; a connect still waiting ends by
                # the band's deadline). Polled: a wait in a thread would need a token
                # from the limiter whose every thread may be this stuck.
                with anyio.CancelScope(shield=True):
                    while not finished.is_set():
                        await anyio.sleep(FINISH_POLL_S)



def _send_band(sock: socket.socket, band: Band, prefix: bytes, claim: threading.Lock,
               finished: threading.Event, connect: bool) -> wire.Ack | None:  # fmt: skip
    """In a worker thread (where a TP band's shards are put together). Takes ``claim``
    first: if the event loop took it (the band was given up before this thread began),
    returns None at once, touching nothing. Otherwise owns ``sock``; sets
    ``band.wire_s`` to its seconds from connect to the ack (or to its failure) and
    ``finished`` when it no longer touches the band's tensors."""
    if not claim.acquire(blocking=False):
        return None
    started = time.perf_counter()
    try:
        return _exchange(sock, band, prefix, connect)
    finally:
        band.wire_s = time.perf_counter() - started
        finished.set()


async def exchange(conn: _io.Connection, views: list) -> wire.Ack:
    """A band's bytes (``views``: prefix, header, payload) on a connected socket, then the
    receiver's ack. A receiver that refuses a band may answer and close before reading it
    all: a send cut short returns that refusal when one comes within
    ``REFUSAL_WAIT_S``, and raises otherwise. ``WireError`` for an ack that is not one."""
    try:
        await conn.sendmsg(views)
    except OSError:
        ack = None
        with contextlib.suppress(OSError, wire.WireError, TimeoutError):
            with anyio.fail_after(REFUSAL_WAIT_S):
                ack = await read_ack(conn)
        if ack is not None and not ack.ok:
            return ack
        raise
    return await read_ack(conn)


async def read_ack(conn: _io.Connection) -> wire.Ack:
    length = wire.ack_length(await conn.read_exactly(wire.ACK_PREFIX_BYTES))
    return wire.decode_ack(await conn.read_exactly(length))


def _read_ack(sock: socket.socket, target: str) -> wire.Ack:
    """:func:`read_ack` on a blocking socket, its errors as a band's failures."""
    with _failures(target):
        length = wire.ack_length(_io.recv_exactly(sock, wire.ACK_PREFIX_BYTES))
        return wire.decode_ack(_io.recv_exactly(sock, length))


@contextlib.contextmanager
def _failures(target: str):
    """Errors of a band's exchange as the reasons a band fails for."""
    try:
        yield
    except wire.WireError as error:
        raise BandFailed("bad ack", f"{target} answered garbage: {error}") from None
    except TimeoutError:
        raise
    except OSError as error:
        raise BandFailed("disconnected", f"{target} closed the connection before "
                         f"acknowledging ({str(error) or type(error).__name__})") from None


def _exchange(sock: socket.socket, band: Band, prefix: bytes, connect: bool) -> wire.Ack:
    """A band's whole exchange with blocking calls: connect (``connect``), the prefix
    and header, every tensor's bytes, the ack."""
    address, target, deadline = band.address, band.peer, band.deadline

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        return remaining

    with sock:
        with contextlib.suppress(OSError):  # fewer, larger transfers (capped by the kernel)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        where = address.path if address.kind == "unix" else (address.host, address.port)
        while connect:
            try:
                sock.settimeout(left())
                sock.connect(where)
                break
            except BlockingIOError:
                # a Unix listener whose backlog is full refuses at once: tried again
                # shortly (polled: a shut socket would not wake a blocking connect)
                if address.kind != "unix":
                    raise BandFailed("connect", f"cannot connect to {target}") from None
                time.sleep(_io.UNIX_RETRY_S)
            except OSError as error:
                if isinstance(error, TimeoutError):
                    raise
                raise BandFailed("connect", f"cannot connect to {target}: {error}") from None
        # Buffers go out in as few sendmsg calls as the iovec limit allows, blocking, no
        # timeout: this thread wakes (and takes the GIL) once per call, not every socket
        # buffer's worth — a band of pool runs, from the prefix to its last tensor, in
        # one call per IOV_MAX runs (a copied tensor among them ends a call). The
        # timeout and a cancel still end it: the event loop shuts the socket.
        sock.settimeout(None)
        try:
            views = [memoryview(prefix)]
            for tensor in band.tensors:
                if tensor.pieces is None:
                    # a copy in host memory: out before the next tensor is read, so one
                    # tensor's bytes at a time
                    _io.sendmsg_all(sock, views)
                    views = []
                for view in tensor.views():
                    views.append(view)
                    if len(views) == _io.IOV_MAX:
                        _io.sendmsg_all(sock, views)
                        views = []
            _io.sendmsg_all(sock, views)
            del views
        except TimeoutError:
            raise
        except OSError as error:
            # A receiver that refuses a band may answer and close before reading it all:
            # its answer says why.
            ack = None
            with contextlib.suppress(OSError, BandFailed, TimeoutError):
                sock.settimeout(min(REFUSAL_WAIT_S, left()))
                ack = _read_ack(sock, target)
            if ack is not None and not ack.ok:
                raise BandFailed("refused", ack.error) from None
            raise BandFailed("disconnected", f"{target} closed the connection while the band "
                             f"was sent ({str(error) or type(error).__name__})") from None
        sock.settimeout(left())
        return _read_ack(sock, target)
