"""One stage's run (with ``--tp``, on its leader): its planes, the agreed setup, the
stage built by the backend, rank 0's coordinator and client or a follower's tasks, and
the leak check gathered into rank 0's record."""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable

import anyio
import anyio.to_thread
import attrs

from wavepp.config import RunConfig, handoff_secret, kv_events_replay
from wavepp.engine import Engine
from wavepp.exec import compute
from wavepp.exec.base import Executor
from wavepp.exec.stage import Stage
from wavepp.exec.tp import StageGroups, StagePlan, send_plan
from wavepp.ids import RETAINED_IDS
from wavepp.kv_events.changes import StageLog, report_limit
from wavepp.launch.backends import Backend
from wavepp.launch.lifecycle import FAULT_GRACE_S, Lifecycle, blame
from wavepp.launch.log import log
from wavepp.launch.record import run_record, stage_report
from wavepp.launch.setup import Setup, agree_band_servers, agree_setup, open_planes
from wavepp.plan import CostFit, CostModel, PlanContext
from wavepp.plan.cost import PRIOR_WEIGHT
from wavepp.policy import Policy, PolicyError, for_run
from wavepp.rounds.admission import RoundMode, StageBook
from wavepp.rounds.messages import StageReport, decode_untrusted, encode
from wavepp.rungs import RUNGS
from wavepp.runtime.coordinator import Coordinator
from wavepp.runtime.feed import Feed
from wavepp.runtime.followers import follow_rounds, follow_waves
from wavepp.runtime.handoff import BandServers, HandoffTargets
from wavepp.runtime.planning import WavePlanner
from wavepp.transport.base import PlaneError
from wavepp.transport.planes import Planes
from wavepp.transport.watchdog import Watchdog

Client = Callable[[Engine], Awaitable[None]]


def pick_policy(c: RunConfig, rung) -> Policy:
    """The policy in use: ``--policy`` (or the default), single fields overridden by
    ``--planner`` / ``--probe`` / ``--eviction``, the rest filled in by the rung."""
    try:
        return for_run(c.policy or "default", linear_probe=rung.linear_probe,
                       rung_planner=rung.planner, planner=c.planner, probe=c.probe,
                       eviction=c.eviction)  # fmt: skip
    except PolicyError as error:
        raise SystemExit(f"wavepp: {error}") from None


@attrs.frozen
class StageParts:
    """This rank's stage and what it was built from."""

    stage: Stage
    executor: Executor
    policy: Policy
    mode: RoundMode
    handoff_targets: HandoffTargets | None  # where rank 0 sends requests' caches
    cache_log: StageLog | None  # with --kv-events
    look_ahead: bool  # the rung's: the next wave's host work while this one runs


def build_stage_parts(c: RunConfig, backend: Backend, rank: int, world: int, setup: Setup,
                      planes: Planes, groups: StageGroups | None = None) -> StageParts:  # fmt: skip
    """The policy, the executor, the stage's cache book and its handoff settings."""
    policy = pick_policy(c, RUNGS[c.rung])
    mode = RoundMode(block_size=c.block_size, eager=RUNGS[c.rung].eager, policy=policy)
    snapshot_capacity = c.snapshot_capacity or setup.capacity
    executor = backend.build_executor(rank, world, setup.capacity, snapshot_capacity,
                                      setup.placement, groups)  # fmt: skip
    planes.set_limits(executor.limits(c.budget))
    recurrent = executor.has_recurrent
    book = StageBook(policy.empty_cache(setup.capacity, has_recurrent=recurrent,
                                        snapshot_capacity=snapshot_capacity))  # fmt: skip
    handoff, handoff_targets = backend.handoff(rank, world, setup.run_id)
    cache_log = (StageLog(rank, recurrent, report_limit(world)) if c.kv_events
                 else None)  # fmt: skip
    stage = Stage(rank, book, executor, c.block_size, c.snapshot_interval, recurrent,
                  policy=policy, handoff=handoff, cache_log=cache_log,
                  record_spans=bool(c.trace_out))  # fmt: skip
    return StageParts(stage, executor, policy, mode, handoff_targets, cache_log,
                      RUNGS[c.rung].look_ahead)  # fmt: skip


def stage_plan(c: RunConfig, rank: int, world: int, setup: Setup) -> StagePlan:
    """What the stage's other TP ranks build: the leader's units and pools."""
    units = setup.placement.spans[rank]
    return StagePlan([units.start, units.stop], rank == 0, rank == world - 1, setup.capacity,
                     c.snapshot_capacity or setup.capacity)  # fmt: skip


