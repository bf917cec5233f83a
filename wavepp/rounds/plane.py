"""What the admission protocol needs from the rounds plane (implemented over Unix
sockets in ``wavepp.transport.unix`` and over Gloo in ``wavepp.transport.planes``; over
plain lists in tests)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class RoundsPlane(Protocol):
    rank: int
    world_size: int

    async def broadcast(self, payload: bytes | None) -> bytes:
        """Rank 0 passes its payload; every rank returns it."""
        ...

    async def all_min(self, values: Sequence[int]) -> list[int]:
        """Element-wise MIN over ranks (int64)."""
        ...

    async def all_and(self, values: Sequence[int]) -> list[int]:
        """Element-wise bitwise AND over ranks (int64)."""
        ...

    async def gather(self, payload: bytes) -> list[bytes] | None:
        """Every rank's payload on rank 0 (None elsewhere)."""
        ...
