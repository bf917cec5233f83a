"""Both planes over ``torch.distributed`` (DESIGN §3, §10), for ranks on any hosts.

- **Rounds plane**: collectives on the default (world) Gloo group, used by one task at a
  time (the WAVE task, or rank 0's LOOP under R1, serialized by a lock). The same group
  carries the start-up agreement on which planes to use.
- **Data plane**: one two-rank group per link ``s -> s+1`` (and ``P-1 -> 0`` for
  completions), made only when the run's data plane is Gloo. On each rank a link is used
  by exactly one sender or one receiver, so no group ever has two concurrent users (two
  threads on one Gloo group deadlock).

Gloo point-to-point cannot be polled and a blocking call inside a coroutine would
stall the event loop, so every blocking call runs in a worker thread
(``anyio.to_thread.run_sync``) while the loop keeps serving the other plane. The
threads are abandoned on cancellation: a rank that fails does not wait for a peer.
"""

from __future__ import annotations

import datetime
import os
import threading
from collections.abc import Callable, Sequence

import anyio
import anyio.to_thread
import numpy as np
import torch
import torch.distributed as dist

from wavepp.rounds.trace import NO_TRACE, RoundTrace
from wavepp.transport.base import no_status, plane_error
from wavepp.transport.frames import (
    HEADER_WORDS,
    INLINE_MIN_BYTES,
    DataLimits,
    Header,
    check_broadcast_length,
    inline_after,
    make_header,
    parse_header,
)

_BIT_SHIFTS = np.arange(64, dtype=np.uint64)


def _bytes_tensor(payload: bytes) -> torch.Tensor:
    return (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if payload
        else torch.empty(0, dtype=torch.uint8)
    )


class GlooRoundsPlane:
    """Rounds-plane collectives over a Gloo group, each in a worker thread.

    A broadcast is one collective of a buffer holding the payload's length and its
    first ``inline`` bytes; only a longer payload pays a second one for the rest. The
    room grows with the longest payload seen (rank 0's rounds), on every rank alike.
    ``on_wait`` hears what the rank waits on (the watchdog's status).
    """

    kind = "gloo"

    def __init__(
        self, group: dist.ProcessGroup, rank: int, world_size: int,
        on_wait: Callable[[str], None] = no_status, trace: RoundTrace | None = None,
    ) -> None:  # fmt: skip
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.on_wait = on_wait
        self.trace = trace or NO_TRACE  # where a round's steps are timed (wavepp.rounds.trace)
        self.lock = anyio.Lock(fast_acquire=True)  # no yield when free: rounds are on the clock
        self.inline = INLINE_MIN_BYTES  # payload bytes the next broadcast carries at once

    async def _run(self, fn, what: str = "a collective"):
        self.on_wait(f"waiting on the rounds plane ({what}, all ranks)")
        try:
            return await anyio.to_thread.run_sync(fn, abandon_on_cancel=True)
        except RuntimeError as error:
            raise plane_error(f"rounds plane {what}", error) from None
        finally:
            self.on_wait("running")

    async def broadcast(self, payload: bytes | None) -> bytes:
        def work() -> bytes:
            inline = self.inline
            buf = torch.zeros(8 + inline, dtype=torch.uint8)
            if self.rank == 0:
                assert payload is not None
                head = payload[:inline]
                buf[:8] = _bytes_tensor(len(payload).to_bytes(8, "little"))
                buf[8 : 8 + len(head)] = _bytes_tensor(head)
            dist.broadcast(buf, src=0, group=self.group)
            n = int.from_bytes(buf[:8].numpy().tobytes(), "little")
            check_broadcast_length(n)
            data = buf[8 : 8 + min(n, inline)].numpy().tobytes()
            if n > inline:
                rest = (
                    _bytes_tensor(payload[inline:])  # type: ignore[index]
                    if self.rank == 0
                    else torch.empty(n - inline, dtype=torch.uint8)
                )
                dist.broadcast(rest, src=0, group=self.group)
                data += rest.numpy().tobytes()
            self.inline = inline_after(inline, n)
            return data

        data = await self._run(work, "broadcast from rank 0")
        self.trace.opened()
        self.trace.mark("bcast_sent" if self.rank == 0 else "bcast_recv")
        return data

    async def _reduce(self, values: Sequence[int], op, label: str) -> list[int]:
        if not values:
            return []

        def work() -> list[int]:
            t = torch.tensor(list(values), dtype=torch.int64)
            dist.all_reduce(t, op=op, group=self.group)
            return t.tolist()

        return await self._run(work, f"all_reduce {label}")

    async def all_min(self, values: Sequence[int]) -> list[int]:
        return await self._reduce(values, dist.ReduceOp.MIN, "MIN")

    async def all_reduce(
        self, mins: Sequence[int], ands: Sequence[int] = ()
    ) -> tuple[list[int], list[int]]:
        """MIN of ``mins`` and AND of ``ands`` in one collective: each AND value travels as
        its 64 bits, 0 or 1, whose MIN is their AND."""
        if not ands:
            return await self.all_min(mins), []
        words = np.asarray(ands, dtype=np.int64).view(np.uint64)
        bits = ((words[:, None] >> _BIT_SHIFTS) & np.uint64(1)).astype(np.int64).ravel()
        got = await self._reduce([*mins, *bits.tolist()], dist.ReduceOp.MIN, "MIN + AND")
        anded = np.asarray(got[len(mins) :], dtype=np.uint64).reshape(len(ands), 64)
        words = (anded << _BIT_SHIFTS).sum(axis=1, dtype=np.uint64)
        return got[: len(mins)], words.view(np.int64).tolist()

    async def all_and(self, values: Sequence[int]) -> list[int]:
        return await self._reduce(values, dist.ReduceOp.BAND, "AND")

    async def gather(self, payload: bytes) -> list[bytes] | None:
        def work() -> list[bytes] | None:
            size = torch.tensor([len(payload)], dtype=torch.int64)
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
            dist.all_gather(sizes, size, group=self.group)
            longest = max(int(s.item()) for s in sizes)
            buf = torch.zeros(longest, dtype=torch.uint8)
            buf[: len(payload)] = _bytes_tensor(payload)
            bufs = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self.world_size)]
            dist.all_gather(bufs, buf, group=self.group)
            if self.rank != 0:
                return None
            return [b[: int(s.item())].numpy().tobytes() for b, s in zip(bufs, sizes, strict=True)]

        self.trace.write()  # the run's last operation on this plane
        return await self._run(work, "gather of stage reports")