def start_kv_events(c: RunConfig, world: int, cache_log: StageLog, hybrid: bool):
    """Rank 0 with --kv-events: the publisher (bound now) and what feeds it."""
    from wavepp.kv_events.changes import Announcer, PipelineView
    from wavepp.kv_events.events import EventPublisher

    try:
        publisher = EventPublisher(c.kv_events, kv_events_replay(c), topic=c.kv_events_topic,
                                   block_size=c.block_size,
                                   secret=handoff_secret(c))  # fmt: skip
    except OSError as error:
        raise SystemExit(f"wavepp: --kv-events: {error}") from None
    view = PipelineView(world, c.block_size, cache_log.tokens.get)
    info = {"endpoint": publisher.endpoint, "replay": publisher.replay_endpoint,
            "topic": publisher.topic, "block_size": c.block_size, "recurrent": hybrid,
            "signed": publisher.signed}
    announcer = Announcer(view, publisher.publish, info)
    log(f"KV events on {publisher.endpoint} (replay {publisher.replay_endpoint}, topic "
        f"{publisher.topic!r}{', signed' if publisher.signed else ''}): blocks every stage holds"
        + (", and the points every L stage can resume from (group 1)" if hybrid else ""))
    return publisher, announcer


class RankZero:
    """Rank 0's run: the coordinator, the engine, and the client that feeds it (the
    offline workload, or ``client(engine)``)."""

    def __init__(self, c: RunConfig, world: int, setup: Setup, planes: Planes,
                 parts: StageParts, announcer, watchdog: Watchdog | None,
                 client: Client | None,
                 band_servers: BandServers | None = None) -> None:  # fmt: skip
        self.client = client
        self.watchdog = watchdog
        stage = parts.stage
        ctx = PlanContext(c.budget, c.ring or 2 * world, c.min_budget, stages=world)
        fit = CostFit(prior=CostModel(*parts.executor.prior_cost()), weight=PRIOR_WEIGHT)
        self.coordinator = Coordinator(
            RUNGS[c.rung], planes.rounds, stage, planes.outbound, planes.done,
            WavePlanner(parts.policy.planner, ctx, fit), parts.mode,
            min_capacity=setup.min_capacity, vocab_size=setup.vocab,
            ring=c.ring or 2 * world, max_batch=c.max_batch, heartbeat_s=c.heartbeat_s,
            log=log, num_stages=world, handoff_target=parts.handoff_targets,
            events=announcer, retain_ended=None if client is None else RETAINED_IDS,
            timeline=bool(c.trace_out),
        )  # fmt: skip
        self.engine = Engine(self.coordinator, vocab_size=setup.vocab,
                             min_capacity=setup.min_capacity, block_size=stage.block_size,
                             kv_events=None if announcer is None else announcer.info,
                             watchdog=watchdog, band_servers=band_servers,
                             run_id=setup.run_id)  # fmt: skip
        self.feed = None
        if client is None:
            self.feed = Feed(self.engine, setup.specs, concurrency=c.concurrency,
                             progress=c.progress, log=log,
                             cancels=[(rid, after * c.time_scale)
                                      for rid, after in setup.cancels])  # fmt: skip

    async def run(self) -> None:
        if self.feed is not None:
            await self.coordinator.run(self.feed)
        else:
            await self._beside_the_runtime()

    async def _beside_the_runtime(self) -> None:
        """Run ``client(engine)`` next to the runtime rather than inside it: when the
        runtime fails (a peer dead), the watchdog records why and the client (the HTTP
        server) gets up to FAULT_GRACE_S to answer every caller in its own shape, naming
        the cause, before the failure ends this rank."""
        client_done = anyio.Event()
        watchdog = self.watchdog

        async def run_client() -> None:
            try:
                await self.client(self.engine)
            finally:
                client_done.set()
                if watchdog is not None:
                    watchdog.answered()

        async with anyio.create_task_group() as tg:
            tg.start_soon(run_client)
            try:
                await self.coordinator.run(client_done.wait)
            except Exception as error:
                if watchdog is not None:  # the callers' answers name the cause
                    with anyio.CancelScope(shield=True):
                        watchdog.declare(await anyio.to_thread.run_sync(blame, watchdog, error))
                    with anyio.move_on_after(FAULT_GRACE_S, shield=True):
                        await client_done.wait()
                raise


