"""The two planes over ``torch.distributed`` (DESIGN §3, §10).

- **Rounds plane**: one process group of all ranks, used by one task at a time (the
  WAVE task, or rank 0's LOOP under R1, serialized by a lock).
- **Data plane**: one two-rank group per link ``s -> s+1`` (and ``P-1 -> 0`` for
  completions). On each rank a link is used by exactly one sender or one receiver, so
  no group ever has two concurrent users (two threads on one Gloo group deadlock).

Gloo point-to-point cannot be polled and a blocking call inside a coroutine would
stall the event loop, so every blocking call runs in a worker thread
(``anyio.to_thread.run_sync``) while the loop keeps serving the other plane. The
threads are abandoned on cancellation: a rank that fails does not wait for a peer.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence

import anyio
import anyio.to_thread
import torch
import torch.distributed as dist


class PlaneError(RuntimeError):
    """A collective or transfer failed: a peer died, hung past the timeout, or sent junk."""


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8]
_HEADER = 8  # int64 header: [desc_bytes, dtype code, ndim, dims...(5)]


def _bytes_tensor(payload: bytes) -> torch.Tensor:
    return (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if payload
        else torch.empty(0, dtype=torch.uint8)
    )


class TorchRoundsPlane:
    """Rounds-plane collectives over a Gloo group, each in a worker thread."""

    def __init__(self, group: dist.ProcessGroup, rank: int, world_size: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.lock = anyio.Lock()
        self.on_wait: Callable[[str], None] = lambda status: None  # the watchdog's status

    async def _run(self, fn, what: str = "a collective"):
        self.on_wait(f"waiting on the rounds plane ({what}, all ranks)")
        try:
            return await anyio.to_thread.run_sync(fn, abandon_on_cancel=True)
        except RuntimeError as error:
            raise PlaneError(f"rounds plane {what} failed: {error}") from None
        finally:
            self.on_wait("running")

    async def broadcast(self, payload: bytes | None) -> bytes:
        def work() -> bytes:
            size = torch.tensor([len(payload) if self.rank == 0 else 0], dtype=torch.int64)
            dist.broadcast(size, src=0, group=self.group)
            n = int(size.item())
            buf = _bytes_tensor(payload) if self.rank == 0 else torch.empty(n, dtype=torch.uint8)
            if n:
                dist.broadcast(buf, src=0, group=self.group)
            return buf.numpy().tobytes()

        return await self._run(work, "broadcast from rank 0")

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

        return await self._run(work, "gather of stage reports")


MAX_TENSOR_BYTES = 8 << 30  # one wave's activations; more is refused before allocating


def parse_header(
    header: list[int], max_bytes: int, max_tensor_bytes: int
) -> tuple[int, torch.dtype | None, list[int]]:
    """Check a peer's data-plane header before allocating anything for it."""
    if len(header) != _HEADER:
        raise PlaneError(f"data-plane header of {len(header)} words, expected {_HEADER}")
    size, code, ndim = header[:3]
    if not 0 < size <= max_bytes:
        raise PlaneError(f"data-plane descriptor of {size} bytes (limit {max_bytes})")
    if not 0 <= code <= len(_DTYPES) or not 0 <= ndim <= _HEADER - 3:
        raise PlaneError(f"bad data-plane header {header}")
    if code == 0:
        return size, None, []
    shape = header[3 : 3 + ndim]
    if any(d < 0 for d in shape):
        raise PlaneError(f"negative tensor shape {shape} in data-plane header")
    dtype = _DTYPES[code - 1]
    numel = 1
    for d in shape:
        numel *= d
    if numel * dtype.itemsize > max_tensor_bytes:
        raise PlaneError(f"tensor of shape {shape} exceeds {max_tensor_bytes:,} bytes")
    return size, dtype, shape


class Link:
    """One direction of the data plane between two ranks: descriptor bytes + a tensor."""

    def __init__(self, group: dist.ProcessGroup, src: int, dst: int) -> None:
        self.group = group
        self.src = src
        self.dst = dst
        self.on_wait: Callable[[str], None] = lambda status: None  # the watchdog's status

    def send_blocking(self, descriptor: bytes, tensor: torch.Tensor | None) -> None:
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0] = len(descriptor)
        if tensor is not None:
            if tensor.dim() > _HEADER - 3:
                raise ValueError(f"tensors of {tensor.dim()} dims do not fit the link header")
            header[1] = _DTYPES.index(tensor.dtype) + 1
            header[2] = tensor.dim()
            header[3 : 3 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        dist.send(header, self.dst, group=self.group)
        dist.send(_bytes_tensor(descriptor), self.dst, group=self.group)
        if tensor is not None and tensor.numel():
            dist.send(tensor.contiguous(), self.dst, group=self.group)

    def recv_blocking(self, max_bytes: int) -> tuple[bytes, torch.Tensor | None]:
        header = torch.zeros(_HEADER, dtype=torch.int64)
        dist.recv(header, self.src, group=self.group)
        size, code, ndim = (int(x) for x in header[:3])
        if (
            not 0 < size <= max_bytes
            or not 0 <= code <= len(_DTYPES)
            or not 0 <= ndim <= _HEADER - 3
        ):
            raise ValueError(f"bad data-plane header from rank {self.src}: {header.tolist()}")
        desc = torch.empty(size, dtype=torch.uint8)
        dist.recv(desc, self.src, group=self.group)
        tensor = None
        if code:
            shape = [int(x) for x in header[3 : 3 + ndim]]
            tensor = torch.empty(shape, dtype=_DTYPES[code - 1])
            if tensor.numel():
                dist.recv(tensor, self.src, group=self.group)
        return desc.numpy().tobytes(), tensor

    async def send(self, descriptor: bytes, tensor: torch.Tensor | None) -> None:
        await anyio.to_thread.run_sync(
            self.send_blocking, descriptor, tensor, abandon_on_cancel=True
        )

    async def recv(self, max_bytes: int) -> tuple[bytes, torch.Tensor | None]:
        return await anyio.to_thread.run_sync(self.recv_blocking, max_bytes, abandon_on_cancel=True)


def build_planes(
    timeout_s: float,
) -> tuple[TorchRoundsPlane, Link | None, Link | None, Link | None]:
    """Create the groups, the same calls in the same order on every rank.

    Returns the rounds plane and, for this rank, the inbound link (from s-1), the
    outbound link (to s+1) and, on rank 0 and the last rank, the completion link.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    timeout = datetime.timedelta(seconds=timeout_s)  # new_group does not inherit it
    rounds = dist.new_group(backend="gloo", timeout=timeout)
    inbound = outbound = done = None
    for s in range(world - 1):
        group = dist.new_group([s, s + 1], backend="gloo", timeout=timeout)
        if rank == s:
            outbound = Link(group, s, s + 1)
        if rank == s + 1:
            inbound = Link(group, s, s + 1)
    if world > 1:
        group = dist.new_group([0, world - 1], backend="gloo", timeout=timeout)
        if rank in (0, world - 1):
            done = Link(group, world - 1, 0)
    return TorchRoundsPlane(rounds, rank, world), inbound, outbound, done
