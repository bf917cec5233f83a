"""The sending side of lent segments: a band written into memory its receiver lends.

A band that goes from a worker thread to a Unix socket (``socket_send``) offers to write
its payload into a segment the receiver lends (``wire.FLAG_SEGMENT``, ``docs/handoff.md``):
a memfd, checked before a byte goes in, mapped here and the runs copied into it — one copy
in all, where the socket takes two (the sender's into the kernel, the receiver's out of
it). A receiver lends a stage the same segment again once its last band is taken, so the
mapping is kept (:class:`SegmentMaps`) and its pages are not faulted in again. Each such
band also asks the receiver to reserve a segment for the stage's next band
(``wire.FLAG_RESERVE``): a band with a reservation in hand writes into it as it
connects, with no answer to wait for before the bytes go in — one round trip per band,
not two. The receiving side is ``wavepp.handoff.lending``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Sequence

import anyio
import numpy as np

from wavepp.handoff import _io, wire
from wavepp.handoff.base import BandFailed, BandTensor

MAX_FDS = 4  # files a segment answer may carry before it is refused as garbage
MAX_KEPT_MAPS = 8  # lent segments kept mapped unused, at most
MAP_IDLE_S = 300.0  # and each for this long since its last band
MAP_TIDY_S = 5.0  # how often a stage looks for idle ones
# a segment reserved for a band is used within this long of its arrival, or let go: well
# inside the receiver's hold on it (wavepp.handoff.lending.RESERVATION_S, 30 s)
RESERVED_USE_S = 10.0
MAX_RESERVED_MAPS = 8  # segments reserved for this stage, per target, held at once
SEGMENT_SEALS = ("F_SEAL_SHRINK", "F_SEAL_GROW")  # a lent memfd's size cannot change
# a mapping that fails for these is this process's shortage, not the receiver's fault
OWN_LIMITS = (errno.ENOMEM, errno.EMFILE, errno.ENFILE, errno.EAGAIN)

Left = Callable[[], float]  # seconds left to the band's deadline (TimeoutError at none)


class SegmentSender:
    """A stage's segments: the mappings it keeps, and the route of each band into one."""

    def __init__(self, keep_bytes: int) -> None:
        self.maps = SegmentMaps(keep_bytes)  # lent segments, kept mapped

    def route(self, target: str, header: wire.BandHeader) -> SegmentRoute:
        """How a band to ``target`` (a Unix socket) goes into a segment: into the one
        reserved for it if one is in hand, else offered one; asking for a reservation
        for the next band either way."""
        offsets, size = wire.payload_layout(header)
        reserved = self.maps.take_reserved(target, size)
        if reserved is not None:
            flags = wire.FLAG_RESERVED | wire.FLAG_RESERVE
            prefix = wire.encode_band_prefix(header, flags, reserved[1])
        else:
            prefix = wire.encode_band_prefix(header, wire.FLAG_SEGMENT | wire.FLAG_RESERVE)
        return SegmentRoute(self.maps, target, prefix, offsets, reserved)

    async def run(self) -> None:
        """Let go of idle mappings, now and then, until cancelled."""
        while True:
            await anyio.sleep(MAP_TIDY_S)
            self.maps.tidy()


