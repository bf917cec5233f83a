"""The run's two planes, chosen and built the same way on every rank (DESIGN §3, §10):
:func:`build_planes` is the one entry point.

Every rank first agrees, over the default Gloo group that ``init_process_group`` made,
on which transport carries each plane (``--rounds-plane``, ``--data-plane``); rank 0
sends the socket paths over it too. Where Unix sockets are chosen that group is the only
one: Gloo pair groups for the data plane are made only when the data plane is Gloo.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

import anyio
import anyio.to_thread
import attrs
import torch
import torch.distributed as dist

from wavepp.rounds.plane import RoundsPlane
from wavepp.rounds.trace import RoundTrace
from wavepp.transport import unix
from wavepp.transport.base import Link, PlaneError, no_status
from wavepp.transport.frames import DataLimits
from wavepp.transport.gloo import GlooRoundsPlane, gloo_links, tensor_backend
from wavepp.transport.unix import SocketLink, SocketRoundsPlane

Links = tuple[Link | None, Link | None, Link | None]  # (inbound, outbound, done)


@attrs.frozen
class Leaders:
    """With ``--tp``: the planes run between the stages' leaders (``wavepp.exec.tp``), over
    ``group``, this one being stage ``stage`` of ``stages``; its Gloo data-plane links,
    should the data plane be Gloo, were made beforehand on every rank of the world
    (``dist.new_group`` is collective over the world)."""

    group: dist.ProcessGroup
    stage: int
    stages: int
    gloo_links: Links


@attrs.frozen
class Planes:
    """This rank's planes: the rounds plane, and its data-plane links — inbound (from
    s-1), outbound (to s+1) and, on rank 0 and the last rank, the completion link —
    carried by ``data_kind`` (``local``, ``gloo``; ``none`` for one rank)."""

    rounds: RoundsPlane
    inbound: Link | None
    outbound: Link | None
    done: Link | None
    data_kind: str

    @property
    def links(self) -> Links:
        return self.inbound, self.outbound, self.done

    def set_limits(self, limits: DataLimits) -> None:
        """Bound what the links accept, once the run's shapes are known."""
        for link in self.links:
            if link is not None:
                link.set_limits(limits)


async def build_planes(
    timeout_s: float,
    rounds_kind: str = "auto",
    data_kind: str = "auto",
    log: Callable[[str], None] = print,
    device: torch.device | None = None,
    limits: DataLimits | None = None,
    on_wait: Callable[[str], None] | None = None,
    leaders: Leaders | None = None,
) -> Planes:
    """This rank's planes, after ``init_process_group`` (the same calls in the same order
    on every rank; with ``leaders``, on every stage's leader). ``on_wait`` hears what the
    rounds plane waits on (the watchdog's status); ``limits`` bounds the links until
    :meth:`Planes.set_limits`."""
    on_wait = on_wait or no_status
    group, rank, world = ((dist.group.WORLD, dist.get_rank(), dist.get_world_size())
                          if leaders is None else (leaders.group, leaders.stage, leaders.stages))
    # WAVEPP_ROUND_TRACE=<dir>: time the rounds' steps (every rank counts the same
    # broadcasts on whichever plane carries them, the set-up's included)
    trace = RoundTrace.from_env(rank)
    gloo = GlooRoundsPlane(group, rank, world, on_wait, trace)
    rounds = await _rounds_plane(gloo, rounds_kind, timeout_s, log, on_wait, trace)
    links, kind = await _data_plane(gloo, data_kind, timeout_s, log,
                                    device or torch.device("cpu"), limits,
                                    leaders.gloo_links if leaders else None)  # fmt: skip
    return Planes(rounds, *links, kind)


