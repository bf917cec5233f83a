"""What the server asks of an engine: exactly the members of :class:`wavepp.engine.Engine`
it uses, so that a stand-in (``tests/helpers/fake_engine.py``) and the real engine are held to one
contract (``tests/unit/test_serve_protocol.py`` checks both against it)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from wavepp.runtime.handoff import BandServers


class ServedResult(Protocol):
    """How a request ended (``wavepp.engine.Result``): the fields the answers carry."""

    @property
    def request_id(self) -> str: ...
    @property
    def status(self) -> str: ...  # "done" | "cancelled" | "rejected" | "failed"
    @property
    def first_token(self) -> int | None: ...
    @property
    def top_logit(self) -> float | None: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def cached_tokens(self) -> int: ...
    @property
    def error(self) -> str | None: ...
    @property
    def submitted_at(self) -> float: ...
    @property
    def admitted_at(self) -> float | None: ...
    @property
    def first_chunk_at(self) -> float | None: ...
    @property
    def done_at(self) -> float: ...
    @property
    def handoff(self) -> dict | None: ...
    @property
    def deadline_s(self) -> float | None: ...
    @property
    def deadline_met(self) -> bool | None: ...


class ServedHandle(Protocol):
    request_id: str

    async def result(self) -> ServedResult: ...

    async def answer(self) -> ServedResult: ...  # the result, or a pull: prefill's (held)


@runtime_checkable
class ServedEngine(Protocol):
    """Rank 0's engine as the server drives it. ``submit`` raises
    :class:`wavepp.errors.RequestRejected` (its ``reason`` picks the HTTP status)."""

    vocab_size: int | None  # None: token ids are not checked (the sim executor)
    block_size: int
    kv_events: dict | None  # where KV events are published (--kv-events), else None
    # where the stages serve bands to decoders that pull them (pull: targets), else None
    band_servers: BandServers | None
    run_id: str  # the run's id: its bands' sender, as a decode request names it

    async def submit(
        self, tokens: Sequence[int] | np.ndarray, *, request_id: str | None = None,
        priority: int = 0, handoff: str | bool | None = None, deadline_s: float | None = None,
    ) -> ServedHandle: ...  # fmt: skip

    def cancel(self, request_id: str, reason: str = "cancelled") -> bool: ...

    def results(self) -> AsyncIterator[ServedResult]: ...

    def drain(self) -> None: ...

    @property
    def draining(self) -> bool: ...

    async def until_draining(self) -> None: ...

    async def until_fault(self) -> None: ...

    def health(self) -> tuple[bool, str]: ...

    def fault(self) -> str | None: ...

    def stats(self) -> dict[str, Any]: ...