class SegmentRoute:
    """One band's way into a segment: made on the event loop, then its worker thread's
    (``socket_send``), which calls :meth:`write`, then :meth:`answer` when the payload
    went on the socket after all, and :meth:`drop` whatever happened."""

    def __init__(self, maps: SegmentMaps, target: str, prefix: bytes, offsets: list[int],
                 reserved: tuple[tuple, int] | None) -> None:  # fmt: skip
        self.maps, self.target = maps, target
        self.prefix = prefix  # the band's prefix, header and (reserved) segment id
        self.offsets = offsets  # each tensor's place in a segment (wire.payload_layout)
        self.awaiting = True  # a reservation for the next band comes before the ack
        # (SegmentMaps key, segment id): the segment reserved for this band; whoever
        # uses or drops it sets None
        self.reserved = reserved

    def write(self, sock: socket.socket, tensors: Sequence[BandTensor],
              left: Left) -> wire.Ack | None:  # fmt: skip
        """Send the prefix and the payload into the reserved segment, or into one the
        receiver lends: the receiver's ack (its refusal, too), or None where it lent
        none — the payload then follows on the socket, and :meth:`answer` reads the
        rest."""
        sock.sendall(self.prefix)
        if self.reserved is not None:  # written while the receiver reads the header
            key, self.reserved = self.reserved[0], None
            return self._into(sock, key, tensors, left, reserved=True)
        lent = self._lent(sock, left)
        if lent is None or isinstance(lent, wire.Ack):
            return lent  # declined, or the band was refused
        fd, segment_id = lent
        try:
            key, _ = self.maps.take(self.target, segment_id, fd)
        finally:
            os.close(fd)
        return self._into(sock, key, tensors, left)

    def _lent(self, sock: socket.socket, left: Left) -> tuple[int, int] | wire.Ack | None:
        """The receiver's answer to the offer: the lent memfd (a descriptor the caller
        owns, checked) and the segment's id, None (declined: the payload goes on the
        socket), or its ack (the band was refused)."""
        sock.settimeout(left())
        answer = self._read(sock, [wire.SEGMENT_MAGIC, wire.ACK_MAGIC])
        sock.settimeout(None)
        return answer if isinstance(answer, wire.Ack) else answer[1]

    def answer(self, sock: socket.socket, may_decline: bool = False) -> wire.Ack | None:
        """The receiver's answers once the payload is in: a reservation for the next band
        while one is awaited (kept in the maps), then the ack — or, with
        ``may_decline``, a segment answer of size 0 (None: the reserved segment was not
        held, the payload goes on the socket)."""
        while True:
            expect = [wire.ACK_MAGIC]
            expect += [wire.RESERVE_MAGIC] if self.awaiting else []
            expect += [wire.SEGMENT_MAGIC] if may_decline else []
            answer = self._read(sock, expect)
            if isinstance(answer, wire.Ack):
                return answer
            magic, lent = answer
            if magic == wire.SEGMENT_MAGIC:
                if lent is not None:
                    os.close(lent[0])
                    raise BandFailed("bad ack", f"{self.target} lent a segment for a band "
                                     "already written into the one it reserved")  # fmt: skip
                return None
            self.awaiting = False
            if lent is not None:
                try:
                    self.maps.reserve(self.target, lent[1], lent[0])
                finally:
                    os.close(lent[0])

    def drop(self) -> None:
        """The band is over: a reserved segment it did not use is let go."""
        if self.reserved is not None:
            self.maps.give_back(self.reserved[0], keep=False)
            self.reserved = None

    def _into(self, sock: socket.socket, key: tuple, tensors: Sequence[BandTensor],
              left: Left, reserved: bool = False) -> wire.Ack | None:  # fmt: skip
        """Write the band into the segment ``key`` names, say so (``DONE_MAGIC``) and
        return the receiver's ack; None where the segment was ``reserved`` and the
        receiver answers that it no longer holds it. The segment is handed back, its
        mapping kept only if the band was taken."""
        ack = None
        try:
            _write_segment(self.maps.memory(key), tensors, self.offsets)
            sock.sendall(wire.DONE_MAGIC)
            sock.settimeout(left())
            ack = self.answer(sock, may_decline=reserved)
            return ack
        finally:
            self.maps.give_back(key, keep=ack is not None and ack.ok)

    def _read(self, sock: socket.socket, expect: Sequence[bytes],
              ) -> wire.Ack | tuple[bytes, tuple[int, int] | None]:  # fmt: skip
        """The receiver's next message, one of ``expect``: an ack, or a segment answer
        or reservation — its magic and the lent memfd (a descriptor the caller owns,
        checked: a sealed memfd of the size the answer says) with the segment's id, or
        None (size 0: none lent)."""
        target, fds = self.target, []
        try:
            with _failures(target):
                magic = _io.recv_exactly(sock, 4, fds, MAX_FDS)
                if magic not in expect:
                    raise BandFailed("bad ack", f"{target} answered garbage: {magic!r} where "
                                     f"it answers {' or '.join(map(repr, expect))}")  # fmt: skip
                if magic == wire.ACK_MAGIC:
                    rest = _io.recv_exactly(sock, wire.ACK_PREFIX_BYTES - 4)
                    length = wire.ack_length(magic + rest)
                    return wire.decode_ack(_io.recv_exactly(sock, length))
                rest = _io.recv_exactly(sock, wire.SEGMENT_BYTES - 4, fds, MAX_FDS)
                size, segment_id = wire.parse_segment(magic + rest, magic)
            if size == 0 and not fds:
                return magic, None
            if size == 0 or len(fds) != 1:
                raise BandFailed("bad ack", f"{target} lent {len(fds)} files for a segment "
                                 f"of {size} bytes")  # fmt: skip
            fd = fds.pop()
            try:
                _check_segment(fd, size, target)
            except BaseException:
                os.close(fd)
                raise
            return magic, (fd, segment_id)
        finally:
            for fd in fds:
                os.close(fd)


