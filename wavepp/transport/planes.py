"""The two planes over ``torch.distributed`` (DESIGN §3, §10).

- **Rounds plane**: one process group of all ranks, used by one task at a time (the
  WAVE task, or rank 0's LOOP under R1, serialized by a lock).
- **Data plane**: one two-rank group per link ``s -> s+1`` (and ``P-1 -> 0`` for
  completions). On each rank a link is used by exactly one sender or one receiver, so
  no group ever has two concurrent users (two threads on one Gloo group deadlock).
  Where every rank is on one host, :func:`pick_data_plane` replaces each link by a
  :class:`SocketLink`: the same messages over a Unix socket, in the event loop.

Gloo point-to-point cannot be polled and a blocking call inside a coroutine would
stall the event loop, so every blocking call runs in a worker thread
(``anyio.to_thread.run_sync``) while the loop keeps serving the other plane. The
threads are abandoned on cancellation: a rank that fails does not wait for a peer.
"""

from __future__ import annotations

import datetime
import os
import shutil
import socket
import struct
import tempfile
import threading
from collections.abc import Callable, Sequence

import anyio
import anyio.to_thread
import attrs
import torch
import torch.distributed as dist

from wavepp.transport import unix as local_plane
from wavepp.transport.unix import LocalRoundsPlane, PlaneError, recv_exactly, send_all

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8]
_HEADER = 10  # int64 words: [magic, sender, desc_bytes, dtype code, ndim, dims...(5)]


def _bytes_tensor(payload: bytes) -> torch.Tensor:
    return (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if payload
        else torch.empty(0, dtype=torch.uint8)
    )


INLINE_MIN_BYTES = 4 << 10  # a broadcast's first collective carries this much payload
INLINE_MAX_BYTES = 256 << 10  # ... growing to the longest payload seen, up to this
MAX_BROADCAST_BYTES = local_plane.MAX_FRAME_BYTES  # a longer announced payload is refused,
#   not allocated (the same cap on either rounds plane)


def _inline_after(inline: int, n: int) -> int:
    """The next broadcast's inline room after a payload of ``n`` bytes: every rank
    computes the same from what it has seen, so no size needs to travel first."""
    want = 1 << max(n - 1, 0).bit_length()
    return min(INLINE_MAX_BYTES, max(inline, want))


