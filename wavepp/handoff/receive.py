"""The receiving side: a server that takes a request's P bands, checks each against the
model it decodes with, and assembles them into a :class:`Handoff`.

One connection carries one band (``wavepp.handoff.wire``). For each, in order: the
prefix and the header are read and checked (bounds, internal consistency, the model's
fingerprint field by field, each layer's tensors by name, dtype and shape, the byte
budget, duplicates); only then is the band's buffer allocated — one per band, its
tensors views into it, memory of released bands reused (``BandBuffers``) — and the
payload read straight into it. A sender on this host that offers to (``FLAG_SEGMENT``)
is lent the buffer itself instead, a memfd, and writes the payload into it: one copy
in all, none here. A segment is lent again only to the process it was first lent to
(by its Unix socket peer's pid and start time), so a sender that kept its file can write
into the bands it sends, not another sender's, and only once that sender said it was done
writing (a band given up half way may still be written into: its segment is closed).
A sender that asks (``FLAG_RESERVE``) is also lent a segment for its next band, which
that band then names (``FLAG_RESERVED``) with its payload already in it: no answer
before the ack. A reservation unused for ``RESERVATION_S`` is closed, not lent again.
The receiver answers
every band with one ack — ok, or the reason — and closes. A refused band's payload is
drained (up to ``max_band_bytes``) so the sender reads its ack instead of a reset. A
peer that stops half way or sends garbage costs that band only: each read waits at most
``read_timeout_s``. Memory is bounded: bytes held (incomplete and uncollected requests)
stay under ``max_held_bytes``, and a request not complete — or not taken — within
``request_timeout_s`` is dropped.

A complete request goes to ``on_complete`` when one is given, else it waits for
``await receiver.wait(request_id, timeout_s)``.
"""

from __future__ import annotations

import contextlib
import fcntl
import inspect
import logging
import mmap
import os
import secrets
import sys
import time
import weakref
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable, Hashable, Mapping

import anyio
import attrs
import numpy as np
import torch

from wavepp.handoff import _io
from wavepp.handoff.wire import (
    BAND_MAGIC,
    DONE_MAGIC,
    FLAG_RESERVE,
    FLAG_RESERVED,
    FLAG_SEGMENT,
    PREFIX_BYTES,
    RESERVE_MAGIC,
    SEGMENT_ID_BYTES,
    Ack,
    Address,
    BandHeader,
    Fingerprint,
    WireError,
    band_bytes,
    decode_header,
    encode_ack,
    encode_segment,
    expected_tensors,
    fingerprint_from_hf_config,
    parse_address,
    parse_prefix,
    parse_segment_id,
    payload_layout,
)

log = logging.getLogger("wavepp.handoff")

TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int32": torch.int32,
}
NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "int32": np.int32}
MAX_SEGMENTS = 64  # segments open at once (two descriptors each: the memfd, its mapping's)
SEGMENT_BYTES = 1 << 30  # their bytes at most (lent, in use or kept)
SEGMENT_IDLE_S = 300.0  # a kept segment free this long is closed
RESERVATION_S = 30.0  # a segment reserved for a sender's next band, unused this long, is closed
MAX_RESERVED = 8  # segments reserved for one sender at once
LINGER_BYTES = 1 << 21  # drained after refusing a connection whose length is unknown
MAX_DONE = 4096  # finished request ids remembered (late or repeated bands are refused)


class HandoffError(RuntimeError):
    """A request's handoff failed as a whole (expired, or its bands do not fit together)."""


@attrs.frozen(eq=False)
class Handoff:
    """One request's whole cache, in WavePP's native layout (``docs/handoff.md``)."""

    request_id: str
    tokens: torch.Tensor  # int64 [T]: the prompt
    first_token: int  # argmax of the prompt's last logits
    top_logit: float  # its logit
    layers: dict[int, dict[str, torch.Tensor]]  # global layer -> {k, v | latent | delta, conv}
    fingerprint: Fingerprint  # the model the cache was computed with
    num_stages: int  # bands it came in

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


Handler = Callable[[_io.Connection], Awaitable[None]]
OnComplete = Callable[[Handoff], Awaitable[None] | None]


