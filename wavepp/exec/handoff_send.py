"""Each stage hands its band of a finished request's cache to a receiver (docs/handoff.md).

When a request that asked for a handoff ends on a stage, the stage keeps its blocks
leased — they stay protected in the pool, nothing is copied — and gives a
:class:`BandJob` to its :class:`HandoffSender`, a task beside the stage's LOOP. The
sender reads the band's tensors from the pool (a large band in a worker thread),
streams them to the receiver in WavePP's wire format (``wavepp.handoff.wire``), waits
for the receiver's acknowledgement and then releases the blocks through the stage's
callback — however the band ends: acknowledged, refused, timed out, disconnected or
cancelled — and only once the worker thread no longer reads them. Its
:class:`~wavepp.rounds.messages.HandoffOutcome` (the whole time since the last chunk, and
of it the time on the wire) goes to rank 0 at once (``on_settled``).

Memory: at most ``budget_bytes`` of bands are on their way at once per stage; a band
that does not fit waits its turn (its blocks stay in the pool) and one larger than the
whole budget goes alone. On a CPU stage the pool's rows go out without a copy; a tensor
without such buffers (a GPU stage's rows, a recurrent state) is copied to host memory,
sent and dropped before the next is read: one tensor (one layer's keys, values, latents
or state) at a time. ``timeout_s`` bounds a band from the request's
last chunk to the acknowledgement, the waits for the budget and for a thread included.
A band's I/O runs in a worker thread, at most ``BAND_THREADS`` at once, counted apart
from the threads of the rest of the process (the planes'): bands stuck on receivers that
stopped reading hold threads until their timeouts, and must not stall the waves. A CPU
stage's small bands (``inline_bytes``) go out from the event loop instead: for them the
thread hops cost more than the bytes.
A band from a worker thread to a Unix socket offers to write its payload into a segment
the receiver lends (``HandoffSettings.segments``, ``docs/handoff.md``): a memfd,
checked before a byte goes in, mapped here and the runs copied into it — one copy in
all, where the socket takes two (the sender's into the kernel, the receiver's out of
it). A receiver lends a stage the same segment again once its last band is taken, so
the mapping is kept (``SegmentMaps``) and its pages are not faulted in again. Each such
band also asks the receiver to reserve a segment for the stage's next band: a band with
a reservation in hand writes into it as it connects, with no answer to wait for before
the bytes go in — one round trip per band, not two.

A ``dir:`` target is a folder in vLLM's ``ExampleConnector`` layout
(``wavepp.handoff.vllm_example``): the stage writes one file per attention layer; the
band counts as delivered when its files are in place.
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import math
import mmap
import os
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import TypeVar

import anyio
import anyio.to_thread
import attrs
import numpy as np
import torch

from wavepp.exec import compute
from wavepp.handoff import _io, wire
from wavepp.rounds.messages import HandoffOutcome
from wavepp.state import RequestId, SlotId

T = TypeVar("T")
# Why a band failed, as the record and /metrics count them.
REASONS = ("timeout", "connect", "refused", "disconnected", "bad ack", "cancelled", "error")
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16",
               torch.float16: "float16", torch.int32: "int32"}  # fmt: skip


class BandFailed(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


@attrs.frozen
class BandTensor:
    """One tensor of a band: its place and shape now, its bytes when read."""

    layer: int  # global layer index; -1 for the request's token ids
    name: str  # "k", "v", "latent", "delta", "conv", "state", "tokens"
    dtype: str  # a wire dtype name
    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]  # a contiguous CPU tensor; runs in a worker thread
    # the same bytes as views of where they live, in order (a CPU stage's pool: one
    # view per run of rows), sent without a copy; None: send read()'s bytes
    pieces: Callable[[], Iterator[memoryview]] | None = None
    # read() may wait on other ranks (a TP band's shards): never on the event loop
    waits: bool = False

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * wire.DTYPES[self.dtype]


@attrs.frozen
class BandJob:
    """What a stage hands its sender when a request that hands off ends there."""

    request_id: RequestId
    target: str  # unix:/path, tcp://host:port or dir:/path (a peer's string: parsed here)
    num_tokens: int  # the whole prompt
    block_table: tuple[SlotId, ...]  # every block of the prompt, full or partial
    states: dict  # recurrent layer -> {part: state after the prompt's last token}
    tokens: np.ndarray | None  # stage 0: the prompt's token ids
    first_token: int = -1  # last stage: the first generated token
    top_logit: float = 0.0
    ended_at: float = attrs.field(factory=time.monotonic)  # the last chunk here, for timeouts
    ended_wall: float = attrs.field(factory=time.time)  # the same, wall clock (the record)


@attrs.frozen
class HandoffSettings:
    """One stage's handoff side, fixed for the run."""

    stage: int
    num_stages: int
    fingerprint: wire.Fingerprint  # the model this stage computes with
    timeout_s: float  # last chunk -> acknowledgement, per band
    budget_bytes: int  # bands on their way at once, bytes
    vllm_block_size: int = 16  # dir: targets, vLLM's block size (ExampleConnector layout)
    # bands of up to this many bytes go out from the event loop, without a worker thread
    # (0: never; a CPU stage's: INLINE_BYTES; a GPU stage's rows need copies to the host)
    inline_bytes: int = 0
    # a larger band to a unix: target offers to write its payload into a segment the
    # receiver lends (wire.FLAG_SEGMENT): one copy of the bytes instead of two
    segments: bool = False