@contextlib.contextmanager
def _failures(target: str):
    """A segment answer's read: garbage is a bad ack, a hang-up a disconnection."""
    try:
        yield
    except wire.WireError as error:
        raise BandFailed("bad ack", f"{target} answered garbage: {error}") from None
    except _io.FilesTruncated as error:
        raise BandFailed("bad ack", f"{target} passed files this stage cannot take: "
                         f"{error}") from None  # fmt: skip
    except ConnectionError:
        raise BandFailed("disconnected", f"{target} closed the connection before "
                         "answering the segment offer") from None  # fmt: skip


def _check_segment(fd: int, size: int, target: str) -> None:
    """A lent file is a memfd of ``size`` bytes whose size is sealed (so writing it can
    reach nothing but that memory); BandFailed("bad ack") otherwise."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size != size:
        raise BandFailed("bad ack", f"{target} lent a file of {info.st_size} bytes (mode "
                         f"{info.st_mode:o}) for a segment of {size}")  # fmt: skip
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise BandFailed("bad ack", f"{target} lent a file that is not a memfd") from None
    missing = [name for name in SEGMENT_SEALS if not seals & getattr(fcntl, name)]
    if missing:
        raise BandFailed("bad ack", f"{target} lent a file without {', '.join(missing)}")


def _write_segment(memory: np.ndarray, tensors: Sequence[BandTensor],
                   offsets: list[int]) -> None:  # fmt: skip
    """Every tensor's bytes into the lent segment (mapped: ``memory``) at its offset: the
    pool's runs as they are, a copied tensor once read."""
    need = max((at + t.num_bytes for t, at in zip(tensors, offsets, strict=True)), default=0)
    if need > memory.nbytes:
        raise BandFailed("bad ack", f"the lent segment of {memory.nbytes} bytes is too small "
                         f"for the band's {need}")  # fmt: skip
    for tensor, at in zip(tensors, offsets, strict=True):
        for view in tensor.views():
            piece = np.frombuffer(view, dtype=np.uint8)
            memory[at : at + piece.nbytes] = piece  # a memcpy, without the GIL
            at += piece.nbytes