async def follow(planes: Planes, parts: StageParts) -> None:
    """Ranks > 0: follow rank 0's rounds and run the waves it sends."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(follow_rounds, planes.rounds, parts.stage, parts.mode)
        tg.start_soon(follow_waves, parts.stage, planes.inbound, planes.outbound, planes.done,
                      parts.look_ahead)  # fmt: skip


async def _unbalanced(rank: int, report: StageReport, watchdog: Watchdog | None) -> None:
    """Stage ``rank`` > 0 ended its run still holding requests: rank 0 stopped it early
    because the run failed (a peer gone: PlaneError naming it, via the watchdog), or its
    leak check failed (said here; rank 0's record has the details)."""
    held = (f"stage {rank} still holds {report.leases} leases, {report.escrowed} escrowed "
            f"and {report.pending} pending blocks")  # fmt: skip
    peers = "" if watchdog is None else await anyio.to_thread.run_sync(watchdog.suspects)
    if peers:
        watchdog.declare(peers)
        raise PlaneError(f"rank 0 ended the run early: {held}")
    log(f"leak check failed: {held}")


async def rank_main(c: RunConfig, backend: Backend, life: Lifecycle, rank: int, world: int,
                    client: Client | None = None, sigterm_drains: bool = False,
                    groups: StageGroups | None = None) -> tuple[dict | None, int]:  # fmt: skip
    """Stage ``rank`` of ``world`` (with ``--tp``, on its leader: ``groups``): rank 0's
    record (None elsewhere) and this rank's exit status."""
    watchdog = life.watchdog
    planes = await open_planes(c, backend, rank, world, watchdog, groups)
    compute.call(backend.load)  # torch work on the compute thread alone
    setup = await agree_setup(c, backend, rank, world, planes.rounds, client is None)
    if groups is not None:  # the stage's other ranks build what this one builds
        send_plan(groups, None if setup is None else stage_plan(c, rank, world, setup))
    if setup is None:
        life.end(2)  # a signal from here on (the launcher, as another rank exits 2): exit 2
        return None, 2
    parts = build_stage_parts(c, backend, rank, world, setup, planes, groups)
    stage = parts.stage
    # Every stage is ready (pools zeroed, layers compiled) before rank 0 admits anything:
    # otherwise the run's first round waits out the slowest stage's start-up (2.2 s of a
    # 9.9 s run at P = 2 with --compile), inside the measured time.
    _, attention_only = await planes.rounds.all_min([1, int(not stage.has_recurrent)])
    band_servers = await agree_band_servers(
        planes.rounds, None if stage.handoffs is None else stage.handoffs.address,
        c.handoff_lease_s)  # fmt: skip
    publisher = announcer = None
    if rank == 0 and c.kv_events:
        publisher, announcer = start_kv_events(c, world, parts.cache_log,
                                               hybrid=not attention_only)  # fmt: skip
    if watchdog is not None:  # this stage's figures ride on its heartbeat (for metrics)
        watchdog.publish(stage.figures)
    zero = (RankZero(c, world, setup, planes, parts, announcer, watchdog, client,
                     band_servers) if rank == 0 else None)  # fmt: skip

    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(life.watch, scope, sigterm_drains,
                          zero.engine.drain if zero is not None else None)  # fmt: skip
            if stage.handoffs is not None:
                tg.start_soon(stage.handoffs.run)
            await (zero.run() if zero is not None else follow(planes, parts))
            tg.cancel_scope.cancel()  # the run is over: stop watching signals
    if publisher is not None:
        publisher.close()
    interrupted = life.interrupted
    if interrupted:  # a second Ctrl-C or SIGTERM must not lose the record being written
        life.hold_signals()

    # Leak check on every stage, gathered on rank 0.
    report = stage_report(rank, stage, parts.executor, bool(interrupted))
    if interrupted:
        status = 128 + interrupted
        log(f"interrupted by {signal.Signals(interrupted).name}; stage {rank} holds "
            f"{report.leases} leases, {report.escrowed} escrowed and {report.pending} "
            f"pending blocks")  # fmt: skip
        if rank != 0:
            return None, status
        reports = [report]
    else:
        gathered = await planes.rounds.gather(encode(report))
        if rank != 0:
            if not report.balanced:
                await _unbalanced(rank, report, watchdog)
            return None, 0 if report.balanced else 1
        reports = [decode_untrusted(raw, StageReport) for raw in gathered]
        status = 0 if all(r.balanced for r in reports) else 1
    record = run_record(c, world, zero, reports, setup, planes, parts.policy,
                        parts.executor.simulated, interrupted)  # fmt: skip
    return record, status