@attrs.define(eq=False)
class _Memory:
    """A band buffer: heap memory, or a segment (a memfd mapped here, ``fd`` >= 0)."""

    array: np.ndarray  # uint8, all of it
    fd: int = -1
    segment_id: int = 0  # a segment's name to its sender: random, never reused
    # a segment whose sender did not say it was done: it may still be writing into it,
    # so it is closed once free, never lent again
    spoiled: bool = False
    _closer: weakref.finalize | None = attrs.field(default=None, repr=False)

    @classmethod
    def segment(cls, size: int) -> _Memory:
        """A memfd of ``size`` bytes, mapped, its size sealed (a sender cannot shrink it
        under this mapping, nor add seals). Its descriptor is closed by :meth:`close`, or
        when the object is collected (a receiver gone while a Handoff outlived it)."""
        fd = os.memfd_create("wavepp-band", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)  # fmt: skip
            memory = cls(np.frombuffer(mmap.mmap(fd, size), dtype=np.uint8), fd,
                         secrets.randbits(64))
        except BaseException:
            os.close(fd)
            raise
        memory._closer = weakref.finalize(memory, os.close, fd)
        return memory

    def close(self) -> None:
        if self._closer is not None:
            self._closer()  # once; the mapping goes with the array
            self.fd = -1


