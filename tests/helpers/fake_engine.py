"""A stand-in engine for the server's tests: no ranks, no model.

It keeps the contract of ``wavepp.engine.Engine`` (``wavepp.serve.protocol.ServedEngine``;
``tests/unit/test_serve_protocol.py`` checks both): ``submit`` checks the prompt and
raises :class:`wavepp.errors.RequestRejected` with its reason, results are
``wavepp.engine.Result``, ``stats()`` has the engine's shape; requests wait in a
:class:`~wavepp.queueing.WaitingQueue`, admission offers the queue's head and admits
the longest prefix that fits a token capacity, an admitted batch "runs" for a time
proportional to its uncached tokens, and every request ends with one result. The first
token is a pure function of the prompt, so tests can predict it.
"""

from __future__ import annotations

import math
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator

import anyio
import attrs
import numpy as np

from wavepp.engine import Result
from wavepp.errors import RequestRejected
from wavepp.handoff.wire import PULL_TARGET
from wavepp.queueing import WaitingQueue
from wavepp.runtime.handoff import BandServers


def expected_first_token(tokens, vocab_size: int) -> int:
    """The stand-in's answer for a prompt."""
    return zlib.crc32(np.asarray(tokens, dtype=np.int32).tobytes()) % vocab_size


@attrs.define
class _Request:
    request_id: str
    tokens: np.ndarray
    priority: int
    submitted_at: float
    deadline_s: float | None = None
    handoff: str | bool | None = None
    done: anyio.Event = attrs.field(factory=anyio.Event)
    result: Result | None = None
    admitted_at: float | None = None
    cancelled: bool = False
    error: str | None = None


class FakeHandle:
    def __init__(self, request: _Request) -> None:
        self._request = request
        self.request_id = request.request_id

    async def result(self) -> Result:
        await self._request.done.wait()
        assert self._request.result is not None
        return self._request.result

    async def answer(self) -> Result:
        """Its result; for a ``pull:`` handoff, a done result whose handoff is ``held``
        (the stand-in holds nothing: its bands are never pulled)."""
        result = await self.result()
        if self._request.handoff != PULL_TARGET or result.status != "done":
            return result
        return attrs.evolve(result, handoff={"target": PULL_TARGET, "status": "held",
                                             "held_since": result.done_at, "stages": []})