class TorchRoundsPlane:
    """Rounds-plane collectives over a Gloo group, each in a worker thread.

    A broadcast is one collective of a buffer holding the payload's length and its
    first ``inline`` bytes; only a longer payload pays a second one for the rest. The
    room grows with the longest payload seen (rank 0's rounds), on every rank alike.
    """

    kind = "gloo"

    def __init__(self, group: dist.ProcessGroup, rank: int, world_size: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.lock = anyio.Lock(fast_acquire=True)  # no yield when free: rounds are on the clock
        self.on_wait: Callable[[str], None] = lambda status: None  # the watchdog's status
        self.inline = INLINE_MIN_BYTES  # payload bytes the next broadcast carries at once

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
            inline = self.inline
            buf = torch.zeros(8 + inline, dtype=torch.uint8)
            if self.rank == 0:
                assert payload is not None
                head = payload[:inline]
                buf[:8] = _bytes_tensor(len(payload).to_bytes(8, "little"))
                buf[8 : 8 + len(head)] = _bytes_tensor(head)
            dist.broadcast(buf, src=0, group=self.group)
            n = int.from_bytes(buf[:8].numpy().tobytes(), "little")
            if n > MAX_BROADCAST_BYTES:  # before anything is allocated; rank 0 fails alike
                raise PlaneError(f"rank 0 announced a broadcast of {n:,} bytes; at most "
                                 f"{MAX_BROADCAST_BYTES:,} are accepted")  # fmt: skip
            data = buf[8 : 8 + min(n, inline)].numpy().tobytes()
            if n > inline:
                rest = (
                    _bytes_tensor(payload[inline:])  # type: ignore[index]
                    if self.rank == 0
                    else torch.empty(n - inline, dtype=torch.uint8)
                )
                dist.broadcast(rest, src=0, group=self.group)
                data += rest.numpy().tobytes()
            self.inline = _inline_after(inline, n)
            return data

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


HostRoundsPlane = TorchRoundsPlane | LocalRoundsPlane
"""A rounds plane the runtime drives (both have a ``lock`` and a watchdog ``on_wait``)."""


def _one_host(world: int) -> bool:
    """torchrun put every rank on this host, and Unix sockets work here."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "1" if world == 1 else "")
    return local == str(world) and local_plane.available()


async def _path_from_rank0(gloo: TorchRoundsPlane, path: str, what: str, longest: int) -> str:
    """Rank 0's ``path`` (``""``: none) on every rank, checked: absolute, UTF-8, and at
    most ``longest`` characters (a Unix socket path holds 107 bytes)."""
    raw = await gloo.broadcast(path.encode())
    try:
        path = raw.decode()
    except UnicodeDecodeError:
        raise PlaneError(f"rank 0 sent a {what} that is not UTF-8") from None
    if path and (len(path) > longest or not os.path.isabs(path)):
        raise PlaneError(f"rank 0 sent an unusable {what} {path[:120]!r}")
    return path


async def pick_rounds_plane(
    gloo: TorchRoundsPlane, kind: str, timeout_s: float, log: Callable[[str], None]
) -> HostRoundsPlane:
    """The rounds plane of the run (``--rounds-plane``), the same choice on every rank.

    ``local`` (and ``auto`` where torchrun put every rank on this host) builds a
    :class:`~wavepp.transport.unix.LocalRoundsPlane`: rank 0 listens on a fresh Unix
    socket and sends its path over ``gloo``; the others connect. Where rank 0 cannot
    listen, ``auto`` stays on Gloo and ``local`` fails on every rank."""
    world = gloo.world_size
    one_host = _one_host(world)
    want, allowed = await gloo.all_min([int(kind != "gloo" and one_host),
                                        int(kind != "local" or one_host)])  # fmt: skip
    if not allowed:
        raise PlaneError("--rounds-plane local needs every rank on one host (torchrun's "
                         "LOCAL_WORLD_SIZE equal to its WORLD_SIZE); use gloo or auto")  # fmt: skip
    if not want:
        if gloo.rank == 0 and world > 1:
            log("rounds plane: Gloo" + ("" if one_host else " (ranks on several hosts)"))
        return gloo
    path, listener = "", None
    if gloo.rank == 0:
        try:
            path = LocalRoundsPlane.listen_path()
            listener = await anyio.create_unix_listener(path)
        except OSError as error:
            log(f"rounds plane: cannot listen on a Unix socket ({error}); using Gloo")
            path = ""
    path = await _path_from_rank0(gloo, path, "rounds-plane socket path", 107)
    if not path:
        if kind == "local":
            raise PlaneError("--rounds-plane local: rank 0 could not listen on a Unix socket")
        return gloo
    plane = await LocalRoundsPlane.connect(gloo.rank, world, path, timeout_s, listener)
    if gloo.rank == 0 and world > 1:
        log("rounds plane: Unix sockets around rank 0 (every rank on this host)")
    return plane


MAX_TENSOR_BYTES = 8 << 30  # one wave's activations when no run-derived bound is given
_MAGIC = 0x57505044  # "WPPD": the first word of every data-plane header
_MAX_DIMS = 5


@attrs.frozen
class DataLimits:
    """What a data-plane header may announce, derived from the run's config.

    ``max_tokens`` is the wave budget (most tokens in one wave); ``width`` the model's
    ``d_model``, which every activation tensor ``[tokens, width]`` must have (None: not
    checked, and ``[tokens]`` stand-ins, as the sim executor sends, are accepted);
    ``dtypes`` the tensor dtypes this run sends. Every tensor is also bounded by
    ``max_tensor_bytes``.
    """

    max_descriptor_bytes: int = 64 << 20
    max_tokens: int = 1 << 20
    width: int | None = None
    dtypes: frozenset[torch.dtype] = frozenset(_DTYPES)
    max_tensor_bytes: int = MAX_TENSOR_BYTES

    @classmethod
    def for_run(
        cls, budget: int, width: int | None, dtype: torch.dtype, max_descriptor_bytes: int
    ) -> DataLimits:
        return cls(max_descriptor_bytes, budget, width, frozenset({dtype}))


@attrs.frozen
class Header:
    sender: int
    descriptor_bytes: int
    dtype: torch.dtype | None  # None: no tensor follows
    shape: tuple[int, ...]


class Link:
    """One direction of the data plane between two ranks: a descriptor, then a tensor.

    The header and the descriptor bytes travel on ``meta_group`` (Gloo); the tensor on
    ``tensor_group`` — NCCL on its own CUDA stream when ``device`` is a GPU, Gloo on CPU,
    the same code either way. A lock per direction keeps each message's three parts
    together, so concurrent callers never interleave them. Every header is checked by
    :meth:`parse_header` (the only way a header is read) before anything is allocated.
    """

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
        self.on_wait: Callable[[str], None] = lambda status: None  # the watchdog's status

    # -- the transport (overridden by tests that play a peer) --------------------------

    def _send(self, tensor: torch.Tensor, group) -> None:
        dist.send(tensor, self.dst, group=group)

    def _recv(self, tensor: torch.Tensor, group) -> None:
        dist.recv(tensor, self.src, group=group)

    # -- headers -----------------------------------------------------------------------

    def make_header(self, descriptor: bytes, tensor: torch.Tensor | None) -> list[int]:
        words = [_MAGIC, self.src, len(descriptor), 0, 0] + [0] * _MAX_DIMS
        if tensor is not None:
            if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES:
                raise ValueError(
                    f"a {tensor.dim()}-dim {tensor.dtype} tensor does not fit the link header "
                    f"(at most {_MAX_DIMS} dims of {', '.join(map(str, _DTYPES))})"
                )
            words[3] = _DTYPES.index(tensor.dtype) + 1
            words[4] = tensor.dim()
            words[5 : 5 + tensor.dim()] = list(tensor.shape)
        return words

    def parse_header(self, words: Sequence[int], max_bytes: int | None = None) -> Header:
        """Check a peer's header words against this link and the run's limits."""
        lim = self.limits
        limit = lim.max_descriptor_bytes
        if max_bytes is not None:
            limit = min(limit, max_bytes)
        where = f"data-plane header from rank {self.src}"
        if len(words) != _HEADER:
            raise PlaneError(f"{where}: {len(words)} words, expected {_HEADER}")
        magic, sender, size, code, ndim, *dims = (int(w) for w in words)
        if magic != _MAGIC:
            raise PlaneError(f"{where}: bad magic {magic:#x} (not a WavePP data-plane peer)")
        if sender != self.src:
            raise PlaneError(f"{where}: claims to come from rank {sender}")
        if not 0 < size <= limit:
            raise PlaneError(f"{where}: descriptor of {size} bytes (limit {limit:,})")
        if code == 0:
            if ndim or any(dims):
                raise PlaneError(f"{where}: shape {dims[:ndim]} without a dtype")
            return Header(sender, size, None, ())
        if not 0 < code <= len(_DTYPES) or _DTYPES[code - 1] not in lim.dtypes:
            allowed = ", ".join(sorted(str(d) for d in lim.dtypes))
            raise PlaneError(f"{where}: dtype code {code} is not one of this run's ({allowed})")
        dtype = _DTYPES[code - 1]
        if not 1 <= ndim <= 2 or any(dims[ndim:]):
            raise PlaneError(f"{where}: {ndim}-dim tensor; activations are [tokens] or "
                             "[tokens, width]")  # fmt: skip
        shape = tuple(dims[:ndim])
        tokens = shape[0]
        if not 0 <= tokens <= lim.max_tokens:
            raise PlaneError(f"{where}: {tokens} tokens, the wave budget is {lim.max_tokens}")
        if ndim == 2 and lim.width is not None and shape[1] != lim.width:
            raise PlaneError(f"{where}: width {shape[1]}, the model's is {lim.width}")
        if ndim == 1 and lim.width is not None:
            raise PlaneError(f"{where}: shape {list(shape)}, expected [tokens, {lim.width}]")
        numel = tokens * (shape[1] if ndim == 2 else 1)
        if numel * dtype.itemsize > lim.max_tensor_bytes:
            raise PlaneError(f"{where}: tensor {list(shape)} exceeds "
                             f"{lim.max_tensor_bytes:,} bytes")  # fmt: skip
        return Header(sender, size, dtype, shape)

    # -- messages ----------------------------------------------------------------------

    def send_blocking(self, descriptor: bytes, tensor: torch.Tensor | None) -> None:
        header = torch.tensor(self.make_header(descriptor, tensor), dtype=torch.int64)
        with self._send_lock:
            self._send(header, self.group)
            self._send(_bytes_tensor(descriptor), self.group)
            if tensor is not None and tensor.numel():
                self._send_tensor(tensor)

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
            words = torch.zeros(_HEADER, dtype=torch.int64)
            self._recv(words, self.group)
            header = self.parse_header(words.tolist(), max_bytes)
            desc = torch.empty(header.descriptor_bytes, dtype=torch.uint8)
            self._recv(desc, self.group)
            tensor = None
            if header.dtype is not None:
                tensor = self._recv_tensor(header)
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


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable buffer (shared, not copied)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


class SocketLink(Link):
    """A :class:`Link` over a connected Unix socket, awaited in the rank's event loop.

    For ranks on one host. Over Gloo a hand-off is three pair messages (0.7-1.4 ms each
    here, DESIGN §10), each waited on in a worker thread, and a thread hop on each side;
    here it is one write of the header and descriptor, one of the tensor's bytes, and
    the reads straight into the received tensor, with no thread. The header, its checks
    before anything is allocated, and the order of the parts are :class:`Link`'s;
    tensors are CPU tensors (a CUDA tensor is staged through host memory, as over Gloo).
    A receive may wait for the next header as long as the link is idle; the rest of a
    message must follow within ``timeout_s``. A peer that exits closes its end: the
    wait fails at once with :class:`PlaneError`, where a Gloo receive waits out its
    timeout.
    """

    kind = "local"

    def __init__(self, link: Link, sock: socket.socket, timeout_s: float) -> None:
        super().__init__(None, link.src, link.dst, link.limits, device=link.device)
        sock.setblocking(False)
        self.sock = sock
        self.timeout_s = timeout_s
        self._sending = anyio.Lock(fast_acquire=True)  # one message's parts together, whoever sends
        self._receiving = anyio.Lock(fast_acquire=True)

    async def _write(self, data: memoryview) -> None:
        try:
            await send_all(self.sock, data)
        except OSError as error:
            raise PlaneError(f"data plane: sending to rank {self.dst} failed: {error!r}"
                             ) from None  # fmt: skip

    async def _read_into(self, view: memoryview) -> None:
        try:
            await recv_exactly(self.sock, view)
        except anyio.IncompleteRead:
            raise PlaneError(f"data plane: rank {self.src} closed its link in a message "
                             f"part of {len(view)} bytes") from None  # fmt: skip
        except OSError as error:
            raise PlaneError(f"data plane: receiving from rank {self.src} failed: {error!r}"
                             ) from None  # fmt: skip

    async def send(self, descriptor: bytes, tensor: torch.Tensor | None) -> None:
        words = self.make_header(descriptor, tensor)
        head = struct.pack(f"<{_HEADER}q", *words) + descriptor
        body = None
        if tensor is not None and tensor.numel():
            body = tensor.detach().cpu().contiguous()  # kept alive while it is written
        async with self._sending:
            try:
                with anyio.fail_after(self.timeout_s):
                    await self._write(memoryview(head))
                    if body is not None:
                        await self._write(_byte_view(body))
            except TimeoutError:
                raise PlaneError(f"data plane: rank {self.dst} took no message for "
                                 f"{self.timeout_s:g} s") from None  # fmt: skip

    async def recv(self, max_bytes: int | None = None) -> tuple[bytes, torch.Tensor | None]:
        async with self._receiving:
            raw = bytearray(8 * _HEADER)
            await self._read_into(memoryview(raw))  # the link may idle before a header
            header = self.parse_header(struct.unpack(f"<{_HEADER}q", raw), max_bytes)
            try:
                with anyio.fail_after(self.timeout_s):
                    desc = bytearray(header.descriptor_bytes)
                    await self._read_into(memoryview(desc))
                    tensor = None
                    if header.dtype is not None:
                        with torch.inference_mode():  # like the sender's executor output
                            tensor = torch.empty(header.shape, dtype=header.dtype)
                        if tensor.numel():
                            await self._read_into(_byte_view(tensor))
                        with torch.inference_mode():
                            tensor = tensor.to(self.device)
            except TimeoutError:
                raise PlaneError(f"data plane: a message from rank {self.src} stopped short "
                                 f"for {self.timeout_s:g} s") from None  # fmt: skip
        return bytes(desc), tensor

    def send_blocking(self, descriptor: bytes, tensor: torch.Tensor | None) -> None:
        raise TypeError("a SocketLink is awaited in the event loop: use send()")

    def recv_blocking(self, max_bytes: int | None = None) -> tuple[bytes, torch.Tensor | None]:
        raise TypeError("a SocketLink is awaited in the event loop: use recv()")


def _connect_pair(directory: str, rank: int, world: int, listener: socket.socket,
                  timeout_s: float) -> tuple[socket.socket, socket.socket]:  # fmt: skip
    """(to rank+1, from rank-1), around the ring: connect to the next rank's socket and
    say who this is; accept the previous rank and check who it says it is."""
    send_to, recv_from = (rank + 1) % world, (rank - 1) % world
    out = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        out.settimeout(timeout_s)
        out.connect(os.path.join(directory, f"in-{send_to}.sock"))
        out.sendall(rank.to_bytes(8, "little"))
        listener.settimeout(timeout_s)
        into, _ = listener.accept()
    except OSError as error:
        out.close()
        raise PlaneError(f"data plane: rank {rank} could not connect its links: {error!r}"
                         ) from None  # fmt: skip
    into.settimeout(timeout_s)
    try:
        hello = into.recv(8, socket.MSG_WAITALL)  # fewer if the peer closes first
    except OSError:
        hello = b""
    if int.from_bytes(hello.ljust(8, b"\xff"), "little") != recv_from:
        out.close()
        into.close()
        raise PlaneError(f"data plane: rank {rank} expected rank {recv_from} on its inbound "
                         f"socket, got {hello!r}")  # fmt: skip
    return out, into


async def pick_data_plane(
    gloo: TorchRoundsPlane, kind: str, links: tuple[Link | None, Link | None, Link | None],
    timeout_s: float, log: Callable[[str], None],
) -> tuple[tuple[Link | None, Link | None, Link | None], str]:  # fmt: skip
    """The data plane of the run (``--data-plane``), the same choice on every rank:
    ``(inbound, outbound, done)`` and its kind (``local``, ``gloo``; ``none`` for one rank).

    ``local`` (and ``auto`` where torchrun put every rank on this host and activations
    are not on NCCL) carries the links over Unix sockets (:class:`SocketLink`): rank 0
    makes a directory only this user may enter and sends its path over ``gloo``; each
    rank listens there for its one inbound link (rank 0: the completions from the last
    rank) and connects to the next rank's. The directory is removed once all are in."""
    world, rank = gloo.world_size, gloo.rank
    if world == 1:
        return links, "none"
    one_host = _one_host(world)
    nccl = any(link is not None and link.stream is not None for link in links)
    can = one_host and not nccl
    want, allowed = await gloo.all_min([int(kind == "local" or (kind == "auto" and can)),
                                        int(kind != "local" or can)])  # fmt: skip
    if not allowed:
        raise PlaneError("--data-plane local needs every rank on one host (torchrun's "
                         "LOCAL_WORLD_SIZE equal to its WORLD_SIZE) and activations off "
                         "NCCL; use gloo or auto")  # fmt: skip
    if not want:
        return links, "gloo"
    directory = ""
    if rank == 0:
        try:
            directory = tempfile.mkdtemp(prefix="wavepp-data-")
        except OSError as error:
            log(f"data plane: cannot make a socket directory ({error}); using Gloo")
    # 90: room for the socket's name under it
    directory = await _path_from_rank0(gloo, directory, "data-plane socket directory", 90)
    listener = None
    if directory:
        try:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(os.path.join(directory, f"in-{rank}.sock"))
            listener.listen(1)
        except OSError as error:
            log(f"data plane: rank {rank} cannot listen on a Unix socket ({error})")
            if listener is not None:
                listener.close()
            listener = None
    (listening,) = await gloo.all_min([int(listener is not None)])
    try:
        if not listening:
            if kind == "local":
                raise PlaneError("--data-plane local: a rank could not listen on a Unix socket")
            return links, "gloo"
        out, into = await anyio.to_thread.run_sync(
            _connect_pair, directory, rank, world, listener, timeout_s
        )
        await gloo.all_min([1])  # every link is up: the directory may go
    finally:
        if listener is not None:
            listener.close()
        if rank == 0 and directory:
            shutil.rmtree(directory, ignore_errors=True)
    inbound, outbound, done = links
    if rank < world - 1:
        outbound = SocketLink(outbound, out, timeout_s)
    else:
        done = SocketLink(done, out, timeout_s)
    if rank > 0:
        inbound = SocketLink(inbound, into, timeout_s)
    else:
        done = SocketLink(done, into, timeout_s)
    if rank == 0:
        log("data plane: Unix sockets between neighbouring ranks (every rank on this host)")
    return (inbound, outbound, done), "local"


def build_planes(
    timeout_s: float,
    limits: DataLimits | None = None,
    device: torch.device | None = None,
) -> tuple[TorchRoundsPlane, Link | None, Link | None, Link | None]:
    """Create the groups, the same calls in the same order on every rank.

    Returns the rounds plane and, for this rank, the inbound link (from s-1), the
    outbound link (to s+1) and, on rank 0 and the last rank, the completion link.
    Descriptors go over Gloo pair groups; activations over NCCL pair groups when
    ``device`` is a GPU and every local rank has one, else over a second Gloo pair
    group (the same code path; CUDA tensors staged through host memory).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    device = device or torch.device("cpu")
    timeout = datetime.timedelta(seconds=timeout_s)  # new_group does not inherit it
    tensor_backend = "gloo"
    if device.type == "cuda":  # NCCL needs a GPU per rank; ranks sharing one use Gloo
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        tensor_backend = "nccl" if torch.cuda.device_count() >= local_ranks else "gloo"
    rounds = dist.new_group(backend="gloo", timeout=timeout)

    def pair(a: int, b: int):
        meta = dist.new_group([a, b], backend="gloo", timeout=timeout)
        tensors = dist.new_group([a, b], backend=tensor_backend, timeout=timeout)
        return meta, tensors

    inbound = outbound = done = None
    for s in range(world - 1):
        meta, tensors = pair(s, s + 1)
        if rank in (s, s + 1):
            link = Link(meta, s, s + 1, limits, tensors, device)
            if rank == s:
                outbound = link
            else:
                inbound = link
    if world > 1:
        meta, tensors = pair(0, world - 1)
        if rank in (0, world - 1):
            done = Link(meta, world - 1, 0, limits, tensors, device)
    return TorchRoundsPlane(rounds, rank, world), inbound, outbound, done


def set_limits(links: Sequence[Link | None], limits: DataLimits) -> None:
    """Bound what these links accept, once the run's shapes are known."""
    for link in links:
        if link is not None:
            link.limits = limits