class SegmentMaps:
    """Segments lent to this process, kept mapped between bands. A receiver lends a
    stage the segment its last band used once that band is taken, so a kept mapping
    spares a ``mmap`` and a page fault per 4 KiB on every band. Keyed by the target, the
    segment's id and the file itself (device and inode): a receiver that gave one id to
    another file gets that file mapped, not its bytes written into the old one. A mapping
    in use is never unmapped; unused ones are kept up to ``keep_bytes`` and
    ``MAX_KEPT_MAPS`` (each holds a descriptor, and the memory of the segment even once
    the receiver has let it go), the oldest let go first, and none unused for ``idle_s``
    (the receiver closes a segment free for 5 minutes: ``wavepp.handoff.lending``). A band
    that failed lets its mapping go.
    Segments reserved for this stage's next bands are held here too, mapped, until a band
    takes one (:meth:`take_reserved`) or ``RESERVED_USE_S`` has passed.
    Safe to write: a mapping is only made of a memfd whose size is sealed, so it cannot
    shrink under it. Thread-safe."""

    def __init__(self, keep_bytes: int, idle_s: float = MAP_IDLE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.keep_bytes, self.idle_s, self._clock = keep_bytes, idle_s, clock
        self._lock = threading.Lock()
        # key -> [mmap, users, last handed back], the latest used last
        self._maps: dict[tuple, list] = {}
        # target -> [(key, segment id, bytes, arrived)]: each holds a user of its mapping
        self._reserved: dict[str, list[tuple[tuple, int, int, float]]] = {}

    def reserve(self, target: str, segment_id: int, fd: int) -> bool:
        """Hold a segment ``target`` reserved for one of this stage's next bands (``fd``:
        a checked memfd, mapped here unless kept). False, holding nothing: this target's
        ``MAX_RESERVED_MAPS`` are held already."""
        with self._lock:
            if len(self._reserved.get(target, ())) >= MAX_RESERVED_MAPS:
                return False
        key, memory = self.take(target, segment_id, fd)
        with self._lock:
            self._reserved.setdefault(target, []).append((key, segment_id, memory.nbytes,
                                                          self._clock()))  # fmt: skip
        return True

    def take_reserved(self, target: str, size: int) -> tuple[tuple, int] | None:
        """The smallest segment ``target`` reserved for this stage that holds ``size``
        bytes and is recent enough to use, as ``(key, segment id)``: the caller's (its
        band's) until handed back with :meth:`give_back`. None: no such segment."""
        self.tidy()
        with self._lock:
            held = self._reserved.get(target, [])
            fits = [r for r in held if r[2] >= size]
            if not fits:
                return None
            best = min(fits, key=lambda r: r[2])
            held.remove(best)
            return best[0], best[1]

    def memory(self, key: tuple) -> np.ndarray:
        """The memory of a segment taken (:meth:`take`, :meth:`take_reserved`), uint8."""
        with self._lock:
            return np.frombuffer(self._maps[key][0], dtype=np.uint8)

    def take(self, target: str, segment_id: int, fd: int) -> tuple[tuple, np.ndarray]:
        """The segment's memory (uint8), mapped from ``fd`` (a checked memfd) unless
        kept, with its key; hand the key back with :meth:`give_back`."""
        info = os.fstat(fd)
        key = (target, segment_id, info.st_dev, info.st_ino)
        with self._lock:
            entry = self._maps.pop(key, None)
            if entry is None:
                try:
                    entry = [mmap.mmap(fd, info.st_size), 0, 0.0]  # MAP_SHARED, read/write
                except (OSError, ValueError) as error:
                    if getattr(error, "errno", None) in OWN_LIMITS:  # this side's shortage
                        raise BandFailed("error", f"this stage cannot map the segment "
                                         f"{target} lent: {error}") from None  # fmt: skip
                    raise BandFailed("bad ack", f"{target} lent a segment that cannot be "
                                     f"mapped for writing: {error}") from None  # fmt: skip
            entry[1] += 1
            self._maps[key] = entry
            return key, np.frombuffer(entry[0], dtype=np.uint8)

    def give_back(self, key: tuple, keep: bool = True) -> None:
        """Done with the memory :meth:`take` or :meth:`take_reserved` gave;
        ``keep=False``: let the mapping go once unused (its band failed)."""
        with self._lock:
            self._give_back(key, keep)
        self.tidy()

    def _give_back(self, key: tuple, keep: bool) -> None:
        entry = self._maps.get(key)
        if entry is not None:
            entry[1] -= 1
            entry[2] = self._clock()
            if not keep and not entry[1]:
                del self._maps[key]
                _unmap(entry[0])

    def tidy(self) -> None:
        """Let go of unused mappings over the bounds, of those idle for ``idle_s``, and
        of reservations older than ``RESERVED_USE_S`` (the receiver closes them)."""
        now = self._clock()
        with self._lock:
            for target, held in list(self._reserved.items()):
                for stale in [r for r in held if now - r[3] >= RESERVED_USE_S]:
                    held.remove(stale)
                    self._give_back(stale[0], keep=False)
                if not held:
                    del self._reserved[target]
            unused = [(k, e) for k, e in self._maps.items() if not e[1]]  # the oldest first
            kept = sum(len(e[0]) for _, e in unused)
            for n, (key, entry) in enumerate(unused):
                if (kept <= self.keep_bytes and len(unused) - n <= MAX_KEPT_MAPS
                        and now - entry[2] < self.idle_s):  # fmt: skip
                    continue
                kept -= len(entry[0])
                del self._maps[key]
                _unmap(entry[0])

    def __len__(self) -> int:
        return len(self._maps)


def _unmap(mapped: mmap.mmap) -> None:
    """Close a mapping; one an array still views goes with the last such array."""
    with contextlib.suppress(BufferError):
        mapped.close()