class GlooLink:
    """One direction of the data plane over ``torch.distributed`` pair groups.

    The header and the descriptor bytes travel on ``group`` (Gloo); the tensor on
    ``tensor_group`` — NCCL on its own CUDA stream when ``device`` is a GPU, Gloo on CPU,
    the same code either way. A lock per direction keeps each message's three parts
    together, so concurrent callers never interleave them. Every header is checked by
    :func:`~wavepp.transport.frames.parse_header` before anything is allocated.
    """

    kind = "gloo"

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        src: int,
        dst: int,
        limits: DataLimits | None = None,
        tensor_group: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.group = group
        self.tensor_group = tensor_group if tensor_group is not None else group
        self.src = src
        self.dst = dst
        self.limits = limits or DataLimits()
        self.device = device or torch.device("cpu")
        # NCCL moves device tensors on a stream of their own; over Gloo a CUDA tensor is
        # staged through host memory (one GPU shared by several ranks).
        nccl = tensor_group is not None and dist.get_backend(tensor_group) == "nccl"
        self.stream = torch.cuda.Stream(self.device) if nccl else None
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()

    def set_limits(self, limits: DataLimits) -> None:
        self.limits = limits

    # -- the transport (overridden by tests that play a peer) --------------------------

    def _send(self, tensor: torch.Tensor, group) -> None:
        dist.send(tensor, self.dst, group=group)

    def _recv(self, tensor: torch.Tensor, group) -> None:
        dist.recv(tensor, self.src, group=group)

    # -- messages ----------------------------------------------------------------------

    def send_blocking(self, descriptor: bytes, tensor: torch.Tensor | None) -> None:
        header = torch.tensor(make_header(self.src, descriptor, tensor), dtype=torch.int64)
        with self._send_lock:
            try:
                self._send(header, self.group)
                self._send(_bytes_tensor(descriptor), self.group)
                if tensor is not None and tensor.numel():
                    self._send_tensor(tensor)
            except RuntimeError as error:  # the peer gone: the watchdog names it
                raise plane_error(f"sending to rank {self.dst}", error) from None

    def _send_tensor(self, tensor: torch.Tensor) -> None:
        if self.stream is None:
            self._send(tensor.cpu().contiguous(), self.tensor_group)
            return
        tensor = tensor.to(self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            tensor = tensor.contiguous()
            self._send(tensor, self.tensor_group)
        self.stream.synchronize()  # the caller may reuse the tensor once this returns

    def recv_blocking(self, max_bytes: int | None = None) -> tuple[bytes, torch.Tensor | None]:
        with self._recv_lock:
            try:
                words = torch.zeros(HEADER_WORDS, dtype=torch.int64)
                self._recv(words, self.group)
                header = parse_header(words.tolist(), self.src, self.limits, max_bytes)
                desc = torch.empty(header.descriptor_bytes, dtype=torch.uint8)
                self._recv(desc, self.group)
                tensor = None
                if header.dtype is not None:
                    tensor = self._recv_tensor(header)
            except RuntimeError as error:  # a bad header stays itself (plane_error)
                raise plane_error(f"receiving from rank {self.src}", error) from None
        return desc.numpy().tobytes(), tensor

    @torch.inference_mode()
    def _recv_tensor(self, header: Header) -> torch.Tensor:
        """An inference tensor, like the sender's executor output: a plain tensor carries
        another dispatch key, and a compiled stage would recompile for it at the first
        wave (1.6 s on two cores, measured at P = 2 with ``--compile``)."""
        if self.stream is None:
            tensor = torch.empty(header.shape, dtype=header.dtype)
            if tensor.numel():
                self._recv(tensor, self.tensor_group)
            return tensor.to(self.device)
        with torch.cuda.stream(self.stream):
            tensor = torch.empty(header.shape, dtype=header.dtype, device=self.device)
            if tensor.numel():
                self._recv(tensor, self.tensor_group)
        self.stream.synchronize()  # the tensor is complete for any stream that reads it
        return tensor

    async def send(self, descriptor: bytes, tensor: torch.Tensor | None) -> None:
        await anyio.to_thread.run_sync(
            self.send_blocking, descriptor, tensor, abandon_on_cancel=True
        )

    async def recv(self, max_bytes: int | None = None) -> tuple[bytes, torch.Tensor | None]:
        return await anyio.to_thread.run_sync(self.recv_blocking, max_bytes, abandon_on_cancel=True)


def tensor_backend(device: torch.device) -> str:
    """What carries activations between stages: NCCL where ``device`` is a GPU and every
    local rank has one of its own; Gloo otherwise (ranks sharing a GPU stage through host
    memory)."""
    if device.type != "cuda":
        return "gloo"
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return "nccl" if torch.cuda.device_count() >= local_ranks else "gloo"


def gloo_links(
    rank: int, world: int, timeout_s: float, limits: DataLimits | None, device: torch.device,
    ranks: Sequence[int] | None = None,
) -> tuple[GlooLink | None, GlooLink | None, GlooLink | None]:  # fmt: skip
    """Make every link's pair groups, the same calls in the same order on every rank;
    this rank's (inbound from s-1, outbound to s+1, completions between rank 0 and the
    last rank). Descriptors go over Gloo pair groups; activations over pair groups of
    :func:`tensor_backend`. ``rank``: this rank's global rank; ``ranks``: the global rank
    of each of the ``world`` stages (default: stage s is rank s; with ``--tp`` the
    stages' leaders, and a follower, in no pair, gets no link)."""
    timeout = datetime.timedelta(seconds=timeout_s)  # new_group does not inherit it
    backend = tensor_backend(device)
    ranks = list(range(world)) if ranks is None else list(ranks)

    def pair(a: int, b: int):
        meta = dist.new_group([a, b], backend="gloo", timeout=timeout)
        tensors = dist.new_group([a, b], backend=backend, timeout=timeout)
        return meta, tensors

    inbound = outbound = done = None
    for s in range(world - 1):
        a, b = ranks[s], ranks[s + 1]
        meta, tensors = pair(a, b)
        if rank in (a, b):
            link = GlooLink(meta, a, b, limits, tensors, device)
            if rank == a:
                outbound = link
            else:
                inbound = link
    if world > 1:
        first, last = ranks[0], ranks[-1]
        meta, tensors = pair(first, last)
        if rank in (first, last):
            done = GlooLink(meta, last, first, limits, tensors, device)
    return inbound, outbound, done