class FakeEngine:
    """Call :meth:`run` in a task next to the server; it returns once drained."""

    def __init__(
        self,
        vocab_size: int = 1000,
        capacity_tokens: int = 4096,
        tokens_per_s: float = 50_000,
        block_size: int = 16,
        batch: int = 8,
        queue_order: str = "fcfs",
    ) -> None:
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.kv_events: dict | None = None
        self.run_id = "0123456789abcdef"
        # two stages' band servers (nothing listens: the stand-in's bands are never pulled)
        self.band_servers: BandServers | None = BandServers(
            ("unix:/fake/h-stage0.sock", "tcp://127.0.0.1:7301"), 30.0)  # fmt: skip
        self.capacity_tokens = capacity_tokens
        self.tokens_per_s = tokens_per_s
        self.batch = batch
        self.queue = WaitingQueue(queue_order)
        self.requests: dict[str, _Request] = {}
        self.running: list[_Request] = []
        self.cached: set[bytes] = set()
        self.draining = False
        self.healthy = (True, "")
        self.fatal: str | None = None  # set by fail(): the stand-in's dead rank
        self.counts = dict.fromkeys(
            ("queued", "admitted", "running", "done", "cancelled", "rejected", "failed"), 0
        )
        self.tokens_in = 0
        self.tokens_cached = 0
        self.rounds = 0
        self.round_seconds: deque[float] = deque(maxlen=1024)
        self.busy_s = 0.0
        self.started_at = time.time()
        self._wake = anyio.Event()
        self._drained, self._faulted = anyio.Event(), anyio.Event()
        self._resumed: anyio.Event | None = None  # set while paused: run() admits nothing
        self._subscribers: list = []
        self._next_id = 0

    # -- the engine interface ------------------------------------------------------------

    async def submit(self, tokens, *, request_id=None, priority=0, warmup=False,
                     handoff=None, deadline_s=None) -> FakeHandle:  # fmt: skip
        if self.draining:
            raise RequestRejected("draining: no new requests are taken", "draining")
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.size == 0:
            raise RequestRejected("empty prompt (need at least one token)")
        bad = ids[(ids < 0) | (ids >= self.vocab_size)]
        if bad.size:  # the intake's words (wavepp.runtime.intake)
            raise RequestRejected(f"{bad.size:,} token ids outside the vocabulary "
                                  f"0..{self.vocab_size - 1}, e.g. {int(bad[0])}")  # fmt: skip
        if ids.size > self.capacity_tokens:
            raise RequestRejected(
                f"prompt of {ids.size:,} tokens can never fit: the smallest "
                f"stage pool holds {self.capacity_tokens:,}", "too_long"
            )
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        if request_id in self.requests:
            raise RequestRejected(f"duplicate request id {request_id!r}", "duplicate")
        now = time.time()
        request = _Request(request_id, ids.astype(np.int32), priority, now, deadline_s, handoff)
        self.requests[request_id] = request
        self.queue.push(request_id, priority, None if deadline_s is None else now + deadline_s)
        self.counts["queued"] += 1
        self._wake.set()
        return FakeHandle(request)

    def cancel(self, request_id: str, reason: str = "cancelled") -> bool:
        request = self.requests.get(request_id)
        if request is None or request.result is not None or request.cancelled:
            return False
        request.cancelled, request.error = True, reason
        if self.queue.remove(request_id):
            self.counts["queued"] -= 1
            self._finish(request, "cancelled")
        return True

    async def results(self) -> AsyncIterator[Result]:
        send, receive = anyio.create_memory_object_stream[Result](math.inf)
        self._subscribers.append(send)
        try:
            async with receive:
                async for result in receive:
                    yield result
        finally:
            self._subscribers.remove(send)

    def stats(self) -> dict:
        wall = max(time.time() - self.started_at, 1e-9)
        stage = {"utilization": min(1.0, self.busy_s / wall), "pool_capacity":
                 self.capacity_tokens, "pool_free": self.capacity_tokens - self._used()}
        queued = [self.requests[rid] for rid in self.queue]
        admitted = sum(r.tokens.size - self._cached_tokens(r.tokens) for r in self.running)
        return {
            "requests": dict(self.counts),
            "queue_depth": len(self.queue),
            "tokens_waiting": {"queued": sum(r.tokens.size for r in queued),
                               "admitted": admitted},
            "queue_oldest_seconds": time.time() - min(r.submitted_at for r in queued)
            if queued else 0.0,
            "input_tokens": self.tokens_in,
            "cached_tokens": self.tokens_cached,
            "stages": {0: stage, 1: dict(stage)},
            "admission_round_seconds": list(self.round_seconds),
            "admission_rounds": self.rounds,
            "uptime_s": wall,
            "tables": {"requests": len(self.requests), "queue": len(self.queue)},
        }

    def health(self) -> tuple[bool, str]:
        return (False, self.fatal) if self.fatal else self.healthy

    def fault(self) -> str | None:
        return self.fatal

    def fail(self, reason: str) -> None:
        """Stand in for a dead rank: nothing ends any more; fault() says why."""
        self.fatal = reason
        self._faulted.set()
        self.pause()

    def drain(self) -> None:
        self.draining = True
        self._drained.set()
        self._wake.set()

    async def until_draining(self) -> None:
        await self._drained.wait()

    async def until_fault(self) -> None:
        await self._faulted.wait()

    # -- the stand-in runtime ------------------------------------------------------------

    def pause(self) -> None:
        """Admit nothing until :meth:`resume` (requests queue up)."""
        if self._resumed is None:
            self._resumed = anyio.Event()

    def resume(self) -> None:
        if self._resumed is not None:
            self._resumed.set()
            self._resumed = None

    def _used(self) -> int:
        return sum(r.tokens.size for r in self.running)

    def _cached_tokens(self, tokens: np.ndarray) -> int:
        n = 0
        for end in range(self.block_size, tokens.size, self.block_size):
            if tokens[:end].tobytes() not in self.cached:
                break
            n = end
        return n

    def _finish(self, request: _Request, status: str) -> None:
        now = time.time()
        cached = self._cached_tokens(request.tokens) if status == "done" else 0
        done = status == "done"
        request.result = Result(
            request.request_id,
            status,
            expected_first_token(request.tokens, self.vocab_size) if done else None,
            1.5 if done else None,
            int(request.tokens.size),
            cached,
            None if done else request.error,
            request.submitted_at,
            request.admitted_at,
            request.admitted_at if done else None,
            now,
            deadline_s=request.deadline_s,
            deadline_met=None if request.deadline_s is None
            else done and now <= request.submitted_at + request.deadline_s,
        )
        self.counts[status] += 1
        if done:
            self.tokens_in += int(request.tokens.size)
            self.tokens_cached += cached
            for end in range(self.block_size, request.tokens.size + 1, self.block_size):
                self.cached.add(request.tokens[:end].tobytes())
        request.done.set()
        for send in list(self._subscribers):
            send.send_nowait(request.result)

    def _admit(self) -> None:
        t0 = time.perf_counter()
        room = self.capacity_tokens - self._used()
        admitted = []
        for request_id in self.queue.head(self.batch):
            request = self.requests[request_id]
            if request.tokens.size > room:
                break  # FCFS cut: nobody overtakes a refused request
            room -= request.tokens.size
            admitted.append(request)
        self.queue.pop_admitted([r.request_id for r in admitted])
        for request in admitted:
            request.admitted_at = time.time()
            self.counts["queued"] -= 1
            self.counts["running"] += 1
            self.running.append(request)
        self.round_seconds.append(time.perf_counter() - t0)
        self.rounds += 1

    async def run(self) -> None:
        """Admit and run until drained (every request submitted has its result)."""
        while not (self.draining and not self.queue and not self.running):
            if not self.queue and not self.running:
                self._wake = anyio.Event()
                await self._wake.wait()
                continue
            if self._resumed is not None:
                await self._resumed.wait()
                continue
            self._admit()
            batch = list(self.running)
            work = sum(r.tokens.size - self._cached_tokens(r.tokens) for r in batch)
            seconds = max(work / self.tokens_per_s, 0.001)
            await anyio.sleep(seconds)
            self.busy_s += seconds
            for request in batch:
                self.running.remove(request)
                self.counts["running"] -= 1
                self._finish(request, "cancelled" if request.cancelled else "done")