class HandoffSender:
    def __init__(
        self, settings: HandoffSettings, band: Callable[[BandJob], Sequence[BandTensor]],
        release: Callable[[RequestId], None],
    ) -> None:  # fmt: skip
        """``band(job)``: the job's tensors, from the stage's executor. ``release(rid)``:
        called once per job when its band has ended, however it ended."""
        if sys.byteorder != "little":
            raise RuntimeError("the handoff wire format is little-endian; this host is not")
        self.settings = settings
        self._band = band
        self._release = release
        self._send_jobs, self._jobs = anyio.create_memory_object_stream[BandJob](math.inf)
        self._scopes: dict[RequestId, anyio.CancelScope] = {}
        self._cancelled: set[RequestId] = set()  # cancelled before their task started
        self._in_use = 0  # budget bytes held by bands on their way
        # the bands' own worker threads: a band stuck on a receiver that stopped reading
        # holds one until its timeout, and must not hold one the planes' threads need
        # (anyio's default limiter, shared by the whole process)
        self._threads = anyio.CapacityLimiter(BAND_THREADS)
        self._budget_freed = anyio.Event()
        self._maps = SegmentMaps(settings.budget_bytes)  # lent segments, kept mapped
        self.outcomes: list[HandoffOutcome] = []  # settled since the last take_outcomes()
        self.num_pending = 0  # jobs submitted and not settled
        # called (on the event loop) after each band settles: the runtime sends the
        # outcome on to rank 0 at once (wavepp.rounds.messages.HandoffRelay)
        self.on_settled: Callable[[], None] | None = None

    def submit(self, job: BandJob) -> None:
        self.num_pending += 1
        self._send_jobs.send_nowait(job)

    def cancel(self, rid: RequestId) -> None:
        """The request was cancelled: stop its band wherever it is. Its blocks are
        released as for any other end (the callback), once nothing reads them."""
        scope = self._scopes.get(rid)
        if scope is not None:
            scope.cancel()
        else:
            self._cancelled.add(rid)

    def take_outcomes(self) -> list[HandoffOutcome]:
        out, self.outcomes = self.outcomes, []
        return out

    async def run(self) -> None:
        """Serve jobs until cancelled (the run is over)."""
        async with anyio.create_task_group() as tg, self._jobs:
            tg.start_soon(self._tidy_maps)
            async for job in self._jobs:
                if job.request_id in self._cancelled:
                    self._cancelled.discard(job.request_id)
                    self._settle(job, "cancelled", "cancelled before its band left", 0)
                    continue
                scope = anyio.CancelScope()
                self._scopes[job.request_id] = scope
                tg.start_soon(self._one, job, scope)

    async def _tidy_maps(self) -> None:
        while True:
            await anyio.sleep(MAP_TIDY_S)
            self._maps.tidy()

    async def _one(self, job: BandJob, scope: anyio.CancelScope) -> None:
        reason, detail, sent = "", "", 0
        wire_s = [0.0]  # filled by the worker thread: connect to the ack (or its end)
        with scope:
            try:
                remaining = self.settings.timeout_s - (time.monotonic() - job.ended_at)
                with anyio.fail_after(max(remaining, 0.0)):
                    tensors = self._band(job)
                    size = sum(t.num_bytes for t in tensors)
                    held = min(size, self.settings.budget_bytes)
                    await self._acquire(held)
                    try:
                        sent = await self._deliver(job, tensors, wire_s)
                    finally:
                        self._in_use -= held
                        self._budget_freed.set()  # every waiter looks again
                        self._budget_freed = anyio.Event()
            except TimeoutError:
                reason = "timeout"
                detail = f"not acknowledged within {self.settings.timeout_s:g} s"
            except BandFailed as failure:
                reason, detail = failure.reason, failure.detail
            except Exception as error:
                reason, detail = "error", f"{type(error).__name__}: {error}"
        if scope.cancelled_caught:
            reason, detail = "cancelled", "the request was cancelled during its handoff"
        self._scopes.pop(job.request_id, None)
        self._settle(job, reason, detail, sent, wire_s[0])

    def _settle(self, job: BandJob, reason: str, detail: str, sent: int,
                wire_s: float = 0.0) -> None:  # fmt: skip
        self.num_pending -= 1
        self._release(job.request_id)
        seconds = max(time.monotonic() - job.ended_at, 0.0)
        self.outcomes.append(HandoffOutcome(job.request_id, self.settings.stage, not reason,
                                            reason, detail[:1024], sent, seconds,
                                            job.ended_wall, min(wire_s, seconds)))  # fmt: skip
        if self.on_settled is not None:
            self.on_settled()

    async def _acquire(self, num_bytes: int) -> None:
        while self._in_use and self._in_use + num_bytes > self.settings.budget_bytes:
            await self._budget_freed.wait()
        self._in_use += num_bytes

    async def _deliver(self, job: BandJob, tensors: Sequence[BandTensor],
                       wire_s: list[float]) -> int:  # fmt: skip
        try:
            address = wire.parse_address(job.target)
        except ValueError as error:
            raise BandFailed("error", str(error)) from None
        if address.kind == "dir":
            return await self._write_files(job, Path(address.path), tensors)
        header = wire.BandHeader(
            request_id=job.request_id, stage=self.settings.stage,
            num_stages=self.settings.num_stages, fingerprint=self.settings.fingerprint,
            layers=sorted({t.layer for t in tensors if t.layer >= 0}),
            num_tokens=job.num_tokens,
            tensors=[wire.TensorSpec(t.layer, t.name, t.dtype, list(t.shape), t.num_bytes)
                     for t in tensors],
            first_token=job.first_token, top_logit=job.top_logit,
        )  # fmt: skip
        if self._inline(tensors):
            prefix = wire.encode_band_prefix(header)
            ack = await _exchange_inline(address, prefix, tensors, job.target, wire_s)
            return self._check_ack(job, ack, tensors)
        offer = self.settings.segments and address.kind == "unix"
        ack = await self._over_socket(job, address, header, tensors, wire_s, offer, offer)
        return self._check_ack(job, ack, tensors)

    async def _over_socket(self, job: BandJob, address: wire.Address, header: wire.BandHeader,
                           tensors: Sequence[BandTensor], wire_s: list[float],
                           offer: bool, reserve: bool) -> wire.Ack:  # fmt: skip
        """The band's exchange from a worker thread; with ``offer``, into a segment the
        receiver lends, if it does; with ``reserve`` too, into the segment reserved for
        this band if one is in hand, and asking for one for the next."""
        plan = None
        if offer:
            offsets, size = wire.payload_layout(header)
            plan = SegmentPlan(self._maps, offsets, reserve,
                               self._maps.take_reserved(job.target, size) if reserve else None)
        flags = wire.FLAG_RESERVE if reserve else 0  # reserve: only with offer
        if plan is not None and plan.reserved is not None:
            prefix = wire.encode_band_prefix(header, flags | wire.FLAG_RESERVED,
                                             plan.reserved[1])  # fmt: skip
        else:
            prefix = wire.encode_band_prefix(header, flags | (wire.FLAG_SEGMENT if offer else 0))
        sock = socket.socket(socket.AF_UNIX if address.kind == "unix" else socket.AF_INET6
                             if ":" in address.host else socket.AF_INET)  # fmt: skip
        deadline = job.ended_at + self.settings.timeout_s
        claim, finished = threading.Lock(), threading.Event()
        try:
            # One worker thread does the band's whole I/O with blocking calls: scatter-
            # gather sends straight from the pool's blocks, no copy in between. A cancel
            # or the timeout shuts the socket, which ends the thread's blocking calls.
            ack = await anyio.to_thread.run_sync(_send_band, sock, address, prefix, tensors,
                                                 plan, deadline, job.target, wire_s,
                                                 claim, finished, abandon_on_cancel=True,
                                                 limiter=self._threads)  # fmt: skip
        finally:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            if claim.acquire(blocking=False):
                # cancelled or timed out before the thread began (waiting for a thread,
                # or queued): it never will touch the band; the socket is ours to close
                sock.close()
                if plan is not None and plan.reserved is not None:
                    self._maps.give_back(plan.reserved[0], keep=False)
            else:
                # the thread began: the blocks stay held until it has stopped reading
                # them (the shut socket ends it at once; a connect still waiting ends by
                # the band's deadline). Polled: a wait in a thread would need a token
                # from the limiter whose every thread may be this stuck.
                with anyio.CancelScope(shield=True):
                    while not finished.is_set():
                        await anyio.sleep(FINISH_POLL_S)
        return ack

    def _inline(self, tensors: Sequence[BandTensor]) -> bool:
        """A small band whose bytes are views of the pool (or small copies, such as
        recurrent states): out from the event loop, which spares the thread hops —
        most of a small band's cost. Nothing reads the pool once a send has returned."""
        size = sum(t.num_bytes for t in tensors)
        return size <= self.settings.inline_bytes and all(
            t.pieces is not None or (t.num_bytes <= INLINE_COPY_BYTES and not t.waits)
            for t in tensors)  # fmt: skip

    def _check_ack(self, job: BandJob, ack: wire.Ack, tensors: Sequence[BandTensor]) -> int:
        if ack.request_id != job.request_id or ack.stage != self.settings.stage:
            raise BandFailed("bad ack", f"{job.target} acknowledged {ack.request_id!r} stage "
                             f"{ack.stage}, not {job.request_id!r} stage "
                             f"{self.settings.stage}")  # fmt: skip
        if not ack.ok:
            raise BandFailed("refused", ack.error or "the receiver refused the band")
        return sum(t.num_bytes for t in tensors)

    async def _write_files(self, job: BandJob, folder: Path,
                           tensors: Sequence[BandTensor]) -> int:  # fmt: skip
        from wavepp.handoff import vllm_example

        by_layer: dict[int, dict[str, BandTensor]] = {}
        for tensor in tensors:
            if tensor.layer >= 0:
                by_layer.setdefault(tensor.layer, {})[tensor.name] = tensor
        written = 0
        block = self.settings.vllm_block_size
        # vLLM reads one folder or two (the prompt alone, or with its first token): each
        # gets its own rows, in <staging>/<tokens>/; rank 0 renames them into place
        lengths = vllm_example.folder_lengths(job.num_tokens, block)
        for layer, parts in sorted(by_layer.items()):
            if set(parts) != {"k", "v"}:
                raise BandFailed("error", f"layer {layer} holds {sorted(parts)}: the vLLM "
                                 "example layout takes attention layers' keys and values only")
            k = await anyio.to_thread.run_sync(_serial, parts["k"].read, limiter=self._threads)
            v = await anyio.to_thread.run_sync(_serial, parts["v"].read, limiter=self._threads)
            for n in lengths:
                write = partial(vllm_example.write_layer, folder / str(n), layer, k[:n], v[:n],
                                block)  # fmt: skip
                await anyio.to_thread.run_sync(_serial, write, limiter=self._threads)
            written += parts["k"].num_bytes + parts["v"].num_bytes
        return written


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"{dtype} has no handoff wire name")
    return DTYPE_NAMES[dtype]