def _one_host(world: int) -> bool:
    """torchrun put every rank of the world on this host, and Unix sockets work here."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "1" if world == 1 else "")
    everyone = dist.get_world_size() if dist.is_initialized() else world
    return local == str(everyone) and unix.available()


async def _path_from_rank0(gloo: RoundsPlane, path: str, what: str, longest: int) -> str:
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


async def _rounds_plane(
    gloo: GlooRoundsPlane, kind: str, timeout_s: float, log: Callable[[str], None],
    on_wait: Callable[[str], None], trace: RoundTrace | None = None,
) -> RoundsPlane:  # fmt: skip
    """The rounds plane of the run (``--rounds-plane``), the same choice on every rank.

    ``local`` (and ``auto`` where torchrun put every rank on this host) builds a
    :class:`~wavepp.transport.unix.SocketRoundsPlane`: rank 0 listens on a fresh Unix
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
            path = SocketRoundsPlane.listen_path()
            listener = await anyio.create_unix_listener(path)
        except OSError as error:
            log(f"rounds plane: cannot listen on a Unix socket ({error}); using Gloo")
            path = ""
    path = await _path_from_rank0(gloo, path, "rounds-plane socket path", 107)
    if not path:
        if kind == "local":
            raise PlaneError("--rounds-plane local: rank 0 could not listen on a Unix socket")
        return gloo
    plane = await SocketRoundsPlane.connect(gloo.rank, world, path, timeout_s, listener,
                                            on_wait, trace)  # fmt: skip
    if gloo.rank == 0 and world > 1:
        log("rounds plane: Unix sockets around rank 0 (every rank on this host)")
    return plane


async def _data_plane(
    gloo: GlooRoundsPlane, kind: str, timeout_s: float, log: Callable[[str], None],
    device: torch.device, limits: DataLimits | None, premade: Links | None = None,
) -> tuple[Links, str]:  # fmt: skip
    """The data plane of the run (``--data-plane``), the same choice on every rank:
    ``(inbound, outbound, done)`` and its kind (``local``, ``gloo``; ``none`` for one rank).

    ``local`` (and ``auto`` where torchrun put every rank on this host and activations
    are not on NCCL) carries the links over Unix sockets (:class:`SocketLink`): rank 0
    makes a directory only this user may enter and sends its path over ``gloo``; each
    rank listens there for its one inbound link (rank 0: the completions from the last
    rank) and connects to the next rank's. The directory is removed once all are in.
    ``gloo`` makes the links' pair groups (:func:`~wavepp.transport.gloo.gloo_links`), or
    takes ``premade`` ones (``--tp``: made on every rank beforehand)."""
    world, rank = gloo.world_size, gloo.rank
    if world == 1:
        return (None, None, None), "none"
    can = _one_host(world) and tensor_backend(device) != "nccl"
    want, allowed = await gloo.all_min([int(kind == "local" or (kind == "auto" and can)),
                                        int(kind != "local" or can)])  # fmt: skip
    if not allowed:
        raise PlaneError("--data-plane local needs every rank on one host (torchrun's "
                         "LOCAL_WORLD_SIZE equal to its WORLD_SIZE) and activations off "
                         "NCCL; use gloo or auto")  # fmt: skip
    if not want:
        return _gloo(rank, world, timeout_s, limits, device, premade), "gloo"
    directory = ""
    if rank == 0:
        try:
            directory = unix.link_directory()
        except OSError as error:
            log(f"data plane: cannot make a socket directory ({error}); using Gloo")
    # 90: room for the socket's name under it
    directory = await _path_from_rank0(gloo, directory, "data-plane socket directory", 90)
    listener = None
    if directory:
        try:
            listener = unix.listen_inbound(directory, rank)
        except OSError as error:
            log(f"data plane: rank {rank} cannot listen on a Unix socket ({error})")
    (listening,) = await gloo.all_min([int(listener is not None)])
    try:
        if not listening:
            if kind == "local":
                raise PlaneError("--data-plane local: a rank could not listen on a Unix socket")
            return _gloo(rank, world, timeout_s, limits, device, premade), "gloo"
        out, into = await anyio.to_thread.run_sync(
            unix.connect_ring, directory, rank, world, listener, timeout_s
        )
        await gloo.all_min([1])  # every link is up: the directory may go
    finally:
        if listener is not None:
            listener.close()
        if rank == 0 and directory:
            shutil.rmtree(directory, ignore_errors=True)
    send_to, recv_from = (rank + 1) % world, (rank - 1) % world
    to_next = SocketLink(rank, send_to, out, timeout_s, limits, device)
    from_previous = SocketLink(recv_from, rank, into, timeout_s, limits, device)
    if rank == 0:
        log("data plane: Unix sockets between neighbouring ranks (every rank on this host)")
        return (None, to_next, from_previous), "local"
    if rank == world - 1:
        return (from_previous, None, to_next), "local"
    return (from_previous, to_next, None), "local"


def _gloo(rank: int, world: int, timeout_s: float, limits: DataLimits | None,
          device: torch.device, premade: Links | None) -> Links:  # fmt: skip
    if premade is None:
        return gloo_links(rank, world, timeout_s, limits, device)
    for link in premade:
        if link is not None and limits is not None:
            link.set_limits(limits)
    return premade
