"""The offline client: a workload or requests file run through the Engine API.

Warm-up requests run first (closed loop) and are not measured; measurement starts
when every one of them has ended, however it ended (done, rejected, cancelled or
failed), so no run waits on a request that can no longer finish. The measured requests
then run closed loop at the concurrency, or open loop by their arrival times.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import anyio

from wavepp.host import cpu_times
from wavepp.runtime.records import RequestRejected
from wavepp.workload import RequestSpec


class Handle(Protocol):
    """A submitted request: its result, awaited."""

    async def result(self) -> object: ...


class Engine(Protocol):
    """What the feed asks of rank 0's API (``wavepp.engine.Engine``): submit, cancel."""

    def submit_spec(self, spec: RequestSpec) -> Handle: ...

    def cancel(self, request_id: str) -> bool: ...


class Progress:
    """A bar on a terminal, a line every 10 s in a log; nothing when disabled."""

    def __init__(self, enabled: bool, label: str, total: int) -> None:
        self.enabled, self.label, self.total = enabled, label, total
        self.done = 0
        self.last = 0.0

    def step(self, in_flight: int, final: bool = False) -> None:
        if not self.enabled:
            return
        now = time.time()
        tty = sys.stderr.isatty()
        if not final and now - self.last < (0.5 if tty else 10.0):
            return
        self.last = now
        width = 30
        fill = int(width * self.done / max(self.total, 1))
        bar = "#" * fill + "." * (width - fill)
        start, end = ("\r", "\n" if final else "") if tty else ("", "\n")
        print(f"{start}[{bar}] {self.label} {self.done}/{self.total} in flight {in_flight}",
              end=end, file=sys.stderr, flush=True)  # fmt: skip


class Feed:
    """Runs ``specs`` through ``engine``; ``measure_start`` / ``measure_end`` bound the
    measured phase (wall seconds)."""

    def __init__(
        self, engine: Engine, specs: Sequence[RequestSpec], *, concurrency: int,
        cancels: Sequence[tuple[str, float]] = (), progress: bool = True,
        log: Callable[[str], None] = print,
    ) -> None:  # fmt: skip
        self.engine = engine
        self.specs = list(specs)
        self.concurrency = concurrency
        self.cancels = list(cancels)  # (request id, seconds after measurement starts)
        self.progress = progress
        self.log = log
        self.measure_start: float | None = None
        self.measure_end: float | None = None
        # the machine's CPU counters at both ends (wavepp.host.cpu_times; None off Linux)
        self.cpu_at_start: tuple[int, ...] | None = None
        self.cpu_at_end: tuple[int, ...] | None = None
        self.submitted = 0
        self.total = len(self.specs)
        self._cancelled_early: set[str] = set()  # cancelled before their turn came

    async def __call__(self) -> None:
        warmups = [s for s in self.specs if s.warmup]
        measured = [s for s in self.specs if not s.warmup]
        if warmups:
            self.log(f"warm-up: {len(warmups)} requests (not measured)")
            handles = await self._closed(warmups, "warm-up")
            if not handles:
                self.log(f"every one of the {len(warmups)} warm-up requests was rejected; "
                         "measuring without warm-up")  # fmt: skip
        self.log(f"measuring {len(measured)} requests")
        self.measure_start = time.time()
        self.cpu_at_start = cpu_times()
        async with anyio.create_task_group() as tg:
            for rid, after in self.cancels:
                tg.start_soon(self._cancel_later, rid, after)
            if any(s.arrival_s is not None for s in measured):
                await self._open(measured)
            else:
                await self._closed(measured, "measured")
            self.measure_end = time.time()
            self.cpu_at_end = cpu_times()
            tg.cancel_scope.cancel()  # cancels scheduled after the last request are moot

    def _submit(self, spec: RequestSpec) -> Handle | None:
        self.submitted += 1
        try:
            handle = self.engine.submit_spec(spec)
        except RequestRejected:
            return None  # the intake logged it and recorded it as rejected
        if spec.request_id in self._cancelled_early:
            self.engine.cancel(spec.request_id)
        return handle

    async def _closed(self, specs: list[RequestSpec], label: str) -> list[Handle]:
        """Submit with at most ``concurrency`` outstanding; returns once all ended."""
        handles: list[Handle] = []
        progress = Progress(self.progress, label, len(specs))
        slots = anyio.Semaphore(self.concurrency)

        async def wait(handle: Handle) -> None:
            try:
                await handle.result()
            finally:
                slots.release()
                progress.done += 1
                progress.step(self.concurrency - slots.value)

        async with anyio.create_task_group() as tg:
            for spec in specs:
                # A free slot is taken without yielding: requests that arrive together
                # reach the first round together. (Yielding after each let the round
                # start with one request, and its first wave go out nearly empty.)
                try:
                    slots.acquire_nowait()
                except anyio.WouldBlock:
                    await slots.acquire()
                handle = self._submit(spec)
                if handle is None:
                    slots.release()
                    progress.done += 1
                    continue
                handles.append(handle)
                tg.start_soon(wait, handle)
        progress.step(0, final=True)
        return handles

    async def _open(self, specs: list[RequestSpec]) -> None:
        start = time.time()
        async with anyio.create_task_group() as tg:
            for spec in specs:
                delay = start + (spec.arrival_s or 0.0) - time.time()
                if delay > 0:
                    await anyio.sleep(delay)
                handle = self._submit(spec)
                if handle is not None:
                    tg.start_soon(handle.result)

    async def _cancel_later(self, rid: str, after: float) -> None:
        await anyio.sleep(after)
        if self.engine.cancel(rid):
            self.log(f"cancelled {rid} at {after:.3f} s")
        else:
            self._cancelled_early.add(rid)
