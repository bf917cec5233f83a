"""Issue 17: measurement never waits on a warm-up request that can no longer finish,
however it ended early (rejected, cancelled, failed)."""

import sys

import anyio
import numpy as np
import pytest

from wavepp.runtime.feed import Feed
from wavepp.runtime.records import RequestRejected
from wavepp.workload import RequestSpec


class _Handle:
    def __init__(self, rid: str) -> None:
        self.request_id = rid
        self.event = anyio.Event()

    async def result(self):
        await self.event.wait()
        return self.request_id


class _Engine:
    """Ends each warm-up the way ``endings`` says; measured requests finish at once."""

    def __init__(self, endings: dict[str, str]) -> None:
        self.endings = endings
        self.submitted: list[str] = []
        self.cancelled: list[str] = []

    def submit_spec(self, spec, priority=0):
        self.submitted.append(spec.request_id)
        ending = self.endings.get(spec.request_id, "done")
        if ending == "rejected":
            raise RequestRejected(f"{spec.request_id}: too long")
        handle = _Handle(spec.request_id)
        if ending in ("done", "cancelled", "failed"):
            handle.event.set()  # it ended (the status does not matter to the feed)
        return handle

    def cancel(self, rid):
        self.cancelled.append(rid)
        return False


def _spec(rid, warmup):
    return RequestSpec(rid, np.arange(4, dtype=np.int32), warmup, 0)


@pytest.mark.parametrize("ending", ["rejected", "cancelled", "failed"])
def test_measurement_starts_after_warmups_that_ended_early(ending):
    specs = [_spec("w0", True), _spec("w1", True), _spec("m0", False), _spec("m1", False)]
    engine = _Engine({"w0": ending, "w1": ending})
    lines: list[str] = []
    feed = Feed(engine, specs, concurrency=1, progress=False, log=lines.append)

    async def run() -> None:
        with anyio.fail_after(60):  # a hang guard: the bug was an endless wait
            await feed()

    anyio.run(run)
    assert engine.submitted == ["w0", "w1", "m0", "m1"]
    assert feed.measure_start is not None and feed.measure_end >= feed.measure_start
    # the machine's CPU counters at both ends of the measured phase (for its steal share)
    assert (feed.cpu_at_start is None) == (feed.cpu_at_end is None)
    if sys.platform.startswith("linux"):  # /proc/stat is there to read
        assert feed.cpu_at_end is not None
    said_rejected = any("every one of the 2 warm-up requests was rejected" in x for x in lines)
    assert said_rejected == (ending == "rejected")


class _Pending(_Engine):
    """Measured requests stay in flight until the test lets them finish."""

    def __init__(self) -> None:
        super().__init__({})
        self.handles: list[_Handle] = []

    def submit_spec(self, spec, priority=0):
        self.submitted.append(spec.request_id)
        self.handles.append(_Handle(spec.request_id))
        return self.handles[-1]


@pytest.mark.parametrize(("concurrency", "together"), [(8, 8), (3, 3)])
def test_requests_that_arrive_together_are_submitted_together(concurrency, together):
    """Closed loop: the first ``concurrency`` requests are queued before the engine's
    admission task gets to run, so they meet in one round (a yield after each put the
    first alone in its round, and its wave went out nearly empty)."""
    specs = [_spec(f"m{i}", False) for i in range(8)]
    engine = _Pending()
    feed = Feed(engine, specs, concurrency=concurrency, progress=False, log=lambda _: None)
    seen_first: list[int] = []

    async def admission_task() -> None:  # what the admitter sees when it first runs
        seen_first.append(len(engine.submitted))
        while len(engine.submitted) < len(specs) or any(
            not h.event.is_set() for h in engine.handles
        ):
            for h in engine.handles:
                h.event.set()
            await anyio.sleep(0)

    async def run() -> None:
        with anyio.fail_after(60):  # a hang guard
            async with anyio.create_task_group() as tg:
                tg.start_soon(feed)
                tg.start_soon(admission_task)

    anyio.run(run)
    assert seen_first == [together]
    assert engine.submitted == [s.request_id for s in specs]
