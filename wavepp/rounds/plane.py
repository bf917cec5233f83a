"""The rounds plane: what the admission protocol and the runtime need from it.

Implemented over Unix sockets (``wavepp.transport.unix.SocketRoundsPlane``) and over Gloo
(``wavepp.transport.gloo.GlooRoundsPlane``); tests that drive only the admission protocol
(:func:`wavepp.rounds.admission.run_round`) may pass any object with these operations.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from wavepp.rounds.trace import RoundTrace


class RoundsPlane(Protocol):
    rank: int
    world_size: int
    kind: str  # "local" or "gloo", as --rounds-plane names it
    lock: AbstractAsyncContextManager[Any]
    """Held around a round: the plane has one user at a time (the WAVE task, or rank 0's
    LOOP under R1), as every rank must call the same operations in the same order."""
    trace: RoundTrace
    """Where the rounds' steps are timed (:data:`wavepp.rounds.trace.NO_TRACE`: nowhere);
    the plane counts its broadcasts there and marks its frames."""

    async def broadcast(self, payload: bytes | None) -> bytes:
        """Rank 0 passes its payload; every rank returns it."""
        ...

    async def all_min(self, values: Sequence[int]) -> list[int]:
        """Element-wise MIN over ranks (int64)."""
        ...

    async def all_and(self, values: Sequence[int]) -> list[int]:
        """Element-wise bitwise AND over ranks (int64)."""
        ...

    async def all_reduce(
        self, mins: Sequence[int], ands: Sequence[int] = ()
    ) -> tuple[list[int], list[int]]:
        """:meth:`all_min` of ``mins`` and :meth:`all_and` of ``ands`` as one collective
        (a round's agreement step needs both at once)."""
        ...

    async def gather(self, payload: bytes) -> list[bytes] | None:
        """Every rank's payload on rank 0 (None elsewhere)."""
        ...
