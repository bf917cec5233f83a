"""The receiving side: a server that takes a request's P bands, checks each against the
model it decodes with, and assembles them into a :class:`~wavepp.handoff.assembly.Handoff`.

One connection carries one band (``wavepp.handoff.wire``). For each, in order: the
prefix and the header are read and checked (``gate``: bounds, internal consistency, the
model's fingerprint field by field, each layer's tensors by name, dtype and shape, the
byte limit), the band is claimed in its request (``assembly``: duplicates, coverage, the
bytes held); only then is the band's buffer allocated — one per band, its tensors views
into it, memory of released bands reused (:class:`BandBuffers`) — and the payload read
straight into it. The receiver answers every band with one ack — ok, or the reason —
and closes. A refused band's payload is drained (up to ``max_band_bytes``; an unsigned or
wrongly signed band's only up to ``LINGER_BYTES``) so the sender reads its ack instead
of a reset. A peer that stops half way or sends garbage costs that band only: each read
waits at most ``read_timeout_s``.

One peer cannot shut the receiver to the others (``docs/handoff.md``, limits): the
first 4 bytes, the prefix and the header must all be in within ``header_timeout_s`` of
the connection (a decode request's frame too: the deadline is still set when a handler
gets the connection, until it calls ``conn.admitted()``), and a payload must be in before
its request expires and at ``MIN_PAYLOAD_BYTES_PER_S`` at least; a peer (a TCP peer's
host, a Unix socket peer's user id) holds at most ``max_peer_connections`` connections,
``max_peer_requests`` incomplete requests and ``max_peer_held_bytes`` of bands. Given the
shared ``secret`` (``wavepp.handoff.auth``) every band must be signed with it, which is
checked before anything of its payload is read. A trusted peer — one on a Unix socket
(the same user), or any peer once the secret has admitted its frame — is held to the
per-peer shares only until its frame is admitted; after that only the receiver's whole
limits apply to it.

A complete request goes to ``on_complete`` when one is given, else it waits for
``await receiver.wait(request_id, timeout_s)``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import socket
import sys
import time
import weakref
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Mapping

import anyio
import numpy as np
import torch

from wavepp.handoff import _io
from wavepp.handoff.assembly import Assembly, Handoff
from wavepp.handoff.auth import AuthError, Verifier
from wavepp.handoff.gate import Arrival, Gate
from wavepp.handoff.wire import (
    BAND_MAGIC,
    Ack,
    Address,
    BandHeader,
    WireError,
    band_bytes,
    encode_ack,
    fingerprint_from_hf_config,
    parse_address,
    payload_layout,
    request_key,
)

log = logging.getLogger("wavepp.handoff")

LINGER_BYTES = 1 << 21  # drained after refusing a connection whose length is unknown
HEADER_TIMEOUT_S = 10.0  # the first bytes, prefix and header, from the connection
INCOMPLETE_TIMEOUT_S = 60.0  # a request's bands, from its first
MIN_PAYLOAD_BYTES_PER_S = 1 << 20  # a payload slower than this (after HEADER_TIMEOUT_S) is cut

Handler = Callable[[_io.Connection], Awaitable[None]]
OnComplete = Callable[[Handoff], Awaitable[None] | None]


class Receiver:
    """Receives bands for one model (its Hugging Face ``config.json`` dict and the
    attention tensors' ``dtype``). ``handlers`` maps other 4-byte magics to coroutines
    that serve such connections on the same address (the decode worker's requests).
    Up to ``keep_free_bytes`` of released band buffers are kept for reuse. Bytes held
    (incomplete and uncollected requests) stay under ``max_held_bytes``; a request not
    complete within ``incomplete_timeout_s`` (at most ``request_timeout_s``) of its first
    band, or not taken within
    ``request_timeout_s`` of its last, is dropped. Per peer (left out: a quarter of the
    whole, at least one band's worth of bytes): ``max_peer_connections``,
    ``max_peer_requests`` (incomplete), ``max_peer_held_bytes``. ``secret``: bands must
    be signed with it (``wavepp.handoff.auth``)."""

    def __init__(
        self,
        config: dict,
        dtype: str,
        *,
        max_band_bytes: int = 4 << 30,
        max_held_bytes: int | None = None,
        read_timeout_s: float = 30.0,
        request_timeout_s: float = 300.0,
        max_requests: int = 4096,
        max_connections: int = 256,
        keep_free_bytes: int = 256 << 20,
        on_complete: OnComplete | None = None,
        handlers: Mapping[bytes, Handler] | None = None,
        header_timeout_s: float = HEADER_TIMEOUT_S,
        incomplete_timeout_s: float = INCOMPLETE_TIMEOUT_S,
        max_peer_connections: int | None = None,
        max_peer_requests: int | None = None,
        max_peer_held_bytes: int | None = None,
        secret: bytes | None = None,
    ) -> None:
        if sys.byteorder != "little":
            raise RuntimeError("the handoff payload is little-endian; this host is not")
        self.config, self.dtype = config, dtype
        self.fingerprint = fingerprint_from_hf_config(config, dtype)
        self.max_band_bytes = max_band_bytes
        self.read_timeout_s, self.request_timeout_s = read_timeout_s, request_timeout_s
        self.on_complete = on_complete
        self.handlers = dict(handlers or {})
        self.header_timeout_s = header_timeout_s
        self.counts: Counter[str] = Counter()  # bands_ok, bands_refused, bands_broken, ...
        held = 4 * max_band_bytes if max_held_bytes is None else max_held_bytes
        self.max_peer_connections = (max(1, max_connections // 4) if max_peer_connections
                                     is None else max_peer_connections)  # fmt: skip
        verifier = Verifier(secret) if secret else None
        self._gate = Gate(config, dtype, self.fingerprint, max_band_bytes, verifier)
        self._assembly = Assembly(
            self.fingerprint, max_requests=max_requests, request_timeout_s=request_timeout_s,
            max_held_bytes=held, counts=self.counts,
            incomplete_timeout_s=min(incomplete_timeout_s, request_timeout_s),
            max_peer_requests=(max(1, max_requests // 4) if max_peer_requests is None
                               else max_peer_requests),
            max_peer_held_bytes=(min(held, max(max_band_bytes, held // 4))
                                 if max_peer_held_bytes is None else max_peer_held_bytes),
        )  # fmt: skip
        self._buffers = BandBuffers(keep_free_bytes)
        self._slots = anyio.Semaphore(max_connections)
        self._peer_connections: Counter[str] = Counter()  # open and held to a share, by peer

    @property
    def incomplete_timeout_s(self) -> float:
        """How long a request's bands may take from its first (then it is dropped)."""
        return self._assembly.incomplete_timeout_s

    @property
    def held_bytes(self) -> int:
        """Payload bytes claimed: incomplete requests, and complete ones not taken."""
        return self._assembly.held_bytes

    # -- serving -----------------------------------------------------------------

    async def serve(self, address: str | Address, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        """Listen at ``address`` until cancelled; ``task_status.started`` gets the bound
        address (a tcp port 0 becomes the real port)."""
        where = parse_address(address) if isinstance(address, str) else address
        listener, bound = _io.listen(where)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._expire_loop)
                task_status.started(bound)
                while True:
                    await self._slots.acquire()
                    try:
                        sock = await _io.accept(listener)
                    except BaseException:
                        self._slots.release()
                        raise
                    peer = _io.peer_of(sock)
                    if self._peer_connections[peer] >= self.max_peer_connections:
                        self._slots.release()
                        self._turn_away(sock, peer)
                        continue
                    self._peer_connections[peer] += 1
                    tg.start_soon(self._connection, sock, peer)
        finally:
            _io.close_socket(listener)
            self._buffers.close()
            if bound.kind == "unix":
                _unlink_quietly(bound.path)

    def _turn_away(self, sock, peer: str) -> None:
        """A connection over its peer's share: one refusing ack if the socket takes it at
        once, and closed, without a task or a wait."""
        self.counts["connections_refused"] += 1
        why = (f"peer {peer} has {self._peer_connections[peer]} connections open; at most "
               f"{self.max_peer_connections} per peer")  # fmt: skip
        log.debug("connection refused: %s", why)
        with contextlib.suppress(OSError):
            sock.setblocking(False)
            sock.send(encode_ack(Ack("", -1, False, why)))
            sock.shutdown(socket.SHUT_WR)
        _io.close_socket(sock)

    def trusted(self, peer: str) -> bool:
        """Whether ``peer``'s admitted frames leave its per-peer shares: a Unix socket's
        peer (this machine's user), or any peer when the secret admitted its frame."""
        return peer.startswith("unix") or self._gate.verifier is not None

    def _unshare(self, peer: str) -> None:
        """A connection of ``peer``'s stops counting against its share."""
        self._peer_connections[peer] -= 1
        if not self._peer_connections[peer]:
            del self._peer_connections[peer]

    async def _connection(self, sock, peer: str = "") -> None:
        shared = {"held": True}  # this connection counts against its peer's share

        def admitted() -> None:
            if self.trusted(peer) and shared["held"]:
                shared["held"] = False
                self._unshare(peer)

        conn = _io.Connection(sock, self.read_timeout_s, admitted)
        conn.set_deadline(self.header_timeout_s, f"the prefix and header did not arrive "
                          f"within {self.header_timeout_s:g} s of the connection")  # fmt: skip
        try:
            try:
                magic = await conn.read_exactly(4)
            except (TimeoutError, OSError) as error:
                if isinstance(error, _io.DeadlineError):
                    self.counts["headers_late"] += 1
                return
            if magic == BAND_MAGIC:
                await self._band(conn, peer)
            elif magic in self.handlers:
                await self.handlers[magic](conn)
            else:
                self.counts["bands_refused"] += 1
                why = f"unknown magic {magic!r}; expected one of {[BAND_MAGIC, *self.handlers]}"
                await self._answer(conn, Ack("", -1, False, why))
                await _linger(conn, LINGER_BYTES)
        except Exception:  # a bug serving one connection must not stop the server
            log.exception("handoff connection failed")
        finally:
            conn.close()
            self._slots.release()
            if shared["held"]:
                self._unshare(peer)

    async def _answer(self, conn: _io.Connection, ack: Ack) -> None:
        try:
            await conn.send(encode_ack(ack))
        except (TimeoutError, OSError) as error:
            log.info("ack for %r stage %d not delivered: %r", ack.request_id, ack.stage, error)

    # -- one band ----------------------------------------------------------------

    async def _band(self, conn: _io.Connection, peer: str = "") -> None:
        arrival = Arrival()
        try:
            header = await self._gate.admit(conn, arrival)  # checked: nothing allocated
            entry = self._assembly.claim(header, peer, limited=not self.trusted(peer))
            conn.admitted()
            # past its request's expiry the band could not be stored: not read either; and
            # a payload may not crawl (a slot held at a byte every few seconds)
            size = band_bytes(header)
            crawl = self.header_timeout_s + size / MIN_PAYLOAD_BYTES_PER_S
            if crawl < self._assembly.expires_in(entry):
                conn.set_deadline(crawl, f"a band of {size:,} bytes came slower than "
                                  f"{MIN_PAYLOAD_BYTES_PER_S:,} bytes/s")  # fmt: skip
            else:
                why = f"request {header.request_id!r} expired while this band was read"
                conn.set_deadline(self._assembly.expires_in(entry), why)
            try:
                tensors = await self._read_payload(conn, header)
                self._gate.check_tokens(tensors)
                complete = self._assembly.store(entry, header, tensors)
            except BaseException:
                self._assembly.release(entry, header, peer)
                raise
        except WireError as error:
            self.counts["bands_refused"] += 1
            header = arrival.header
            rid, stage = (header.request_id, header.stage) if header else ("", -1)
            log.info("band refused (%r stage %d): %s", rid, stage, error)
            await self._answer(conn, Ack(rid, stage, False, str(error)))
            # a stranger's payload is not read: only enough for the ack to be seen
            conn.set_deadline(self.header_timeout_s, "lingered long enough")
            if header is None or isinstance(error, AuthError):
                await _linger(conn, LINGER_BYTES)
            elif band_bytes(header) <= self.max_band_bytes:
                await _linger(conn, band_bytes(header))
            return
        except (TimeoutError, OSError) as error:
            self.counts["bands_broken"] += 1
            header = arrival.header
            rid, stage = (header.request_id, header.stage) if header else ("", -1)
            if isinstance(error, _io.DeadlineError):
                self.counts["headers_late" if header is None else "bands_late"] += 1
                why = str(error)
            else:
                what = "stopped sending" if isinstance(error, TimeoutError) else "went away"
                why = f"the sender {what} mid-band"
            log.info("band (%r stage %d): %s: %r", rid, stage, why, error)
            await self._answer(conn, Ack(rid, stage, False, why))
            return
        self.counts["bands_ok"] += 1
        await self._answer(conn, Ack(header.request_id, header.stage, True))
        if complete is not None:
            await self._deliver(complete)

    async def _read_payload(self, conn: _io.Connection, header: BandHeader):
        """The band's tensors: views into one buffer (``payload_layout``), filled straight
        from the socket — one read per run of tensors that lie back to back in it (most
        bands: one read; a read costs the event loop more than a small tensor's copy)."""
        offsets, size = payload_layout(header)
        runs: list[list[int]] = []  # [start, end) of the buffer, read in order
        for spec, at in zip(header.tensors, offsets, strict=True):
            if spec.nbytes:
                if runs and runs[-1][1] == at:
                    runs[-1][1] += spec.nbytes
                else:
                    runs.append([at, at + spec.nbytes])
        buffer = self._buffers.take(size)  # checked: within the budget
        tensors = views(buffer, header, offsets)
        whole = memoryview(buffer.numpy())
        for start, end in runs:
            await conn.read_into(whole[start:end])
        del whole
        return tensors

    async def _deliver(self, handoff: Handoff) -> None:
        self.counts["requests_complete"] += 1
        if self.on_complete is None:
            self._assembly.notify(handoff.key)
            return
        result = self.on_complete(self._assembly.take(handoff.key))
        if inspect.isawaitable(result):
            await result

    # -- lookups and expiry ------------------------------------------------------

    async def wait(self, request_id: str, timeout_s: float, sender: str = "") -> Handoff:
        """The request's Handoff once all its bands are in (taken: a second wait for it
        fails); ``TimeoutError`` after ``timeout_s``; ``HandoffError`` if it failed.
        ``sender``: the run whose request it is (the bands' ``sender``)."""
        return await self._assembly.wait(request_key(sender, request_id), timeout_s)

    def pending(self) -> dict[str, tuple[list[int], int]]:
        """Incomplete requests: key (``wire.request_key``) -> (stages stored, num_stages)."""
        return self._assembly.pending()

    def expire(self, now: float | None = None) -> list[str]:
        """Drop requests incomplete for longer than ``incomplete_timeout_s``, or complete
        but not taken for longer than ``request_timeout_s``; returns their ids."""
        return self._assembly.expire(time.monotonic() if now is None else now)

    async def _expire_loop(self) -> None:
        a = self._assembly
        while True:
            await anyio.sleep(min(1.0, a.request_timeout_s / 4, a.incomplete_timeout_s / 4))
            self.expire()
            self._buffers.tidy()


class BandBuffers:
    """Memory for bands, recycled. Fresh memory costs a page fault per 4 KiB on its
    first write, which can take as long as the socket copy itself, so a buffer whose
    tensors are all gone (its ``Handoff`` dropped, every tensor of it freed) is kept,
    and the next band of up to its size and at least half of it takes it, the latest
    returned first (the likeliest still in cache). Kept up to ``keep_bytes``, the oldest
    let go first, counted at each ``take`` and ``tidy``.
    Not thread-safe but for the return of a buffer, which may happen on any thread."""

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes = keep_bytes
        self._free: list[np.ndarray] = []  # uint8, oldest first
        self._free_bytes = 0
        self._returned: deque[np.ndarray] = deque()  # by finalizers

    def take(self, size: int) -> torch.Tensor:
        """``size`` bytes (uint8, contents undefined), back here once unreferenced."""
        self.tidy()
        for i in reversed(range(len(self._free))):  # the latest returned: likely in cache
            memory = self._free[i]
            if size <= memory.nbytes <= 2 * size:
                del self._free[i]
                self._free_bytes -= memory.nbytes
                break
        else:
            memory = np.empty(size, dtype=np.uint8)
        # a view of its own (the tensors' owner): collected when the last tensor goes
        view = memory[:size]
        weakref.finalize(view, self._returned.append, memory).atexit = False
        return torch.from_numpy(view)

    def close(self) -> None:
        """Let every free buffer go."""
        self.tidy()
        self._free, self._free_bytes = [], 0

    def tidy(self) -> None:
        """Keep the buffers returned since, within ``keep_bytes``."""
        while self._returned:
            memory = self._returned.popleft()
            self._free.append(memory)
            self._free_bytes += memory.nbytes
        while self._free_bytes > self.keep_bytes:  # the oldest let go first
            self._free_bytes -= self._free.pop(0).nbytes


def views(buffer: torch.Tensor, header: BandHeader,
          offsets: list[int]) -> dict[tuple[int, str], torch.Tensor]:  # fmt: skip
    """The band's tensors as views of ``buffer`` (uint8) at ``offsets``."""
    flat = buffer.numpy()  # views through numpy cost a third of torch's
    tensors: dict[tuple[int, str], torch.Tensor] = {}
    for spec, at in zip(header.tensors, offsets, strict=True):
        key, raw = (spec.layer, spec.name), flat[at : at + spec.nbytes]
        if spec.dtype != "bfloat16":  # numpy has the others
            tensors[key] = torch.from_numpy(raw.view(spec.dtype).reshape(spec.shape))
        else:  # bfloat16: no numpy dtype
            tensors[key] = torch.from_numpy(raw).view(torch.bfloat16).view(spec.shape)
    return tensors


async def _linger(conn: _io.Connection, num_bytes: int) -> None:
    """After an error ack: read and drop what the peer still sends (up to num_bytes),
    so that closing does not reset the connection before the peer reads the ack."""
    conn.shutdown_write()
    with contextlib.suppress(TimeoutError, OSError):
        await conn.drain(num_bytes)


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
