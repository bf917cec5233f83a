"""The run's record: each stage's figures and leak check, gathered on rank 0 into the
report it prints and the JSON it writes (``docs/design.md`` §9)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from wavepp.config import RunConfig
from wavepp.exec.base import Executor
from wavepp.exec.stage import Stage
from wavepp.host import steal_share
from wavepp.launch.log import log
from wavepp.launch.setup import Setup
from wavepp.metrics import summarize, table
from wavepp.policy import Policy
from wavepp.rounds.messages import StageReport
from wavepp.state import audit, usage
from wavepp.timeline import chrome_trace, write_trace
from wavepp.transport.planes import Planes

if TYPE_CHECKING:
    from wavepp.launch.rank import RankZero


def stage_report(rank: int, stage: Stage, executor: Executor, interrupted: bool) -> StageReport:
    """This stage's figures and its leak check (done locally only when interrupted: the
    planes may hold abandoned transfers)."""
    book = stage.book
    error = ""
    try:
        audit(book.cache)
    except Exception as failure:  # reported, and fails the run
        error = str(failure)
    if not interrupted:
        disagreement = executor.finish()  # a TP leader's other ranks stop here
        if disagreement:
            error = error or f"stage {rank}: {disagreement}"
            log(error)
    use = usage(book.cache)
    memory = executor.memory_report()
    if not use.balanced and not error and not interrupted:
        held = ", ".join(f"{rid} {claim}" for rid, claim in list(book.cache.claims.items())[:5])
        error = f"stage {rank} still holds claims at the end: {held}"
        log(error)
    return StageReport(
        stage=rank, busy_s=stage.busy_s, first_start=stage.first_start or 0.0,
        last_end=stage.last_end, num_waves=stage.num_waves, probe_us=list(book.probe_us),
        leases=use.num_leases, escrowed=use.num_escrowed, referenced=use.num_referenced,
        pending=use.num_pending, cached=use.num_cached, free=use.num_free,
        capacity=use.capacity, balanced=use.balanced and not error, error=error,
        spans=stage.spans or [], snapshots=use.num_snapshots,
        snapshot_pending=use.num_snapshot_pending, snapshot_pinned=use.num_snapshot_pinned,
        snapshot_capacity=use.snapshot_capacity,
        kv_bytes=int(memory.get("kv_pool_bytes", 0)),
        snapshot_bytes=int(memory.get("snapshot_bytes", 0)),
    )  # fmt: skip


def run_record(c: RunConfig, world: int, zero: RankZero, reports: list[StageReport],
               setup: Setup, planes: Planes, policy: Policy, simulated: bool,
               interrupted: int | None) -> dict:  # fmt: skip
    """Rank 0's JSON record of the run."""
    book, feed = zero.coordinator.run_book(), zero.feed
    records = book.records
    measure_start = feed.measure_start if feed else zero.engine.started_at
    measure_end = (feed.measure_end if feed else None) or time.time()
    record = summarize(
        records, reports, measure_start=measure_start or measure_end, measure_end=measure_end,
        round_seconds=book.round_seconds, num_rounds=book.num_rounds,
        time_scale=c.time_scale, round_cpu_s=book.round_cpu_s,
        simulated=simulated, config={**attrs.asdict(c), "stages": world,
                                     "rounds_plane": planes.rounds.kind,
                                     "data_plane": planes.data_kind,
                                     "capacity_blocks": [r.capacity for r in reports],
                                     **({} if feed else {"workload": "clients"})},
    )  # fmt: skip
    record["rejected"] = setup.rejected
    # this machine's CPU the hypervisor took while the measured requests ran (a shared VM)
    record["cpu_steal_share"] = steal_share(feed.cpu_at_start, feed.cpu_at_end) if feed else None
    record["handoff"] = book.handoff_totals  # requests by outcome
    record["policy"] = policy.describe()
    record["placement"] = setup.placement.as_record()
    record["pools_from"] = ("--capacity-blocks" if c.capacity_blocks.strip() not in ("", "0")
                            else "device memory" if setup.pools else "workload")  # fmt: skip
    # Of admitted requests, summed over rounds: agreed point below some stage's hit,
    # lowest lease below the MIN of the probes, no common point in the first mask window.
    record["admission_counters"] = book.counters.to_json()
    if interrupted:
        ended = sum(1 for r in records if r.done_at is not None and not r.spec.warmup)
        total = len(feed.specs) - sum(1 for s in feed.specs if s.warmup) if feed else len(records)
        record["interrupted"] = signal.Signals(interrupted).name
        log(f"interrupted after {ended} of {total} requests")
    if c.trace_out:
        write_trace(c.trace_out, chrome_trace(reports, book.round_spans, simulated))
        log(f"wrote timeline {c.trace_out}")
    return record


def publish(record: dict, status: int, json_path: str | None) -> None:
    """Print the report, write the record to ``json_path`` (--json)."""
    print(table(record))
    if json_path:
        Path(json_path).write_text(json.dumps(record, indent=2) + "\n")
        log(f"wrote {json_path}")
    if status == 1:
        log("leak check FAILED on some stage (see leak_check in the record)")