def pool_rows(block_table: Sequence[int], block_size: int, num_tokens: int) -> torch.Tensor:
    """The pool rows of tokens 0..num_tokens-1 of a request with this block table."""
    num_blocks = -(-num_tokens // block_size)
    if len(block_table) < num_blocks:
        raise ValueError(f"block table of {len(block_table)} blocks for {num_tokens} tokens")
    slots = torch.as_tensor(list(block_table[:num_blocks]), dtype=torch.long)
    rows = slots[:, None] * block_size + torch.arange(block_size)
    return rows.reshape(-1)[:num_tokens]


IOV_MAX = 1024  # buffers per sendmsg call (Linux)
BAND_THREADS = 8  # a stage's bands on their way in worker threads at once
INLINE_BYTES = 1 << 20  # a CPU stage's bands up to this size skip the worker thread
# ...if each tensor not in the pool is at most this: copies of at most torch's grain size
# (32,768 elements of 2 bytes or more), which start no OpenMP team on the loop's thread
# (wavepp.exec.compute)
INLINE_COPY_BYTES = 64 << 10
FINISH_POLL_S = 0.005  # a given-up band's wait for its thread to stop reading the pool
SOCKET_BUFFER = 4 << 20  # bytes asked for the band's send buffer


def _serial(fn: Callable[[], T]) -> T:
    """``fn()`` in a worker thread without an OpenMP team of its own
    (``wavepp.exec.compute.serial_here``)."""
    compute.serial_here()
    return fn()


@attrs.define(eq=False)
class SegmentPlan:
    """How a band to a Unix socket goes into segments: made on the event loop, then
    the band's worker thread's."""

    maps: SegmentMaps  # where lent segments stay mapped
    offsets: list[int]  # each tensor's place in a segment (wire.payload_layout)
    # FLAG_RESERVE: a reservation for the next band comes before the ack (until it has)
    awaiting: bool
    # (SegmentMaps key, segment id): the segment reserved for this band (FLAG_RESERVED);
    # whoever uses or drops it sets None
    reserved: tuple[tuple, int] | None


def _send_band(
    sock: socket.socket, address: wire.Address, prefix: bytes,
    tensors: Sequence[BandTensor], plan: SegmentPlan | None, deadline: float, target: str,
    wire_s: list[float], claim: threading.Lock, finished: threading.Event,
) -> wire.Ack | None:  # fmt: skip
    """A band's whole exchange with blocking calls (in a worker thread): connect, the
    prefix and header, every tensor's bytes (into a segment, at its offset in ``plan``:
    the one reserved for this band, or one the receiver lends when the prefix offered),
    the acknowledgement. Takes ``claim`` first:
    if the event loop took it (the band was given up before this thread began), returns
    None at once, touching nothing. Otherwise owns ``sock`` and the plan's reserved
    segment; sets ``wire_s[0]`` to its seconds from connect to the ack (or to its
    failure) and ``finished`` when it no longer touches the band's tensors."""
    if not claim.acquire(blocking=False):
        return None
    started = time.perf_counter()
    compute.serial_here()  # a TP band's shards are put together here: no OpenMP team
    try:
        return _exchange(sock, address, prefix, tensors, plan, deadline, target)
    finally:
        if plan is not None and plan.reserved is not None:  # failed before using it
            plan.maps.give_back(plan.reserved[0], keep=False)
        wire_s[0] = time.perf_counter() - started
        finished.set()


def _exchange(
    sock: socket.socket, address: wire.Address, prefix: bytes,
    tensors: Sequence[BandTensor], plan: SegmentPlan | None, deadline: float, target: str,
) -> wire.Ack:  # fmt: skip
    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        return remaining

    with sock:
        with contextlib.suppress(OSError):  # fewer, larger transfers (capped by the kernel)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        where = address.path if address.kind == "unix" else (address.host, address.port)
        while True:
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
            if plan is not None and plan.reserved is not None:
                # written while the receiver reads the header: no answer to wait for
                sock.sendall(prefix)
                key, plan.reserved = plan.reserved[0], None
                ack = _into_segment(sock, plan, key, tensors, target, left, reserved=True)
                if ack is not None:
                    return ack
                sock.settimeout(None)
                views = []  # the receiver did not hold it: the payload follows on the socket
            elif plan is not None:  # offered to write into a segment: the answer first
                sock.sendall(prefix)
                sock.settimeout(left())
                lent = _take_segment(sock, target)
                sock.settimeout(None)
                if isinstance(lent, wire.Ack):  # the band was refused
                    return lent
                if lent is not None:
                    fd, segment_id = lent
                    try:
                        key, _ = plan.maps.take(target, segment_id, fd)
                    finally:
                        os.close(fd)
                    return _into_segment(sock, plan, key, tensors, target, left)
                views = []  # declined: the payload follows on the socket
            for tensor in tensors:
                if tensor.pieces is not None:  # views of the pool's runs, no copy
                    for piece in tensor.pieces():
                        views.append(piece)
                        if len(views) == IOV_MAX:
                            _sendmsg_all(sock, views)
                            views = []
                    continue
                # a copy in host memory: out before the next tensor is read, so one
                # tensor's bytes at a time (one flat run: an n-D view would slice by rows)
                _sendmsg_all(sock, views)
                views = [tensor.read().reshape(-1).view(torch.uint8).numpy().data]
            _sendmsg_all(sock, views)
            del views
        except TimeoutError:
            raise
        except OSError as error:
            # A receiver that refuses a band may answer and close before reading it all:
            # its answer says why.
            ack = None
            with contextlib.suppress(OSError, BandFailed, TimeoutError):
                sock.settimeout(min(1.0, left()))
                ack = _final_answer(sock, target, plan)
            if ack is not None and not ack.ok:
                raise BandFailed("refused", ack.error) from None
            raise BandFailed("disconnected", f"{target} closed the connection while the band "
                             f"was sent ({error or type(error).__name__})") from None  # fmt: skip
        sock.settimeout(left())
        return _final_answer(sock, target, plan)


def _into_segment(sock: socket.socket, plan: SegmentPlan, key: tuple,
                  tensors: Sequence[BandTensor], target: str, left: Callable[[], float],
                  reserved: bool = False) -> wire.Ack | None:  # fmt: skip
    """Write the band into the segment ``key`` names, say so (``DONE_MAGIC``) and
    return the receiver's ack; None where the segment was ``reserved`` and the receiver
    answers that it no longer holds it (the payload then goes on the socket). The
    segment is handed back, its mapping kept only if the band was taken."""
    ack = None
    try:
        _write_segment(plan.maps.memory(key), tensors, plan.offsets)
        sock.sendall(wire.DONE_MAGIC)
        sock.settimeout(left())
        ack = _final_answer(sock, target, plan, reserved)
        return ack
    finally:
        plan.maps.give_back(key, keep=ack is not None and ack.ok)


def _final_answer(sock: socket.socket, target: str, plan: SegmentPlan | None,
                  may_decline: bool = False) -> wire.Ack | None:  # fmt: skip
    """The receiver's answers once the payload is in: a reservation for the next band
    where the plan awaits one (kept in the plan's maps), then the ack — or, with
    ``may_decline``, a segment answer of size 0 (None: the reserved segment was not
    held, the payload goes on the socket)."""
    if plan is None or not (plan.awaiting or may_decline):
        return _read_ack(sock, target)
    while True:
        expect = [wire.ACK_MAGIC]
        expect += [wire.RESERVE_MAGIC] if plan.awaiting else []
        expect += [wire.SEGMENT_MAGIC] if may_decline else []
        answer = _read_answer(sock, target, expect)
        if isinstance(answer, wire.Ack):
            return answer
        magic, lent = answer
        if magic == wire.SEGMENT_MAGIC:
            if lent is not None:
                os.close(lent[0])
                raise BandFailed("bad ack", f"{target} lent a segment for a band already "
                                 "written into the one it reserved")  # fmt: skip
            return None
        plan.awaiting = False
        if lent is not None:
            try:
                plan.maps.reserve(target, lent[1], lent[0])
            finally:
                os.close(lent[0])


MAX_FDS = 4  # files a segment answer may carry before it is refused as garbage
MAX_KEPT_MAPS = 8  # lent segments kept mapped unused, at most
MAP_IDLE_S = 300.0  # and each for this long since its last band
MAP_TIDY_S = 5.0  # how often a stage looks for idle ones
# a segment reserved for a band is used within this long of its arrival, or let go: well
# inside the receiver's hold on it (wavepp.handoff.receive.RESERVATION_S, 30 s)
RESERVED_USE_S = 10.0
MAX_RESERVED_MAPS = 8  # segments reserved for this stage, per target, held at once
SEGMENT_SEALS = ("F_SEAL_SHRINK", "F_SEAL_GROW")  # a lent memfd's size cannot change
# a mapping that fails for these is this process's shortage, not the receiver's fault
OWN_LIMITS = (errno.ENOMEM, errno.EMFILE, errno.ENFILE, errno.EAGAIN)


def _take_segment(sock: socket.socket, target: str) -> tuple[int, int] | wire.Ack | None:
    """The receiver's answer to a segment offer: the lent memfd (a descriptor this
    thread owns) and the segment's id, None (declined: the payload goes on the socket),
    or its ack (the band was refused). The file is checked: a sealed memfd of the size
    the answer says."""
    answer = _read_answer(sock, target, [wire.SEGMENT_MAGIC, wire.ACK_MAGIC])
    return answer if isinstance(answer, wire.Ack) else answer[1]


def _read_answer(sock: socket.socket, target: str, expect: Sequence[bytes],
                 ) -> wire.Ack | tuple[bytes, tuple[int, int] | None]:  # fmt: skip
    """The receiver's next message, one of ``expect``: an ack, or a segment answer or
    reservation — its magic and the lent memfd (a descriptor the caller owns, checked:
    a sealed memfd of the size the answer says) with the segment's id, or None (size 0:
    none lent)."""
    data, fds = bytearray(), []
    try:
        _recv_passing(sock, data, 4, fds, target)
        magic = bytes(data)
        if magic not in expect:
            raise BandFailed("bad ack", f"{target} answered garbage: {magic!r} where it "
                             f"answers {' or '.join(map(repr, expect))}")  # fmt: skip
        if magic == wire.ACK_MAGIC:
            rest = _recv_exactly(sock, wire.ACK_PREFIX_BYTES - 4, target)
            try:
                return wire.decode_ack(_recv_exactly(sock, wire.ack_length(magic + rest),
                                                     target))  # fmt: skip
            except wire.WireError as error:
                raise BandFailed("bad ack", f"{target} answered garbage: {error}") from None
        _recv_passing(sock, data, wire.SEGMENT_BYTES, fds, target)
        try:
            size, segment_id = wire.parse_segment(bytes(data), magic)
        except wire.WireError as error:
            raise BandFailed("bad ack", f"{target} answered garbage: {error}") from None
        if size == 0 and not fds:
            return magic, None
        if size == 0 or len(fds) != 1:
            raise BandFailed("bad ack", f"{target} lent {len(fds)} files for a segment of "
                             f"{size} bytes")  # fmt: skip
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


def _recv_passing(sock: socket.socket, data: bytearray, n: int, fds: list[int],
                  target: str) -> None:  # fmt: skip
    """Read into ``data`` until it holds ``n`` bytes, every file passed alongside
    appended to ``fds`` (the caller closes those it does not keep)."""
    while len(data) < n:
        chunk, ancillary, flags, _ = sock.recvmsg(n - len(data), socket.CMSG_SPACE(MAX_FDS * 4),
                                                  socket.MSG_CMSG_CLOEXEC)  # fmt: skip
        for level, kind, raw in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                passed = array.array("i")
                passed.frombytes(raw[: len(raw) - len(raw) % passed.itemsize])
                fds.extend(passed)
        if flags & socket.MSG_CTRUNC:  # too many files, or none could be taken here
            raise BandFailed("bad ack", f"{target} passed more than {MAX_FDS} files, or this "
                             "stage is at its limit of open files")  # fmt: skip
        if not chunk:
            raise BandFailed("disconnected", f"{target} closed the connection before "
                             "answering the segment offer")  # fmt: skip
        data += chunk


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
        if tensor.pieces is not None:
            views = tensor.pieces()
        else:
            views = [tensor.read().reshape(-1).view(torch.uint8).numpy().data]
        for view in views:
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
    (the receiver closes a segment free for 5 minutes: ``wavepp.handoff.receive``). A band
    that failed lets its mapping go.
    Segments reserved for this stage's next bands are held here too,
    mapped, until a band takes one (:meth:`take_reserved`) or ``RESERVED_USE_S`` has
    passed.
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


async def _exchange_inline(
    address: wire.Address, prefix: bytes, tensors: Sequence[BandTensor], target: str,
    wire_s: list[float],
) -> wire.Ack:  # fmt: skip
    """A small band's exchange on the event loop (non-blocking socket): connect, the
    band's buffers through ``sendmsg``, the acknowledgement. Sets ``wire_s[0]`` as
    ``_send_band`` does. The caller's deadline (a cancel scope) bounds every wait."""
    started = time.perf_counter()
    try:
        try:
            conn = await _io.connect(address, math.inf)
        except OSError as error:
            raise BandFailed("connect", f"cannot connect to {target}: {error}") from None
        try:
            # the whole band in the send buffer at once, where the kernel allows: one
            # sendmsg, not one wakeup of this loop (and of the receiver) per default
            # buffer's worth
            with contextlib.suppress(OSError):
                conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
            views = [memoryview(prefix)]
            for tensor in tensors:
                if tensor.pieces is not None:
                    views.extend(tensor.pieces())
                else:
                    views.append(tensor.read().reshape(-1).view(torch.uint8).numpy().data)
            try:
                await _sendmsg_all_async(conn.sock, views)
            except OSError as error:
                ack = None  # a refusing receiver may answer and close before reading all
                with contextlib.suppress(OSError, BandFailed, TimeoutError):
                    with anyio.fail_after(1.0):
                        ack = await _read_ack_async(conn, target)
                if ack is not None and not ack.ok:
                    raise BandFailed("refused", ack.error) from None
                raise BandFailed("disconnected", f"{target} closed the connection while the "
                                 f"band was sent ({error or type(error).__name__})") from None
            del views
            return await _read_ack_async(conn, target)
        finally:
            conn.close()
    finally:
        wire_s[0] = time.perf_counter() - started


async def _sendmsg_all_async(sock: socket.socket, views: list[memoryview]) -> None:
    queue = [memoryview(v).cast("B") for v in views if v.nbytes]
    first = 0
    while first < len(queue):
        try:
            sent = sock.sendmsg(queue[first : first + IOV_MAX])
        except BlockingIOError:
            await anyio.wait_writable(sock)
            continue
        first = _step(queue, first, sent)


async def _read_ack_async(conn: _io.Connection, target: str) -> wire.Ack:
    try:
        length = wire.ack_length(await conn.read_exactly(wire.ACK_PREFIX_BYTES))
        return wire.decode_ack(await conn.read_exactly(length))
    except wire.WireError as error:
        raise BandFailed("bad ack", f"{target} answered garbage: {error}") from None
    except ConnectionError as error:
        raise BandFailed("disconnected", f"{target} closed the connection before "
                         f"acknowledging ({type(error).__name__})") from None  # fmt: skip


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


def _sendmsg_all(sock: socket.socket, views: list[memoryview]) -> None:
    queue = [memoryview(v).cast("B") for v in views if v.nbytes]
    first = 0  # an index, not pops from the front: a 32K-token band has 16K buffers
    while first < len(queue):
        first = _step(queue, first, sock.sendmsg(queue[first : first + IOV_MAX]))


def _recv_exactly(sock: socket.socket, n: int, target: str) -> bytes:
    data = bytearray(n)
    view, got = memoryview(data), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise BandFailed("disconnected", f"{target} closed the connection before "
                             "acknowledging")  # fmt: skip
        got += k
    return bytes(data)


def _read_ack(sock: socket.socket, target: str) -> wire.Ack:
    try:
        length = wire.ack_length(_recv_exactly(sock, wire.ACK_PREFIX_BYTES, target))
        return wire.decode_ack(_recv_exactly(sock, length, target))
    except wire.WireError as error:
        raise BandFailed("bad ack", f"{target} answered garbage: {error}") from None
    except ConnectionError as error:
        raise BandFailed("disconnected", f"{target} closed the connection before "
                         f"acknowledging ({type(error).__name__})") from None  # fmt: skip
