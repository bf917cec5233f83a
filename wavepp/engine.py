"""The Python API on rank 0: submit prompts, await results, cancel, watch.

Launch any script under ``torchrun`` and hand :func:`wavepp.main.run_ranks` a client
coroutine; rank 0 calls it with an :class:`Engine` while the runtime runs alongside it
(ranks > 0 just serve their stage)::

    async def client(engine: Engine) -> None:
        handle = await engine.submit([1, 2, 3, 4], priority=1)
        result = await handle.result()  # Result(status="done", first_token=..., ...)
        engine.drain()

    run_ranks(load(["--model", "tiny-hybrid"]), client)

The run ends when the client has returned (or called :meth:`Engine.drain`) and every
submitted request has ended. The workload generators and requests files are clients of
this same API (``wavepp.runtime.feed``), and so is the HTTP server (``wavepp.serve``).
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
import threading
import time
from collections.abc import AsyncIterator, Sequence

import anyio
import anyio.from_thread
import anyio.lowlevel
import numpy as np

from wavepp.runtime.coordinator import Coordinator
from wavepp.runtime.handoff import BandServers
from wavepp.runtime.records import RequestRejected, Result
from wavepp.state import RequestId
from wavepp.workload import RequestSpec

__all__ = ["Engine", "Handle", "RequestRejected", "Result"]

# a stage's band server, per stage in stats(): bands parked for pulling, pulls accepted and
# refused so far (wavepp.handoff.pull)
PULL_FIGURES = ("pull_parked", "pulls_accepted", "pulls_refused")


class Handle:
    """A submitted request; ``await handle.result()`` when it ends, however it ends."""

    def __init__(self, record) -> None:
        self.request_id: str = record.spec.request_id
        self._record = record

    async def result(self) -> Result:
        await self._record.finished.wait()
        return self._record.result()

    async def answer(self) -> Result:
        """The result its caller is answered with: :meth:`result` at its end — or, for a
        request whose cache waits on the stages' band servers (``pull:``), as soon as it
        is prefilled (status ``done``, its handoff ``held``), while its bands wait for
        their decoder."""
        await self._record.answered.wait()
        return self._record.answer()

    def done(self) -> bool:
        return self._record.finished.is_set()


# what a stage holds for requests (its leak check, live): balanced is 1 while it holds nothing
HOLD_FIGURES = ("leases", "escrowed", "balanced")


class Engine:
    """Rank 0's front door to the runtime."""

    def __init__(
        self, coordinator: Coordinator, *, vocab_size: int | None, min_capacity: int,
        block_size: int, kv_events: dict | None = None, watchdog=None,
        band_servers: BandServers | None = None, run_id: str | None = None,
    ) -> None:  # fmt: skip
        """``kv_events``: where --kv-events are published (endpoints, topic), else None.
        ``band_servers``: where the stages serve bands to decoders (``pull:``), else None.
        ``run_id``: the run's id (its bands' sender; default: 16 random hex digits)."""
        self._c = coordinator
        self.vocab_size = vocab_size  # None: any int32 id (the sim executor)
        self.min_capacity = min_capacity
        self.block_size = block_size
        self.kv_events = None if kv_events is None else dict(kv_events)
        self.band_servers = band_servers
        self._watchdog = watchdog
        # the run's id: its bands' sender, and with a counter the ids this engine names,
        # so that ids from different runs and servers never meet (docs/handoff.md)
        self.run_id = run_id or secrets.token_hex(8)
        self._ids = itertools.count()
        self.started_at = time.time()
        # Built on rank 0's event loop: SIGTERM's drain sets one event there; the
        # watchdog's thread reaches the other through the loop's token.
        self._loop_token = anyio.lowlevel.current_token()
        self._loop_thread = threading.get_ident()
        self._drained, self._faulted = anyio.Event(), anyio.Event()
        if watchdog is not None:
            watchdog.when_fatal(self._on_fatal)

    def _on_fatal(self, _why: str) -> None:
        if threading.get_ident() == self._loop_thread:
            self._faulted.set()
            return
        with contextlib.suppress(RuntimeError):  # the loop has ended: no one waits
            anyio.from_thread.run_sync(self._faulted.set, token=self._loop_token)

    async def submit(
        self, tokens: Sequence[int] | np.ndarray, *, request_id: str | None = None,
        priority: int = 0, warmup: bool = False, handoff: str | bool | None = None,
        deadline_s: float | None = None,
    ) -> Handle:  # fmt: skip
        """Queue a prompt (token ids). Raises :class:`RequestRejected` for bad input
        (the intake checks it: ``wavepp.runtime.intake``).

        ``handoff``: hand the prompt's cache on when it ends — an address
        (``unix:/path``, ``tcp://host:port``) or True for the run's default
        (``docs/handoff.md``); the result's ``handoff`` says how every stage's band went.

        ``deadline_s``: the result is due this many wall-clock seconds after this call
        (``Result.submitted_at``; seconds > 0, at most 1e6). With the ``edf`` policy
        (``queue_order``) rank 0 offers a class's requests earliest deadline first; the
        result's ``deadline_met`` says whether it was done in time."""
        rid = self._new_id() if request_id is None else request_id
        spec = RequestSpec(rid, tokens, warmup, 0, handoff=handoff,  # type: ignore[arg-type]
                           deadline_s=deadline_s)  # fmt: skip
        return self.submit_spec(spec, priority)

    def submit_spec(self, spec: RequestSpec, priority: int = 0) -> Handle:
        """Queue a request built elsewhere (a workload generator, a requests file)."""
        return Handle(self._c.submit(spec, priority))

    def _new_id(self) -> str:
        while True:
            candidate = f"{self.run_id}-{next(self._ids)}"
            if not self._c.taken(RequestId(candidate)):
                return candidate

    def cancel(self, request_id: str, reason: str = "cancelled") -> bool:
        """Cancel wherever it is (its result's error says ``reason``); False if the id is
        unknown or already over."""
        return self._c.cancel(RequestId(request_id), reason)

    async def results(self) -> AsyncIterator[Result]:
        """Every result from now on, as requests end."""
        stream = self._c.subscribe()
        async with stream:
            async for result in stream:
                yield result

    def drain(self) -> None:
        """Take no new requests; the run ends when the submitted ones have ended."""
        self._c.drain()
        self._drained.set()

    async def until_draining(self) -> None:
        """Return once :meth:`drain` was called."""
        await self._drained.wait()

    async def until_fault(self) -> None:
        """Return once the runtime can no longer answer (:meth:`fault` says why)."""
        await self._faulted.wait()

    @property
    def draining(self) -> bool:
        return self._c.draining

    def finished(self) -> bool:
        """Drained and nothing left running."""
        return self._c.draining and not self._c.num_unfinished()

    def health(self) -> tuple[bool, str]:
        """(False, why) when the heartbeats say a rank is dead or hung."""
        if self._watchdog is not None:
            problem = self._watchdog.peer_report()
            if problem:
                return False, problem
        return True, "ok"

    def fault(self) -> str | None:
        """Why the runtime can no longer answer (a rank dead or hung), or None."""
        return self._watchdog.fatal if self._watchdog is not None else None

    def stats(self) -> dict:
        """A snapshot for metrics: counts, tokens, queue, reuse, every stage, rounds, and
        the size of every rank-0 table (``tables``) and the caps of those that are windows
        of recent history (``table_limits``)."""
        wall = max(time.time() - self.started_at, 1e-9)
        figures = self._c.stage_figures()
        if self._watchdog is not None:  # the other stages' figures ride on their heartbeats
            figures.update(self._watchdog.peer_stats())
        stages = {rank: {"utilization": min(1.0, f.get("busy_s", 0.0) / wall),
                         "pool_cached": f.get("cached", 0), "pool_free": f.get("free", 0),
                         "pool_capacity": f.get("capacity", 0),
                         **{k: f[k] for k in (*HOLD_FIGURES, *PULL_FIGURES) if k in f}}
                  for rank, f in figures.items()}  # fmt: skip
        return {**self._c.figures(), "stages": dict(sorted(stages.items())), "uptime_s": wall,
                "tables": self._c.sizes(),
                "table_limits": self._c.limits()}  # fmt: skip
