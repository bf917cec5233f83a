"""Memory for bands a receiver takes: one buffer per band, recycled, its tensors views
into it (``wavepp.handoff.receive``). A buffer is heap memory, or a segment — a memfd
lent to the sender on this host that writes the band into it (``wavepp.handoff.lending``).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import time
import weakref
from collections import deque
from collections.abc import Callable, Hashable

import attrs
import numpy as np
import torch

from wavepp.handoff.base import DTYPE_NAMES
from wavepp.handoff.wire import BandHeader

TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "int32": np.int32}
MAX_SEGMENTS = 64  # segments open at once (two descriptors each: the memfd, its mapping's)
SEGMENT_BYTES = 1 << 30  # their bytes at most (lent, in use or kept)
SEGMENT_IDLE_S = 300.0  # a kept segment free this long is closed


@attrs.define(eq=False)
class Memory:
    """A band buffer: heap memory, or a segment (a memfd mapped here, ``fd`` >= 0)."""

    array: np.ndarray  # uint8, all of it
    fd: int = -1
    segment_id: int = 0  # a segment's name to its sender: random, never reused
    # a segment whose sender did not say it was done: it may still be writing into it,
    # so it is closed once free, never lent again
    spoiled: bool = False
    _closer: weakref.finalize | None = attrs.field(default=None, repr=False)

    @classmethod
    def segment(cls, size: int) -> Memory:
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
        self._free: list[tuple[Hashable | None, Memory, float]] = []
        self._free_bytes = 0  # heap memory kept
        self._returned: deque[tuple[Hashable | None, Memory]] = deque()  # by finalizers
        self.closed = False  # by close(): a segment returned after it is closed at once

    def take(self, size: int) -> torch.Tensor:
        """``size`` bytes (uint8, contents undefined), back here once unreferenced."""
        taken = self._take(size, None)
        assert taken is not None  # heap memory is never refused
        return taken[0]

    def lend(self, size: int, peer: Hashable,
             whole: bool = False) -> tuple[torch.Tensor, Memory] | None:  # fmt: skip
        """As :meth:`take`, in a segment for the process ``peer`` (a memfd, with its
        ``fd``; ``whole``: the tensor is all of it, not its first ``size`` bytes); None
        when no kept segment of ``peer``'s fits and a new one would open more than
        ``segment_bytes`` or ``max_segments``."""
        return self._take(size, peer, whole)

    def _take(self, size: int, peer: Hashable | None,
              whole: bool = False) -> tuple[torch.Tensor, Memory] | None:  # fmt: skip
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
                memory = Memory(np.empty(size, dtype=np.uint8))
            elif (self.num_segments >= self.max_segments
                  or self.open_segment_bytes + size > self.segment_bytes):  # fmt: skip
                return None
            else:
                memory = Memory.segment(size)
                self.num_segments += 1
                self.open_segment_bytes += size
        # a view of its own (the tensors' owner): collected when the last tensor goes
        view = memory.array[: memory.array.nbytes if whole else size]
        weakref.finalize(view, self._give_back, (peer, memory)).atexit = False
        return torch.from_numpy(view), memory

    def _give_back(self, item: tuple[Hashable | None, Memory]) -> None:
        """A buffer no tensor views any more (a finalizer: on any thread)."""
        if self.closed and item[1].fd >= 0:  # no band will take it
            self._close_segment(item[1])
        else:
            self._returned.append(item)

    def _close_segment(self, memory: Memory) -> None:
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


def views(buffer: torch.Tensor, header: BandHeader,
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

