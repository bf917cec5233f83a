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

import itertools
import time
from collections.abc import AsyncIterator, Sequence

import numpy as np

from wavepp.ids import id_problem
from wavepp.runtime.coordinator import Coordinator
from wavepp.runtime.records import RequestRejected, Result
from wavepp.state import RequestId, usage
from wavepp.workload import RequestSpec

__all__ = ["Engine", "Handle", "RequestRejected", "Result"]


class Handle:
    """A submitted request; ``await handle.result()`` when it ends, however it ends."""

    def __init__(self, record) -> None:
        self.request_id: str = record.spec.request_id
        self._record = record

    async def result(self) -> Result:
        await self._record.finished.wait()
        return self._record.result()

    def done(self) -> bool:
        return self._record.finished.is_set()


class Engine:
    """Rank 0's front door to the runtime."""

    def __init__(
        self, coordinator: Coordinator, vocab_size: int | None, watchdog=None,
        retain_finished: int | None = None,
    ) -> None:  # fmt: skip
        self._c = coordinator
        coordinator.intake.retain_finished = retain_finished  # None: keep every record
        self.vocab_size = vocab_size  # None: token ids are not checked (the sim executor)
        self.min_capacity = coordinator.intake.min_capacity
        self.block_size = coordinator.stage.block_size
        events = coordinator.loop.events  # --kv-events: where they are published, else None
        self.kv_events = None if events is None else dict(events.info)
        self._watchdog = watchdog
        self._ids = itertools.count()
        self.started_at = time.time()

    async def submit(
        self, tokens: Sequence[int] | np.ndarray, *, request_id: str | None = None,
        priority: int = 0, warmup: bool = False, handoff: str | bool | None = None,
        deadline_s: float | None = None,
    ) -> Handle:  # fmt: skip
        """Queue a prompt (token ids). Raises :class:`RequestRejected` for bad input.

        ``handoff``: hand the prompt's cache on when it ends — an address
        (``unix:/path``, ``tcp://host:port``) or True for the run's default
        (``docs/handoff.md``); the result's ``handoff`` says how every stage's band went.

        ``deadline_s``: the result is due this many wall-clock seconds after this call
        (``Result.submitted_at``; seconds > 0, at most 1e6). With the ``edf`` policy
        (``queue_order``) rank 0 offers a class's requests earliest deadline first; the
        result's ``deadline_met`` says whether it was done in time."""
        spec = RequestSpec(self._request_id(request_id), self._tokens(tokens), warmup, 0,
                           handoff=handoff, deadline_s=deadline_s)  # fmt: skip
        return self.submit_spec(spec, priority)

    def submit_spec(self, spec: RequestSpec, priority: int = 0) -> Handle:
        """Queue a request built elsewhere (a workload generator, a requests file)."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise RequestRejected(f"priority must be an integer, got {priority!r}")
        return Handle(self._c.intake.submit(spec, priority))

    def _request_id(self, request_id: str | None) -> str:
        if request_id is None:
            while True:
                candidate = f"req-{next(self._ids)}"
                if RequestId(candidate) not in self._c.intake.records:
                    return candidate
        problem = id_problem(request_id)  # the one id rule (wavepp.runtime.records.ID_RULE)
        if problem:
            raise RequestRejected(problem, "invalid")
        return request_id

    def _tokens(self, tokens) -> np.ndarray:
        if isinstance(tokens, np.ndarray):
            array = tokens
        else:
            if not all(isinstance(t, int | np.integer) and not isinstance(t, bool) for t in tokens):
                raise RequestRejected("token ids must be integers")
            array = np.asarray(list(tokens), dtype=np.int64)
        if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
            raise RequestRejected("a prompt is a flat list of integer token ids")
        if array.size == 0:
            raise RequestRejected("empty prompt (need at least one token)")
        top = self.vocab_size if self.vocab_size is not None else 2**31
        bad = array[(array < 0) | (array >= top)]
        if bad.size:
            raise RequestRejected(f"{bad.size} token ids outside the vocabulary 0..{top - 1}, "
                                  f"e.g. {int(bad[0])}")  # fmt: skip
        return array.astype(np.int32)

    def cancel(self, request_id: str, reason: str = "cancelled") -> bool:
        """Cancel wherever it is (its result's error says ``reason``); False if the id is
        unknown or already over."""
        return self._c.cancel(RequestId(request_id), reason)

    async def results(self) -> AsyncIterator[Result]:
        """Every result from now on, as requests end."""
        stream = self._c.intake.subscribe()
        async with stream:
            async for result in stream:
                yield result

    def drain(self) -> None:
        """Take no new requests; the run ends when the submitted ones have ended."""
        self._c.intake.draining = True
        self._c.stop_when_idle()

    @property
    def draining(self) -> bool:
        return self._c.intake.draining

    def finished(self) -> bool:
        """Drained and nothing left running."""
        return self._c.intake.draining and not self._c.intake.num_unfinished

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
        """A snapshot for metrics: counts, tokens, queue, reuse, every stage, rounds."""
        intake, stage = self._c.intake, self._c.stage
        wall = max(time.time() - self.started_at, 1e-9)
        use = usage(stage.book.cache)
        stages = {stage.index: {"utilization": min(1.0, stage.busy_s / wall),
                                "pool_cached": use.num_cached, "pool_free": use.num_free,
                                "pool_capacity": use.capacity}}  # fmt: skip
        if self._watchdog is not None:  # the other stages' figures ride on their heartbeats
            for rank, figures in self._watchdog.peer_stats().items():
                busy = figures.get("busy_s", 0.0)
                stages[rank] = {"utilization": min(1.0, busy / wall),
                                "pool_cached": figures.get("cached", 0),
                                "pool_free": figures.get("free", 0),
                                "pool_capacity": figures.get("capacity", 0)}  # fmt: skip
        return {
            "requests": intake.count_by_status(),
            "queue_depth": len(intake.waiting),
            "input_tokens": intake.tokens_done,
            "cached_tokens": intake.tokens_cached,
            "good_hits": intake.good_hits,
            "handoffs": dict(intake.handoff_totals),  # handed-off requests by outcome
            "with_deadline": intake.with_deadline,  # ended requests that carried a deadline
            "deadlines_met": intake.deadlines_met,  # of those, done by their deadline
            "expecting_reuse": intake.expecting_reuse,
            "stages": dict(sorted(stages.items())),
            "admission_round_seconds": list(self._c.admitter.round_seconds[-1024:]),
            "admission_rounds": len(self._c.admitter.round_seconds),
            "uptime_s": wall,
        }
