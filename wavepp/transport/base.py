"""What the runtime asks of a data-plane link, whatever carries it, and the error every
transport raises. (The rounds plane's protocol is :class:`wavepp.rounds.plane.RoundsPlane`,
beside the admission protocol that drives it.)"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from wavepp.transport.frames import DataLimits


class PlaneError(RuntimeError):
    """A collective or transfer failed: a peer died, hung past the timeout, or sent junk."""


_SOURCE = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*")  # Gloo's "[.../pair.cc:537] "


def plane_error(what: str, error: BaseException) -> PlaneError:
    """``error`` from a collective or transfer of ``torch.distributed`` (Gloo's, NCCL's)
    as a :class:`PlaneError` saying that ``what`` failed, in the backend's first sentence
    without its source location and advice ("Connection closed by peer
    [127.0.0.1]:9631"): which peer is gone is the watchdog's to say."""
    if isinstance(error, PlaneError):
        return error
    text = _SOURCE.sub("", str(error).strip()).split(". This is typically", 1)[0]
    first = text.splitlines()[0][:300] if text else type(error).__name__
    return PlaneError(f"{what} failed: {first}")


def no_status(status: str) -> None:
    """What a plane tells about its waits when nobody listens (the watchdog listens in a
    run of several ranks)."""


class Link(Protocol):
    """One direction of the data plane between two ranks: messages of a descriptor and an
    optional activation tensor, whole and in order, whoever sends them. Every received
    header is checked against the run's :class:`~wavepp.transport.frames.DataLimits`
    before anything is allocated for it.

    Implemented over Gloo pair groups (:class:`wavepp.transport.gloo.GlooLink`) and over
    a Unix socket (:class:`wavepp.transport.unix.SocketLink`)."""

    kind: str  # "gloo" or "local", as --data-plane names it
    src: int
    dst: int

    async def send(self, descriptor: bytes, tensor: torch.Tensor | None) -> None: ...

    async def recv(self, max_bytes: int | None = None) -> tuple[bytes, torch.Tensor | None]:
        """The next message; its descriptor at most ``max_bytes`` (and the limits')."""
        ...

    def set_limits(self, limits: DataLimits) -> None:
        """Bound what this link accepts, once the run's shapes are known."""
        ...