class BandBuffers:
    """Memory for bands, recycled. Fresh memory costs a page fault per 4 KiB on its
    first write, which can take as long as the socket copy itself, so a buffer whose
    tensors are all gone (its ``Handoff`` dropped, every tensor of it freed) is kept,
    and the next band of up to its size and at least half of it takes it, the latest
    returned first (the likeliest still in cache). Heap buffers: any band may take one;
    kept up to ``keep_bytes``, the oldest let go first, counted at each ``take`` and
    ``tidy``.

    Segments (memfds lent to senders) are kept the same way, each for the peer it was
    lent to, and bounded apart: at most ``segment_bytes`` and ``max_segments`` open (lent,
    in use or kept). A band that would take more is not lent one (``lend`` says None: it
    comes over the socket), rather than a kept segment being closed for it — a fresh
    segment costs its sender a page fault per 4 KiB, more than the socket copy, so
    segments that took turns being closed would make every band slower, not some
    faster. A kept segment is closed once it has been free for ``idle_s`` (its peer
    sends bands of other sizes now, or is gone).
    Not thread-safe but for the return of a buffer, which may happen on any thread."""

    def __init__(self, keep_bytes: int, segment_bytes: int = SEGMENT_BYTES,
                 max_segments: int = MAX_SEGMENTS, idle_s: float = SEGMENT_IDLE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.keep_bytes = keep_bytes
        self.segment_bytes, self.max_segments = segment_bytes, max_segments
        self.idle_s, self._clock = idle_s, clock
        self.num_segments = 0  # memfds open: lent, in use or kept
        self.open_segment_bytes = 0  # their bytes
        # (peer, memory, since when free), oldest first; peer None: heap memory
        self._free: list[tuple[Hashable | None, _Memory, float]] = []
        self._free_bytes = 0  # heap memory kept
        self._returned: deque[tuple[Hashable | None, _Memory]] = deque()  # by finalizers
        self.closed = False  # by close(): a segment returned after it is closed at once

    def take(self, size: int) -> torch.Tensor:
        """``size`` bytes (uint8, contents undefined), back here once unreferenced."""
        taken = self._take(size, None)
        assert taken is not None  # heap memory is never refused
        return taken[0]

    def lend(self, size: int, peer: Hashable,
             whole: bool = False) -> tuple[torch.Tensor, _Memory] | None:  # fmt: skip
        """As :meth:`take`, in a segment for the process ``peer`` (a memfd, with its
        ``fd``; ``whole``: the tensor is all of it, not its first ``size`` bytes); None
        when no kept segment of ``peer``'s fits and a new one would open more than
        ``segment_bytes`` or ``max_segments``."""
        return self._take(size, peer, whole)

    def _take(self, size: int, peer: Hashable | None,
              whole: bool = False) -> tuple[torch.Tensor, _Memory] | None:  # fmt: skip
        self.tidy()
        for i in reversed(range(len(self._free))):  # the latest returned: likely in cache
            owner, memory, _ = self._free[i]
            if owner == peer and size <= memory.array.nbytes <= 2 * size:
                del self._free[i]
                if memory.fd < 0:
                    self._free_bytes -= memory.array.nbytes
                break
        else:
            if peer is None:
                memory = _Memory(np.empty(size, dtype=np.uint8))
            elif (self.num_segments >= self.max_segments
                  or self.open_segment_bytes + size > self.segment_bytes):  # fmt: skip
                return None
            else:
                memory = _Memory.segment(size)
                self.num_segments += 1
                self.open_segment_bytes += size
        # a view of its own (the tensors' owner): collected when the last tensor goes
        view = memory.array[: memory.array.nbytes if whole else size]
        weakref.finalize(view, self._give_back, (peer, memory)).atexit = False
        return torch.from_numpy(view), memory

    def _give_back(self, item: tuple[Hashable | None, _Memory]) -> None:
        """A buffer no tensor views any more (a finalizer: on any thread)."""
        if self.closed and item[1].fd >= 0:  # no band will take it
            self._close_segment(item[1])
        else:
            self._returned.append(item)

    def _close_segment(self, memory: _Memory) -> None:
        self.num_segments -= 1
        self.open_segment_bytes -= memory.array.nbytes
        memory.close()

    def close(self) -> None:
        """Let every free buffer go; a segment in use closes when its tensors go (until
        ``closed`` is set False again)."""
        self.closed = True
        self.tidy()
        for _, memory, _ in self._free:
            if memory.fd >= 0:
                self._close_segment(memory)
        self._free, self._free_bytes = [], 0

    def tidy(self) -> None:
        """Keep the buffers returned since: heap memory within ``keep_bytes``, segments
        free for less than ``idle_s``."""
        now = self._clock()
        while self._returned:
            peer, memory = self._returned.popleft()
            if memory.spoiled:
                self._close_segment(memory)
                continue
            self._free.append((peer, memory, now))
            if memory.fd < 0:
                self._free_bytes += memory.array.nbytes
        kept = []
        for entry in self._free:
            memory, since = entry[1], entry[2]
            if memory.fd >= 0 and now - since >= self.idle_s:
                self._close_segment(memory)
            else:
                kept.append(entry)
        self._free = []
        for entry in kept:  # the oldest first
            nbytes = entry[1].array.nbytes
            if entry[1].fd < 0 and self._free_bytes > self.keep_bytes:
                self._free_bytes -= nbytes  # let go
            else:
                self._free.append(entry)


@attrs.define(eq=False)
class _Reservation:
    """A segment reserved for one sender's next band (``FLAG_RESERVE``)."""

    peer: Hashable  # the process it was lent to
    buffer: torch.Tensor  # uint8, the whole segment: its owner while reserved
    memory: _Memory
    until: float  # monotonic: closed if not used by then


@attrs.define
class _Pending:
    """A request with some bands in: what they claim and what has arrived."""

    num_stages: int
    num_tokens: int
    since: float  # monotonic time of its first band
    stages: set[int] = attrs.Factory(set)  # claimed: stored or being read
    layers: set[int] = attrs.Factory(set)  # claimed by those stages
    held: int = 0  # payload bytes claimed
    bands: dict[int, dict[tuple[int, str], torch.Tensor]] = attrs.Factory(dict)
    first_token: int = -1
    top_logit: float = 0.0


class Receiver:
    """Receives bands for one model (its Hugging Face ``config.json`` dict and the
    attention tensors' ``dtype``). ``handlers`` maps other 4-byte magics to coroutines
    that serve such connections on the same address (the decode worker's requests).
    Up to ``keep_free_bytes`` of released band buffers are kept for reuse.
    ``lend_segments``: accept senders' offers to write bands into lent memfds (Unix
    sockets only; otherwise every band's payload comes on the socket), up to
    ``segment_bytes`` of them open at once (``BandBuffers``: a band over it comes on the
    socket)."""

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
        lend_segments: bool = True,
        segment_bytes: int = SEGMENT_BYTES,
        on_complete: OnComplete | None = None,
        handlers: Mapping[bytes, Handler] | None = None,
    ) -> None:
        if sys.byteorder != "little":
            raise RuntimeError("the handoff payload is little-endian; this host is not")
        self.config, self.dtype = config, dtype
        self.fingerprint = fingerprint_from_hf_config(config, dtype)
        self.max_band_bytes = max_band_bytes
        self.max_held_bytes = max_held_bytes if max_held_bytes is not None else 4 * max_band_bytes
        self.read_timeout_s, self.request_timeout_s = read_timeout_s, request_timeout_s
        self.max_requests = max_requests
        self.lend_segments = lend_segments
        self.on_complete = on_complete
        self.handlers = dict(handlers or {})
        self.counts: Counter[str] = Counter()  # bands_ok, bands_refused, bands_broken, ...
        self.held_bytes = 0
        self._pending: dict[str, _Pending] = {}
        self._ready: dict[str, tuple[Handoff, float, int]] = {}  # id -> (it, since, bytes)
        self._done: OrderedDict[str, str] = OrderedDict()  # id -> "" (taken) or why it failed
        self._events: dict[str, anyio.Event] = {}
        self._slots = anyio.Semaphore(max_connections)
        self._buffers = BandBuffers(keep_free_bytes, segment_bytes)
        self._reserved: dict[int, _Reservation] = {}  # segment id -> its reservation

    # -- serving -----------------------------------------------------------------

    async def serve(self, address: str | Address, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        """Listen at ``address`` until cancelled; ``task_status.started`` gets the bound
        address (a tcp port 0 becomes the real port)."""
        where = parse_address(address) if isinstance(address, str) else address
        listener, bound = _io.listen(where)
        self._buffers.closed = False
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
                    tg.start_soon(self._connection, sock)
        finally:
            _io.close_socket(listener)
            self._buffers.close()
            self._reserved.clear()  # closed: a sender may still write into them
            if bound.kind == "unix":
                _unlink_quietly(bound.path)

    async def _connection(self, sock) -> None:
        conn = _io.Connection(sock, self.read_timeout_s)
        try:
            try:
                magic = await conn.read_exactly(4)
            except (TimeoutError, OSError):
                return
            if magic == BAND_MAGIC:
                await self._band(conn)
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

    async def _answer(self, conn: _io.Connection, ack: Ack) -> None:
        try:
            await conn.send(encode_ack(ack))
        except (TimeoutError, OSError) as error:
            log.info("ack for %r stage %d not delivered: %r", ack.request_id, ack.stage, error)

    # -- one band ----------------------------------------------------------------

    async def _band(self, conn: _io.Connection) -> None:
        header: BandHeader | None = None
        segment_id = None
        try:
            length, flags = parse_prefix(BAND_MAGIC + await conn.read_exactly(PREFIX_BYTES - 4))
            header = decode_header(await conn.read_exactly(length))
            if flags & FLAG_RESERVED:
                segment_id = parse_segment_id(await conn.read_exactly(SEGMENT_ID_BYTES))
            self.check(header)
            entry = self._claim(header)
            try:
                reserve = bool(flags & FLAG_RESERVE)
                if flags & FLAG_SEGMENT:
                    tensors = await self._lend(conn, header, reserve)
                elif segment_id is not None:
                    tensors = await self._take_reserved(conn, header, segment_id, reserve)
                else:
                    tensors = await self._read_payload(conn, header)
                complete = self._store(entry, header, tensors)
            except BaseException:
                self._release(entry, header)
                raise
        except WireError as error:
            self.counts["bands_refused"] += 1
            if segment_id is not None:  # the sender may be writing into it: never lent again
                self._unreserve(segment_id, _peer(conn))
            rid, stage = (header.request_id, header.stage) if header else ("", -1)
            log.info("band refused (%r stage %d): %s", rid, stage, error)
            await self._answer(conn, Ack(rid, stage, False, str(error)))
            if header is None:
                await _linger(conn, LINGER_BYTES)
            elif band_bytes(header) <= self.max_band_bytes:
                await _linger(conn, band_bytes(header))
            return
        except (TimeoutError, OSError) as error:
            self.counts["bands_broken"] += 1
            what = "stopped sending" if isinstance(error, TimeoutError) else "went away"
            rid, stage = (header.request_id, header.stage) if header else ("", -1)
            log.info("band (%r stage %d): the sender %s: %r", rid, stage, what, error)
            await self._answer(conn, Ack(rid, stage, False, f"the sender {what} mid-band"))
            return
        self.counts["bands_ok"] += 1
        await self._answer(conn, Ack(header.request_id, header.stage, True))
        if complete is not None:
            await self._deliver(complete)

    def check(self, header: BandHeader) -> None:
        """A decoded header against this receiver's model; ``WireError`` naming what
        differs. (Pure: nothing is claimed or allocated.)"""
        mine, theirs = self.fingerprint, header.fingerprint
        for field in mine.__struct_fields__:
            a, b = getattr(theirs, field), getattr(mine, field)
            if a != b:
                raise WireError(f"fingerprint {field}: the band has {a!r}, this model has {b!r}")
        if header.first_token >= mine.vocab_size:
            raise WireError(f"first_token {header.first_token} >= vocab_size {mine.vocab_size}")
        t = header.num_tokens
        expected: dict[tuple[int, str], tuple[str, tuple[int, ...]]] = {}
        for layer in [-1] * (header.stage == 0) + header.layers:
            for name, spec in expected_tensors(self.config, self.dtype, layer, t,
                                                mine).items():  # fmt: skip
                expected[(layer, name)] = spec
        for spec in header.tensors:
            key = (spec.layer, spec.name)
            kind = "per-request" if spec.layer == -1 else mine.layer_kinds[spec.layer]
            if key not in expected:
                names = sorted(n for (la, n) in expected if la == spec.layer)
                raise WireError(f"layer {spec.layer} ({kind}, stage {header.stage}) has no "
                                f"tensor {spec.name!r}; expected {names}")  # fmt: skip
            dtype, shape = expected.pop(key)
            if (spec.dtype, tuple(spec.shape)) != (dtype, shape):
                raise WireError(
                    f"layer {spec.layer} ({kind}) tensor {spec.name!r}: the band has "
                    f"{spec.dtype} {list(spec.shape)}, expected {dtype} {list(shape)} "
                    f"for {t} tokens"
                )
        if expected:
            missing = [f"{name} of layer {layer}" for layer, name in sorted(expected)]
            raise WireError(f"stage {header.stage}'s band lacks {', '.join(missing[:8])}")
        size = band_bytes(header)
        if size > self.max_band_bytes:
            raise WireError(
                f"band of {size:,} bytes exceeds max_band_bytes {self.max_band_bytes:,}"
            )

    def _claim(self, header: BandHeader) -> _Pending:
        """Reserve the band's stage, layers and bytes in its request (WireError if the
        band cannot be part of it), before anything is allocated."""
        rid, stage, size = header.request_id, header.stage, band_bytes(header)
        if rid in self._ready or self._done.get(rid) == "":
            raise WireError(f"request {rid!r} is already complete")
        entry = self._pending.get(rid)
        if entry is None:
            if len(self._pending) >= self.max_requests:
                raise WireError(f"{len(self._pending)} requests are incomplete; at most "
                                f"{self.max_requests}")  # fmt: skip
            entry = _Pending(header.num_stages, header.num_tokens, time.monotonic())
        if (entry.num_stages, entry.num_tokens) != (header.num_stages, header.num_tokens):
            raise WireError(
                f"request {rid!r}: this band says {header.num_stages} stages and "
                f"{header.num_tokens} tokens, earlier bands {entry.num_stages} and "
                f"{entry.num_tokens}"
            )
        if stage in entry.stages:
            raise WireError(f"request {rid!r}: stage {stage}'s band was already received")
        twice = sorted(entry.layers.intersection(header.layers))
        if twice:
            raise WireError(f"request {rid!r}: layers {twice} already came from another stage")
        if len(entry.stages) + 1 == entry.num_stages:
            covered = entry.layers.union(header.layers)
            missing = sorted(set(range(self.fingerprint.num_layers)) - covered)
            if missing:
                raise WireError(f"request {rid!r}: its {entry.num_stages} bands leave layers "
                                f"{missing[:16]} uncovered")  # fmt: skip
        if self.held_bytes + size > self.max_held_bytes:
            raise WireError(f"receiver holds {self.held_bytes:,} bytes; a band of {size:,} "
                            f"exceeds max_held_bytes {self.max_held_bytes:,}")  # fmt: skip
        self._pending[rid] = entry
        entry.stages.add(stage)
        entry.layers.update(header.layers)
        entry.held += size
        self.held_bytes += size
        return entry

    def _release(self, entry: _Pending, header: BandHeader) -> None:
        """Undo a claim whose band did not arrive (unless its request is gone already)."""
        if self._pending.get(header.request_id) is not entry:
            return
        size = band_bytes(header)
        entry.stages.discard(header.stage)
        entry.layers.difference_update(header.layers)
        entry.held -= size
        self.held_bytes -= size
        if not entry.stages:
            del self._pending[header.request_id]

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
        tensors = _views(buffer, header, offsets)
        whole = memoryview(buffer.numpy())
        for start, end in runs:
            await conn.read_into(whole[start:end])
        del whole
        self._check_tokens(tensors)
        return tensors

    async def _lend(self, conn: _io.Connection, header: BandHeader, reserve: bool):
        """A band offered into a segment: lend one (the sender writes the payload into
        it, then says ``DONE_MAGIC``) or — beyond a Unix socket, or when ``BandBuffers``
        has none to lend — decline (size 0) and read the payload from the socket. With
        ``reserve``, a reservation for the sender's next band follows the answer."""
        offsets, size = payload_layout(header)
        peer = _peer(conn)
        taken = self._segment(peer, size) if size else None
        if taken is None:
            await conn.send(encode_segment(0))
            if reserve:
                await self._reserve(conn, peer, size)
            return await self._read_payload(conn, header)
        buffer, memory = taken
        tensors = _views(buffer, header, offsets)
        memory.spoiled = True  # until the sender says it is done writing
        await conn.send_fd(encode_segment(memory.array.nbytes, memory.segment_id), memory.fd)
        if reserve:
            await self._reserve(conn, peer, size)
        return await self._written(conn, memory, tensors)

    def _segment(self, peer: Hashable | None, size: int, whole: bool = False):
        """A segment of ``size`` bytes for the process ``peer`` (``BandBuffers.lend``), or
        None: lending is off, the peer is not a process this side can name (None), or no
        segment is to be had."""
        if not self.lend_segments or peer is None:
            return None
        try:
            return self._buffers.lend(size, peer, whole)
        except OSError as error:  # this side's failure (no memory, no descriptors)
            log.warning("no segment lent for a band of %d bytes: %r", size, error)
            return None

    async def _written(self, conn: _io.Connection, memory: _Memory,
                       tensors: dict[tuple[int, str], torch.Tensor]):  # fmt: skip
        """The band's tensors, in ``memory`` (a segment), once the sender says it is done
        writing them."""
        done = await conn.read_exactly(len(DONE_MAGIC))
        if done != DONE_MAGIC:
            raise WireError(f"expected {DONE_MAGIC!r} after the segment's payload, got {done!r}")
        memory.spoiled = False
        # the sender can still write into the segment: the token ids are checked on a copy
        tokens = tensors.get((-1, "tokens"))
        if tokens is not None:
            tensors[(-1, "tokens")] = tokens.clone()
        self._check_tokens(tensors)
        return tensors

    async def _reserve(self, conn: _io.Connection, peer: Hashable | None, size: int) -> None:
        """Answer ``FLAG_RESERVE``: a segment of at least ``size`` bytes reserved for this
        peer's next band (``RESERVE_MAGIC`` and the memfd), or size 0 — lending is off,
        this peer holds ``MAX_RESERVED`` already, or no segment is to be had. A reserved
        segment counts as lent: the sender may write into it from now on, so it is never
        lent again unless a band that names it says it is done writing."""
        held = sum(1 for r in self._reserved.values() if r.peer == peer)
        taken = self._segment(peer, size, whole=True) if size and held < MAX_RESERVED else None
        if taken is None:
            await conn.send(encode_segment(0, 0, RESERVE_MAGIC))
            return
        buffer, memory = taken
        memory.spoiled = True
        self._reserved[memory.segment_id] = _Reservation(
            peer, buffer, memory, time.monotonic() + RESERVATION_S)
        self.counts["segments_reserved"] += 1
        await conn.send_fd(encode_segment(memory.array.nbytes, memory.segment_id,
                                          RESERVE_MAGIC), memory.fd)  # fmt: skip

    def _unreserve(self, segment_id: int, peer: Hashable | None) -> _Reservation | None:
        """The reservation ``peer`` names, taken out of the table (None: no such
        reservation of that peer's; another's stays)."""
        reservation = self._reserved.get(segment_id)
        if reservation is None or peer is None or reservation.peer != peer:
            return None
        return self._reserved.pop(segment_id)

    async def _take_reserved(self, conn: _io.Connection, header: BandHeader,
                             segment_id: int, reserve: bool):  # fmt: skip
        """A band written into the segment reserved for its sender: its tensors are views
        of it once the sender says ``DONE_MAGIC``. A reservation this side does not hold
        (expired, another process's, a receiver restarted since) or too small for the
        band is answered with size 0, and the payload follows on the socket after the
        ``DONE_MAGIC``."""
        offsets, size = payload_layout(header)
        peer = _peer(conn)
        reservation = self._unreserve(segment_id, peer)
        if reserve:
            await self._reserve(conn, peer, size)
        if reservation is None or size > reservation.buffer.numel():
            self.counts["reservations_missed"] += 1
            reservation = None  # a too small one stays spoiled: closed, never lent again
            await conn.send(encode_segment(0))
            done = await conn.read_exactly(len(DONE_MAGIC))
            if done != DONE_MAGIC:
                raise WireError(f"expected {DONE_MAGIC!r} before the payload, got {done!r}")
            return await self._read_payload(conn, header)
        self.counts["reservations_used"] += 1
        tensors = _views(reservation.buffer, header, offsets)
        memory = reservation.memory
        del reservation
        return await self._written(conn, memory, tensors)

    def _check_tokens(self, tensors: dict[tuple[int, str], torch.Tensor]) -> None:
        tokens = tensors.get((-1, "tokens"))
        if tokens is not None and tokens.numel():
            low, high = int(tokens.min()), int(tokens.max())
            if low < 0 or high >= self.fingerprint.vocab_size:
                raise WireError(f"token ids span {low}..{high}, outside the vocabulary of "
                                f"{self.fingerprint.vocab_size}")  # fmt: skip

    def _store(self, entry: _Pending, header: BandHeader, tensors) -> Handoff | None:
        """Keep a band that arrived whole; the request's Handoff once all P are in."""
        rid = header.request_id
        if self._pending.get(rid) is not entry:
            raise WireError(f"request {rid!r} expired while this band was read")
        entry.bands[header.stage] = tensors
        if header.stage == header.num_stages - 1:
            entry.first_token, entry.top_logit = header.first_token, header.top_logit
        if len(entry.bands) < entry.num_stages:
            return None
        del self._pending[rid]
        layers: dict[int, dict[str, torch.Tensor]] = {}
        tokens = None
        for band in entry.bands.values():
            for (layer, name), tensor in band.items():
                if layer == -1:
                    tokens = tensor.to(torch.int64)
                else:
                    layers.setdefault(layer, {})[name] = tensor
        handoff = Handoff(
            request_id=rid, tokens=tokens, first_token=entry.first_token,
            top_logit=entry.top_logit, layers=dict(sorted(layers.items())),
            fingerprint=self.fingerprint, num_stages=entry.num_stages,
        )  # fmt: skip
        self._ready[rid] = (handoff, time.monotonic(), entry.held)
        return handoff

    async def _deliver(self, handoff: Handoff) -> None:
        self.counts["requests_complete"] += 1
        if self.on_complete is None:
            self._notify(handoff.request_id)
            return
        _, _, size = self._ready.pop(handoff.request_id)
        self.held_bytes -= size
        self._finish(handoff.request_id, "")
        result = self.on_complete(handoff)
        if inspect.isawaitable(result):
            await result

    # -- lookups and expiry ------------------------------------------------------

    async def wait(self, request_id: str, timeout_s: float) -> Handoff:
        """The request's Handoff once all its bands are in (taken: a second wait for it
        fails); ``TimeoutError`` after ``timeout_s``; ``HandoffError`` if it failed."""
        deadline = time.monotonic() + timeout_s
        while True:
            if request_id in self._ready:
                handoff, _, size = self._ready.pop(request_id)
                self.held_bytes -= size
                self._finish(request_id, "")
                return handoff
            reason = self._done.get(request_id)
            if reason is not None:
                raise HandoffError(
                    f"request {request_id!r}: " + (reason or "its handoff was already taken")
                )
            left = deadline - time.monotonic()
            if left <= 0:
                entry = self._pending.get(request_id)
                got = f"stages {sorted(entry.bands)} of {entry.num_stages}" if entry else "no band"
                raise TimeoutError(f"request {request_id!r}: {got} arrived in {timeout_s:g} s")
            event = self._events.setdefault(request_id, anyio.Event())
            with anyio.move_on_after(left):
                await event.wait()
            if self._events.get(request_id) is event and event.is_set():
                del self._events[request_id]

    def pending(self) -> dict[str, tuple[list[int], int]]:
        """Incomplete requests: id -> (stages stored, num_stages)."""
        return {rid: (sorted(e.bands), e.num_stages) for rid, e in self._pending.items()}

    def _notify(self, request_id: str) -> None:
        event = self._events.pop(request_id, None)
        if event is not None:
            event.set()

    def _finish(self, request_id: str, reason: str) -> None:
        self._done[request_id] = reason
        self._done.move_to_end(request_id)
        while len(self._done) > MAX_DONE:
            self._done.popitem(last=False)

    def expire(self, now: float | None = None) -> list[str]:
        """Drop requests incomplete, or complete but not taken, for longer than
        ``request_timeout_s``; returns their ids."""
        now = time.monotonic() if now is None else now
        cutoff = now - self.request_timeout_s
        gone = []
        for rid, entry in list(self._pending.items()):
            if entry.since <= cutoff:
                del self._pending[rid]
                self.held_bytes -= entry.held
                self._fail(rid, f"expired: stages {sorted(entry.bands)} of {entry.num_stages} "
                                f"arrived in {self.request_timeout_s:g} s")  # fmt: skip
                gone.append(rid)
        for rid, (_, since, size) in list(self._ready.items()):
            if since <= cutoff:
                del self._ready[rid]
                self.held_bytes -= size
                self._fail(rid, f"expired: complete but not taken in {self.request_timeout_s:g} s")
                gone.append(rid)
        for segment_id, reservation in list(self._reserved.items()):
            if reservation.until <= now:  # still spoiled: closed once let go
                del self._reserved[segment_id]
                self.counts["reservations_expired"] += 1
        return gone

    def _fail(self, request_id: str, reason: str) -> None:
        self.counts["requests_expired"] += 1
        log.info("handoff %r %s", request_id, reason)
        self._finish(request_id, reason)
        self._notify(request_id)

    async def _expire_loop(self) -> None:
        while True:
            await anyio.sleep(min(1.0, self.request_timeout_s / 4))
            self.expire()
            self._buffers.tidy()


def _peer(conn: _io.Connection) -> tuple[int, int] | None:
    """The process at the other end (``_io.peer_process``); None where it cannot be
    named (not a Unix socket, gone, or unreadable)."""
    try:
        return _io.peer_process(conn.sock)
    except OSError:
        return None


def _views(buffer: torch.Tensor, header: BandHeader,
           offsets: list[int]) -> dict[tuple[int, str], torch.Tensor]:  # fmt: skip
    """The band's tensors as views of ``buffer`` (uint8) at ``offsets``."""
    flat = buffer.numpy()  # views through numpy cost a third of torch's
    tensors: dict[tuple[int, str], torch.Tensor] = {}
    for spec, at in zip(header.tensors, offsets, strict=True):
        key, raw = (spec.layer, spec.name), flat[at : at + spec.nbytes]
        if spec.dtype in NUMPY_DTYPES:
            tensors[key] = torch.from_numpy(raw.view(NUMPY_DTYPES[spec.dtype]).reshape(spec.shape))
        else:  # bfloat16: no numpy dtype
            tensors[key] = torch.from_numpy(raw).view(TORCH_DTYPES[spec.dtype]).view(spec.shape)
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
