"""``torchrun --nproc-per-node P -m wavepp.main``: one pipeline stage per rank (per
``--tp`` ranks with tensor parallelism inside a stage, its first rank speaking for it).

Sets up the process groups (rounds plane, data-plane links), the stage and its
executor, runs the rank's tasks, checks every stage for leaks, and on rank 0 prints
the report and writes the JSON record.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import functools
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import attrs
import numpy as np
import torch
import torch.distributed as dist

from wavepp.config import (
    RunConfig,
    check_for_world,
    kv_events_replay,
    layer_counts,
    load,
    stage_capacities,
    validate,
)
from wavepp.engine import Engine
from wavepp.exec import compute
from wavepp.exec.device import pick_device, pick_dtype, set_threads
from wavepp.exec.layer_costs import measure as measure_costs
from wavepp.exec.stage import Stage
from wavepp.exec.torch_exec import TorchExecutor
from wavepp.exec.tp import (
    StageGroups,
    StagePlan,
    TPLayout,
    TPLeader,
    follow_leader,
    make_groups,
    receive_plan,
    send_plan,
)
from wavepp.fleet.changes import StageLog, report_limit
from wavepp.handoff.base import HandoffSettings
from wavepp.handoff.socket_send import INLINE_BYTES
from wavepp.host import steal_share
from wavepp.metrics import summarize, table
from wavepp.model import BUILTIN, build_stage, random_weights
from wavepp.model.checkpoint import OWN_CONFIG, load_checkpoint
from wavepp.model.config import RECURRENT, ModelConfig
from wavepp.model.tp import NO_TP, DistTPGroup, check_tp
from wavepp.plan import CostFit, CostModel, PlanContext
from wavepp.plan.cost import PRIOR_WEIGHT
from wavepp.plan.placement import (
    Placement,
    PlacementError,
    WaveShape,
    balanced,
    even,
    given,
    typical_wave,
    whole_layers,
)
from wavepp.policy import Policy, PolicyError, for_run
from wavepp.rounds.admission import RoundMode, StageBook
from wavepp.rounds.messages import MAX_MESSAGE_BYTES, StageReport, decode_untrusted, encode
from wavepp.rounds.plane import RoundsPlane
from wavepp.rungs import RUNGS, Admission
from wavepp.runtime.coordinator import Coordinator
from wavepp.runtime.feed import Feed
from wavepp.runtime.followers import follow_rounds, follow_waves
from wavepp.runtime.handoff import HandoffTargets, fingerprint
from wavepp.runtime.planning import WavePlanner
from wavepp.sim.executor import SimExecutor, StageCostModel
from wavepp.sim.links import SimulatedLink, Topology
from wavepp.sim.measured import (
    MeasuredProfile,
    MeasuredStageCost,
    ProfileError,
    load_profile,
    measured_path,
)
from wavepp.sim.profiles import DEVICES, KV_BYTES, MODELS, StagePool, stage_pool
from wavepp.state import audit, block_hashes, num_blocks_for, usage
from wavepp.timeline import chrome_trace, write_trace
from wavepp.transport.base import PlaneError
from wavepp.transport.frames import DataLimits
from wavepp.transport.planes import Planes, build_planes
from wavepp.transport.watchdog import Watchdog
from wavepp.workload import (
    cold,
    conversation,
    mixed,
    read_requests_file,
    read_trace,
    seeded,
    short_suffix,
    trace,
)
from wavepp.workload.generators import VOCAB


def log(message: str) -> None:
    # one write per line: two ranks' lines never share one
    sys.stderr.write(f"[wavepp rank {os.environ.get('RANK', '0')}] {message}\n")
    sys.stderr.flush()


def preflight(c: RunConfig, world: int) -> None:
    """Every check that does not need the ranks, run before any process group: each option
    (whatever its source), the model's name, the split of layers and pools over ``world``
    stages (``world`` ranks, ``--tp`` of them a stage), the input files. Raises SystemExit
    with one line."""
    validate(c)
    if world % c.tp:
        raise SystemExit(f"wavepp: --tp {c.tp} does not divide the {world} ranks; the ranks "
                         "are stages x tp (torchrun --nproc-per-node P x T)")  # fmt: skip
    world //= c.tp
    num_layers = None
    measured = sim_measured(c)
    if measured is not None:
        num_layers = measured.num_layers
    elif c.executor == "sim":
        if c.model not in MODELS:
            raise SystemExit(f"wavepp: sim model {c.model!r} unknown; one of {sorted(MODELS)}")
        num_layers = MODELS[c.model].num_layers
        sim_topology(c, world)
    elif c.model in BUILTIN:
        num_layers = BUILTIN[c.model].num_layers
        try:
            check_tp(BUILTIN[c.model], c.tp)
        except ValueError as error:
            raise SystemExit(f"wavepp: {error}") from None
    elif not Path(c.model).is_dir():
        raise SystemExit(f"wavepp: --model {c.model!r} is neither built in "
                         f"({', '.join(BUILTIN)}) nor a checkpoint directory")  # fmt: skip
    check_for_world(c, world, num_layers)
    counts = layer_counts(c.layers_per_stage)
    if c.executor == "sim" and not measured and counts and any(n % 1 for n in counts):
        raise SystemExit(f"wavepp: --layers-per-stage {c.layers_per_stage}: the sim places "
                         "whole layers (its cost model prices a layer, not its halves)")
    for option, path in (("--requests-file", c.requests_file), ("--trace", c.trace)):
        if path and not Path(path).is_file():
            raise SystemExit(f"wavepp: {option} {path}: no such file")


def build_workload(c: RunConfig, vocab: int) -> tuple[list, list[dict], list]:
    """The requests in release order, the refused lines of a requests file, its cancels."""
    if c.workload == "file":
        specs, rejected, cancels = read_requests_file(c.requests_file, vocab)
        for bad in rejected:
            log(f"skipped {bad['error']}")
        return specs, rejected, cancels
    if c.workload == "cold":
        return cold(c.requests, c.prompt_tokens, c.seed, c.block_size, vocab), [], []
    if c.workload == "seeded":
        return seeded(c.requests, c.prompt_tokens, c.seed, c.block_size, vocab=vocab), [], []
    if c.workload == "mixed":
        return mixed(c.requests, c.prompt_tokens, c.cold_tokens or 2 * c.prompt_tokens, c.seed,
                     c.block_size, vocab=vocab), [], []  # fmt: skip
    if c.workload == "conversation":
        return conversation(c.requests, c.prompt_tokens, c.seed, c.block_size, vocab), [], []
    if c.workload == "short-suffix":
        return short_suffix(c.requests, c.prompt_tokens, c.seed, c.block_size, c.suffix_tokens,
                            vocab), [], []  # fmt: skip
    _, rejected = read_trace(c.trace, c.requests)
    for bad in rejected:
        log(f"skipped {bad['error']}")
    specs = trace(c.trace, c.requests, c.seed, c.block_size, c.open_loop, c.time_scale, vocab)
    return specs, rejected, []


def sim_measured(c: RunConfig) -> MeasuredProfile | None:
    """The sim's measured profile (``--sim-device measured:FILE``), checked, for
    ``--model``; None for a datasheet device or the torch executor."""
    path = measured_path(c.sim_device) if c.executor == "sim" else None
    if path is None:
        return None
    try:
        profile = _measured_profile(path)
    except ProfileError as error:
        raise SystemExit(f"wavepp: --sim-device: {error}") from None
    if profile.model != c.model:
        raise SystemExit(f"wavepp: --sim-device {c.sim_device} was measured with "
                         f"{profile.model!r}, not --model {c.model!r}")  # fmt: skip
    return profile


@functools.cache
def _measured_profile(path: str) -> MeasuredProfile:
    """Read once per rank: setup asks for the profile at every step that uses it."""
    return load_profile(path)


def sim_topology(c: RunConfig, world: int) -> Topology:
    """Where the sim's stages sit (``--sim-device``, ``--sim-tp``, ``--sim-link``)."""
    try:
        return Topology(DEVICES[c.sim_device], world, c.sim_tp, c.sim_link)
    except ValueError as error:
        raise SystemExit(f"wavepp: {error}") from None


def load_model(c: RunConfig) -> tuple[ModelConfig, dict[str, torch.Tensor]] | None:
    """The torch executor's model: its config and every layer's weights (None: the sim)."""
    if c.executor == "sim":
        return None
    if c.model in BUILTIN:
        cfg = BUILTIN[c.model]
        model = cfg, random_weights(cfg, c.seed)
    elif Path(c.model).is_dir():
        model = load_checkpoint(c.model, pick_dtype(c.dtype))
    else:
        raise SystemExit(f"wavepp: --model {c.model!r} is neither built in "
                         f"({', '.join(BUILTIN)}) nor a checkpoint directory")  # fmt: skip
    try:
        check_tp(model[0], c.tp)
    except ValueError as error:
        raise SystemExit(f"wavepp: {error}") from None
    return model


def build_executor(c: RunConfig, rank: int, world: int, capacity: int,
                   snapshot_capacity: int | None, placement: Placement,
                   model: tuple[ModelConfig, dict] | None,
                   groups: StageGroups | None = None):  # fmt: skip
    """(executor, has recurrent layers) for stage ``rank``; with ``groups`` (``--tp``) the
    leader's shard, posting every wave to the stage's other ranks."""
    units = placement.spans[rank]
    shares = (placement.shared_first(rank), placement.shared_last(rank))
    rng = np.random.default_rng([c.seed, rank])  # the sim's noise: seeded, per rank
    measured = sim_measured(c)
    if measured is not None:
        sharing = measured.core_sharing(world, c.threads)
        if sharing > 1 and rank == 0:
            log(f"sim: {world} ranks share the {measured.machine['cores']} cores the profile "
                f"was measured on: every simulated wave takes {sharing:g}x its parts' time")
        cost = MeasuredStageCost(measured, units, rank == 0, rank == world - 1, sharing,
                                 *shares)  # fmt: skip
        recurrent = any(measured.mixers[u // 2] in RECURRENT for u in units if u % 2 == 0)
        return SimExecutor(cost, c.time_scale, c.sim_noise, rng), recurrent
    if c.executor == "sim":
        profile = MODELS[c.model]
        layers = range(units.start // 2, units.stop // 2)
        topology = sim_topology(c, world)
        cost = StageCostModel(profile, topology.device, layers, rank == world - 1,
                              c.weight_format, tp=c.sim_tp,
                              tp_link=topology.tp_link)  # fmt: skip
        recurrent = any(profile.kind(layer) == "L" for layer in layers)
        return SimExecutor(cost, c.time_scale, c.sim_noise, rng), recurrent
    cfg, weights = model
    if c.compile:
        log(f"compiling stage {rank}'s layers (--compile)")
    executor = compute.call(stage_executor, c, cfg, weights, units, rank == 0, rank == world - 1,
                            capacity, snapshot_capacity, groups, shares)  # fmt: skip
    recurrent = any(cfg.kind(layer) == "L" for layer in executor.mixer_ids)
    log(f"stage {rank}: attention by {executor.attention_kernel}" if executor.attention_kernel
        else f"stage {rank}: no softmax-attention layers, so no attention kernel")  # fmt: skip
    if c.compile:
        held = len(executor.m.layer_ids)
        eager = held - len(executor.fused)
        log(f"stage {rank}: {len(executor.fused)} of {held} layers compiled"
            + (f"; {eager} not Llama-shaped or split with a neighbour, run eagerly"
               if eager else ""))  # fmt: skip
    if groups is None:
        return executor, recurrent
    return TPLeader(executor, groups, c.tp, c.handoff_timeout_s), recurrent


def stage_executor(c: RunConfig, cfg: ModelConfig, weights: dict, units: range, first: bool,
                   last: bool, capacity: int, snapshot_capacity: int | None,
                   groups: StageGroups | None,
                   shared: tuple[float | None, float | None] = (None, None),
                   ) -> TorchExecutor:  # fmt: skip
    """This rank's torch executor: its stage's layers (with ``--tp``, its shard of them,
    reducing over the stage's group) over pools of ``capacity`` blocks; ``shared``: the
    shares of the mixers it shares with the stage before and after (``Placement``)."""
    tp = NO_TP if groups is None else DistTPGroup(groups.compute)
    modules = build_stage(cfg, range(0), first, last, weights, pick_device(c.device),
                          pick_dtype(c.dtype), units, tp=tp)  # fmt: skip
    return TorchExecutor(modules, capacity, c.block_size, snapshot_capacity, c.compile,
                         c.full_last_layer, *shared)  # fmt: skip


async def agree_placement(c: RunConfig, rank: int, world: int, plane: RoundsPlane, specs: list,
                          model: tuple[ModelConfig, dict] | None) -> Placement:  # fmt: skip
    """Which units of the model each stage holds (``wavepp.plan.placement``): the even
    split or the given counts, or (auto) rank 0's balanced placement from the costs it
    measures on the run's typical wave, sent to every rank."""
    measured = sim_measured(c)
    num_layers = (model[0].num_layers if model else measured.num_layers if measured
                  else MODELS[c.model].num_layers)  # fmt: skip
    if num_layers < world:  # a checkpoint's layer count is known only here, on every rank
        raise SystemExit(f"wavepp: the model has {num_layers} layers, fewer than the {world} "
                         "stages")  # fmt: skip
    counts = layer_counts(c.layers_per_stage)
    if counts is not None:
        try:
            placement = given(counts, num_layers)
        except PlacementError as error:  # a checkpoint's layer count is known only here
            raise SystemExit(f"wavepp: {error}") from None
        if any(placement.shares):
            why = sharing_refused(c, model, placement)
            if why:
                raise SystemExit(f"wavepp: --layers-per-stage {c.layers_per_stage}: {why}")
        return placement
    if world == 1 or c.layers_per_stage == "even":
        return even(num_layers, world)
    placement = None
    if rank == 0:
        started = time.perf_counter()
        shape = typical_wave(c.budget, reusable_prefixes(specs, c.block_size), c.block_size,
                             c.prompt_tokens)  # fmt: skip
        placement = (_measured_placement(c, world, shape, model) if model
                     else _calibrated_placement(measured, world, shape) if measured
                     else _sim_placement(c, world, shape))  # fmt: skip
        log(f"layers per stage {placement.describe()}, placed in "
            f"{time.perf_counter() - started:.2f} s")  # fmt: skip
    raw = await plane.broadcast(None if placement is None else json.dumps(
        {"units": placement.units, "shares": placement.shares}).encode())
    return placement or _received(raw, world, num_layers)


def sharing_refused(c: RunConfig, model: tuple[ModelConfig, dict] | None,
                    placement: Placement | None = None) -> str | None:
    """Why this run cannot share a mixer between two stages (of ``placement``, if given),
    or None: sharing runs on the torch executor (or the simulator calibrated on it), one
    rank a stage, attention mixers."""
    measured = sim_measured(c)
    if model is None and measured is None:
        return ("a mixer shared by two stages runs on the torch executor (or the simulator "
                "of a measured profile) only")  # fmt: skip
    if c.tp > 1:
        return "a mixer shared by two stages cannot also be split by --tp"
    mixers = model[0].mixers if model else measured.mixers
    for b, share in enumerate(placement.shares if placement else ()):
        layer = (sum(placement.units[: b + 1]) - 1) // 2
        if share and mixers[layer] in RECURRENT:
            return (f"layer {layer}'s mixer ({mixers[layer]}) is recurrent; only attention "
                    "can be shared by two stages")  # fmt: skip
    return None


def _measured_placement(c: RunConfig, world: int, shape: WaveShape,
                        model: tuple[ModelConfig, dict]) -> Placement:  # fmt: skip
    cfg, weights = model
    share = sharing_refused(c, model) is None
    costs = compute.call(measure_costs, cfg, weights, shape, pick_device(c.device),
                         pick_dtype(c.dtype), c.block_size, c.full_last_layer,
                         shared=share)  # fmt: skip
    return balanced(costs.mixers, costs.mlps, costs.last_layer, costs.embed, costs.head, world,
                    shape=shape.describe(), shared=costs.shared if share else None)  # fmt: skip


def _calibrated_placement(profile: MeasuredProfile, world: int, shape: WaveShape) -> Placement:
    """The torch executor's balanced placement, from the costs the measured profile
    predicts for the parts it would time on the same wave."""
    costs = profile.unit_costs(shape)
    return balanced(*costs, world, shape=shape.describe() + " (SIMULATED)",
                    shared=profile.rowless_costs(shape))  # fmt: skip


def _sim_placement(c: RunConfig, world: int, shape: WaveShape) -> Placement:
    """Whole layers, each stage's time on the wave from the simulator's cost model."""
    profile, topology = MODELS[c.model], sim_topology(c, world)
    chunks = [(shape.prefix, shape.prefix + shape.tokens)] * shape.chunks

    @functools.cache
    def span(a: int, b: int, s: int) -> float:
        last = s == world - 1
        cost = StageCostModel(profile, topology.device, range(a, b), last, c.weight_format,
                              tp=c.sim_tp, tp_link=topology.tp_link)  # fmt: skip
        return cost.cost(chunks, shape.chunks if last else 0).seconds

    counts = whole_layers(span, profile.num_layers, world)
    starts = [sum(counts[:s]) for s in range(world)]
    times = tuple(span(a, a + n, s) for s, (a, n) in enumerate(zip(starts, counts, strict=True)))
    return Placement(tuple(2 * n for n in counts), "auto", times,
                     shape.describe() + " (SIMULATED)")  # fmt: skip


def _received(raw: bytes, world: int, num_layers: int) -> Placement:
    """Rank 0's placement as received: ``world`` unit counts and no or ``world - 1``
    shares, checked before use."""
    try:
        got = json.loads(raw)
    except (ValueError, RecursionError):
        got = None
    units = got.get("units") if isinstance(got, dict) else None
    shares = got.get("shares") if isinstance(got, dict) else None
    bad = (not isinstance(units, list) or len(units) != world
           or not all(type(n) is int and n >= 1 for n in units)
           or sum(units) != 2 * num_layers or units[-1] < 2
           or not isinstance(shares, list) or len(shares) not in (0, world - 1)
           or not all(type(f) in (int, float) for f in shares))  # fmt: skip
    if not bad:
        try:
            return Placement(tuple(units), "auto", shares=tuple(float(f) for f in shares))
        except (PlacementError, ValueError, OverflowError):
            pass
    raise RuntimeError(f"rank 0 sent a placement that is not {world} unit counts summing to "
                       f"{2 * num_layers} with their shares: {raw[:200]!r}")  # fmt: skip


def reusable_prefixes(specs: list, block_size: int) -> list[tuple[int, int]]:
    """Each measured request's (tokens, tokens a cache holding every earlier request
    could reuse: its longest block-aligned prefix seen before, or its expected reuse)."""
    seen: set = set()
    out = []
    for spec in specs:
        hashes = block_hashes(spec.tokens, block_size)
        hit = next((k for k, h in enumerate(hashes) if h not in seen), len(hashes))
        if not spec.warmup:
            out.append((spec.num_tokens, max(hit * block_size, spec.expected_reuse)))
        seen.update(hashes)
    return out


def data_limits(c: RunConfig, executor) -> DataLimits:
    """What the data plane accepts: waves of at most --budget tokens, [tokens, d_model]
    in the model's dtype (twice the rows after a shared mixer; the sim sends [tokens]
    float16 stand-ins)."""
    if isinstance(executor, TorchExecutor | TPLeader):
        # after a mixer shared with the stage before: the wave's rows and up to as many
        # rows of that mixer's outputs (TorchExecutor.forward)
        rows = c.budget * (2 if getattr(executor, "shared_first", None) is not None else 1)
        return DataLimits.for_run(rows, executor.cfg.d_model, executor.dtype,
                                  MAX_MESSAGE_BYTES)  # fmt: skip
    shared = getattr(getattr(executor, "cost_model", None), "shared_first", None)
    return DataLimits.for_run(c.budget * (2 if shared else 1), None, torch.float16,
                              MAX_MESSAGE_BYTES)  # fmt: skip


def pick_policy(c: RunConfig, rung) -> Policy:
    """The policy in use: ``--policy`` (or the default), single fields overridden by
    ``--planner`` / ``--probe`` / ``--eviction``, the rest filled in by the rung."""
    try:
        return for_run(c.policy or "default", linear_probe=rung.linear_probe,
                       rung_planner=rung.planner, planner=c.planner, probe=c.probe,
                       eviction=c.eviction)  # fmt: skip
    except PolicyError as error:
        raise SystemExit(f"wavepp: {error}") from None


def _vocab(c: RunConfig) -> int:
    if c.model in BUILTIN:
        return BUILTIN[c.model].vocab_size
    config = Path(c.model) / "config.json"
    own = Path(c.model) / OWN_CONFIG
    source = own if own.exists() else config
    try:
        return int(json.loads(source.read_text())["vocab_size"])
    except (OSError, KeyError, ValueError) as error:
        raise SystemExit(
            f"wavepp: cannot read the vocabulary size of {c.model!r}: {error}"
        ) from None


def auto_capacity(c: RunConfig, specs) -> int:
    """Enough blocks for 1.5 x concurrency of the longest prompt (--prompt-tokens when
    the requests come from a client), and for the seeded prefixes of a seeded or mixed
    workload plus the new blocks of ``concurrency`` requests in flight."""
    longest = max((s.num_tokens for s in specs), default=c.prompt_tokens)
    return max(num_blocks_for(longest, c.block_size),
               int(1.5 * c.concurrency * num_blocks_for(longest, c.block_size)),
               seeded_need(c, specs))  # fmt: skip


def device_pools(c: RunConfig, world: int, placement: Placement) -> list[StagePool] | None:
    """The sim's default pools: each stage's KV pool from its device memory minus its own
    weights (``wavepp.sim.profiles.stage_pool``), or None where the executor is not the
    sim or the weights leave no room (then the pools follow the workload). Every rank
    computes the same list."""
    if c.executor != "sim" or measured_path(c.sim_device) or c.model not in MODELS:
        return None
    model, device = MODELS[c.model], DEVICES[c.sim_device]
    stages = [range(u.start // 2, u.stop // 2) for u in placement.spans]
    try:
        return [stage_pool(model, device, layers, s == 0, s == world - 1, c.block_size,
                           c.snapshot_interval, c.weight_format, c.sim_tp)
                for s, layers in enumerate(stages)]  # fmt: skip
    except ValueError as error:
        log(f"{error}; the pools follow the workload instead (as if memory were unbounded)")
        return None


def _too_long(specs, min_capacity: int, block_size: int) -> list[dict]:
    """Requests no stage pool could ever hold, as rejected lines (the intake's words)."""
    out = []
    for spec in specs:
        blocks = num_blocks_for(spec.num_tokens, block_size)
        if blocks > min_capacity:
            out.append({"line": None, "id": spec.request_id,
                        "error": f"request {spec.request_id}: prompt of {spec.num_tokens:,} "
                                 f"tokens needs {blocks:,} blocks; the smallest stage pool "
                                 f"holds {min_capacity:,}"})  # fmt: skip
    return out


def _where(rejected: dict) -> str:
    return f"line {rejected['line']}" if rejected.get("line") else f"request {rejected['id']}"


def seeded_need(c: RunConfig, specs) -> int:
    """Blocks a seeded or mixed workload needs so its seeded prefixes stay cached: the
    prefixes, plus ``concurrency`` times the most new blocks of one measured request (0
    for other workloads, whose warm-up traffic is meant to be evicted)."""
    if c.workload not in ("seeded", "mixed"):
        return 0
    prefixes = sum(num_blocks_for(s.num_tokens, c.block_size) for s in specs if s.warmup)
    fresh = max((num_blocks_for(s.num_tokens, c.block_size) - s.expected_reuse // c.block_size
                 for s in specs if not s.warmup), default=0)  # fmt: skip
    return prefixes + c.concurrency * fresh


class Interrupted(Exception):
    """The user stopped the run (SIGINT / SIGTERM)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


async def _watch_signals(watchdog: Watchdog | None, on_signal, scope: anyio.CancelScope) -> None:
    """SIGINT / SIGTERM: a peer's failure (torchrun stops the rest) or the user's."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            stop = on_signal(signum)
            if stop is None:  # a drain, started at once: a failed peer shows on the planes
                continue
            if watchdog is not None:  # torchrun stops everyone when one rank dies
                peers = await anyio.to_thread.run_sync(watchdog.suspects)
                if peers:
                    raise PlaneError(f"stopped by the launcher; {peers}")
            if stop:
                scope.cancel()
                return


def start_kv_events(c: RunConfig, world: int, cache_log: StageLog, hybrid: bool):
    """Rank 0 with --kv-events: the publisher (bound now) and what feeds it."""
    from wavepp.fleet.changes import Announcer, PipelineView
    from wavepp.fleet.events import EventPublisher

    try:
        publisher = EventPublisher(c.kv_events, kv_events_replay(c), topic=c.kv_events_topic,
                                   block_size=c.block_size)  # fmt: skip
    except OSError as error:
        raise SystemExit(f"wavepp: --kv-events: {error}") from None
    view = PipelineView(world, c.block_size, cache_log.tokens.get)
    info = {"endpoint": publisher.endpoint, "replay": publisher.replay_endpoint,
            "topic": publisher.topic, "block_size": c.block_size, "recurrent": hybrid}
    announcer = Announcer(view, publisher.publish, info)
    log(f"KV events on {publisher.endpoint} (replay {publisher.replay_endpoint}, topic "
        f"{publisher.topic!r}): blocks every stage holds"
        + (", and the points every L stage can resume from (group 1)" if hybrid else ""))
    return publisher, announcer


async def open_planes(c: RunConfig, rank: int, world: int, watchdog: Watchdog | None,
                      groups: StageGroups | None = None) -> Planes:  # fmt: skip
    """The rounds plane and this rank's data-plane links, as configured; with the sim,
    the link to the next stage takes the time its activations need over the link the
    topology gives it (``wavepp.sim.links``)."""
    device = pick_device(c.device) if c.executor == "torch" else None
    planes = await build_planes(c.timeout_s, c.rounds_plane, c.data_plane, log, device,
                                on_wait=watchdog.set_status if watchdog is not None else None,
                                leaders=groups.leaders if groups is not None else None)
    if c.executor != "sim":
        return planes
    measured = sim_measured(c)
    if measured is not None:  # this machine's ranks: the activations' bytes, measured link
        if planes.outbound is None or measured.link is None:
            return planes
        row_bytes = measured.d_model * measured.act_bytes
        outbound = SimulatedLink(planes.outbound, measured.link, row_bytes, c.time_scale)
        return attrs.evolve(planes, outbound=outbound)
    topology = sim_topology(c, world)
    if planes.outbound is None:
        if rank == 0:
            log(f"SIMULATED topology: {topology.describe()}")
        return planes
    outbound = SimulatedLink(planes.outbound, topology.stage_link(rank),
                             MODELS[c.model].d_model * KV_BYTES, c.time_scale)  # fmt: skip
    if rank == 0:
        log(f"SIMULATED topology: {topology.describe()}; a {c.budget:,}-token wave's "
            f"activations reach stage 1 in {outbound.transfer_s(c.budget) * 1e3:.2f} ms")
    return attrs.evolve(planes, outbound=outbound)


@attrs.frozen
class Setup:
    """What every rank agreed on before its stage is built."""

    vocab: int | None  # None: ids are not checked (the sim executor)
    specs: list  # rank 0's offline workload, in release order
    rejected: list[dict]  # the lines of a requests file or trace refused
    cancels: list  # (request id, seconds after measurement starts)
    capacity: int  # this stage's pool, blocks
    min_capacity: int  # the smallest stage pool
    pools: list[StagePool] | None  # the sim's pools from device memory, else None
    placement: Placement  # the units (half layers) each stage holds


async def agree_setup(c: RunConfig, rank: int, world: int, plane: RoundsPlane, offline: bool,
                      model: tuple[ModelConfig, dict] | None) -> Setup | None:  # fmt: skip
    """The workload (rank 0, offline), the placement of layers and every stage's pool
    size; None when a requests file holds no runnable request (every rank then ends the
    run)."""
    measured = sim_measured(c)  # the workload's ids drawn as the torch run draws them
    vocab = measured.vocab if measured else None if c.executor == "sim" else _vocab(c)
    specs, rejected, cancels = [], [], []
    if rank == 0 and offline:
        specs, rejected, cancels = build_workload(c, vocab or VOCAB)
        if c.handoff_all:  # every measured request hands its cache to the default target
            specs = [s if s.warmup else attrs.evolve(s, handoff=True) for s in specs]
    # Every rank needs the pool size; rank 0 derives it from the workload. A requests
    # file with no runnable line ends the run on every rank (runnable = 0).
    placement = await agree_placement(c, rank, world, plane, specs, model)
    given = stage_capacities(c, world)
    pools = None if given else device_pools(c, world, placement)
    if pools:
        given = [pool.blocks for pool in pools]
        if rank == 0:
            each = "; ".join(f"stage {s} {pool.describe()}" for s, pool in enumerate(pools))
            log(f"KV pools from device memory (SIMULATED {c.sim_device}): {each}")
    if rank == 0 and offline and given and c.workload in ("file", "trace"):
        too_long = _too_long(specs, min(given), c.block_size)
        if specs and len(too_long) == len(specs):  # not one line fits: nothing to run
            specs, rejected = [], rejected + too_long
    runnable = 0 if rank == 0 and offline and not specs else 1
    proposed = given[rank] if given else (auto_capacity(c, specs) if rank == 0 else 0)
    widest, runnable = await plane.all_min([-proposed, runnable])
    if not runnable:
        if rank == 0:
            lines = "; ".join(f"{_where(r)}: {r['error'].split(': ', 1)[-1]}"
                              for r in rejected[:5])  # fmt: skip
            more = f" (and {len(rejected) - 5} more)" if len(rejected) > 5 else ""
            said = ": " + lines + more if rejected else ", the file is empty"
            log(f"{c.requests_file or c.trace}: no runnable request ({len(rejected)} lines "
                f"rejected{said})")  # fmt: skip
        return None
    capacity = given[rank] if given else -widest
    min_capacity = min(given) if given else capacity
    need = seeded_need(c, specs) if rank == 0 else 0
    if need > min_capacity:  # the seeded prefixes cannot all stay cached: say so
        log(f"this cell thrashes: its seeded prefixes and requests in flight need {need:,} "
            f"blocks, the smallest stage pool holds {min_capacity:,} (short by "
            f"{need - min_capacity:,}, {(need - min_capacity) / need:.0%})")  # fmt: skip
    if RUNGS[c.rung].admission is Admission.FREE and capacity != min_capacity:
        # The oracle's rank 0 decides for every stage on its own cache, so every stage
        # gets the smallest pool. It stays an upper bound: in a round the agreed point
        # is at most the smallest pool's hit and an escrow must fit the smallest pool,
        # and a simulated wave's time does not depend on the pool.
        if rank == 0:
            log(f"oracle: every stage's pool is the smallest, {min_capacity:,} blocks "
                "(rank 0 decides for all stages)")  # fmt: skip
        capacity = min_capacity
    return Setup(vocab, specs, rejected, cancels, capacity, min_capacity, pools, placement)


@attrs.frozen
class StageParts:
    """This rank's stage and what it was built from."""

    stage: Stage
    executor: object
    policy: Policy
    mode: RoundMode
    handoff_targets: HandoffTargets | None  # where rank 0 sends requests' caches
    cache_log: StageLog | None  # with --kv-events


def build_stage_parts(c: RunConfig, rank: int, world: int, setup: Setup, planes: Planes,
                      model: tuple[ModelConfig, dict] | None,
                      groups: StageGroups | None = None) -> StageParts:  # fmt: skip
    """The policy, the executor, the stage's cache book and its handoff settings."""
    policy = pick_policy(c, RUNGS[c.rung])
    mode = RoundMode(block_size=c.block_size, eager=RUNGS[c.rung].eager, policy=policy)
    snapshot_capacity = c.snapshot_capacity or setup.capacity
    executor, recurrent = build_executor(c, rank, world, setup.capacity, snapshot_capacity,
                                         setup.placement, model, groups)  # fmt: skip
    planes.set_limits(data_limits(c, executor))
    if isinstance(executor, TPLeader):
        executor.set_limits(data_limits(c, executor))
        dist.barrier(group=groups.compute)  # every rank of the stage has built its shard
    book = StageBook(policy.empty_cache(setup.capacity, has_recurrent=recurrent,
                                        snapshot_capacity=snapshot_capacity))  # fmt: skip
    handoff = handoff_targets = None
    if c.executor == "torch":  # every stage can hand its band of a request's cache on
        on_cpu = pick_device(c.device).type == "cpu"
        handoff = HandoffSettings(rank, world, fingerprint(c.model, executor.cfg, c.dtype),
                                  c.handoff_timeout_s, c.handoff_budget_mib << 20,
                                  c.handoff_block_size, INLINE_BYTES if on_cpu else 0)  # fmt: skip
        handoff_targets = HandoffTargets(c.handoff_to, c.handoff_format, c.handoff_dir,
                                         c.handoff_block_size, handoff.fingerprint.layer_kinds)
    cache_log = (StageLog(rank, recurrent, report_limit(world)) if c.kv_events
                 else None)  # fmt: skip
    stage = Stage(rank, book, executor, c.block_size, c.snapshot_interval, recurrent,
                  policy=policy, handoff=handoff, cache_log=cache_log,
                  record_spans=bool(c.trace_out))  # fmt: skip
    return StageParts(stage, executor, policy, mode, handoff_targets, cache_log)


class RankZero:
    """Rank 0's run: the coordinator, the engine, and the client that feeds it (the
    offline workload, or ``client(engine)``)."""

    def __init__(self, c: RunConfig, world: int, setup: Setup, planes: Planes,
                 parts: StageParts, announcer, watchdog: Watchdog | None,
                 client: Callable[[Engine], Awaitable[None]] | None) -> None:  # fmt: skip
        self.client = client
        self.watchdog = watchdog
        stage = parts.stage
        self.coordinator = Coordinator(
            RUNGS[c.rung], planes.rounds, stage, planes.outbound, planes.done,
            _wave_planner(c, world, parts.executor, parts.policy), parts.mode,
            min_capacity=setup.min_capacity, vocab_size=setup.vocab,
            ring=c.ring or 2 * world, max_batch=c.max_batch, heartbeat_s=c.heartbeat_s,
            log=log, num_stages=world, handoff_target=parts.handoff_targets,
            events=announcer, retain_ended=None if client is None else RETAIN_ENDED,
            timeline=bool(c.trace_out),
        )  # fmt: skip
        self.engine = Engine(self.coordinator, vocab_size=setup.vocab,
                             min_capacity=setup.min_capacity, block_size=stage.block_size,
                             kv_events=None if announcer is None else announcer.info,
                             watchdog=watchdog)  # fmt: skip
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
            await _beside_the_runtime(self.coordinator, self.client, self.engine,
                                      self.watchdog)  # fmt: skip


async def follow(planes: Planes, parts: StageParts) -> None:
    """Ranks > 0: follow rank 0's rounds and run the waves it sends."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(follow_rounds, planes.rounds, parts.stage, parts.mode)
        tg.start_soon(follow_waves, parts.stage, planes.inbound, planes.outbound, planes.done)


def stage_report(rank: int, parts: StageParts, interrupted: bool) -> StageReport:
    """This stage's figures and its leak check (done locally only when interrupted: the
    planes may hold abandoned transfers)."""
    stage, book = parts.stage, parts.stage.book
    error = ""
    try:
        audit(book.cache)
    except Exception as failure:  # reported, and fails the run
        error = str(failure)
    if isinstance(parts.executor, TPLeader) and not interrupted:
        disagreement = parts.executor.finish()  # the stage's other ranks stop here
        if disagreement:
            error = error or f"stage {rank}: {disagreement}"
            log(error)
    use = usage(book.cache)
    memory = parts.executor.memory_report()
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
               setup: Setup, planes: Planes, parts: StageParts,
               interrupted: int | None) -> dict:  # fmt: skip
    """Rank 0's JSON record of the run."""
    book, feed = zero.coordinator.run_book(), zero.feed
    records = book.records
    measure_start = feed.measure_start if feed else zero.engine.started_at
    measure_end = (feed.measure_end if feed else None) or time.time()
    simulated = parts.executor.simulated
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
    record["policy"] = parts.policy.describe()
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


async def rank_main(
    c: RunConfig, rank: int, world: int, watchdog: Watchdog | None,
    client: Callable[[Engine], Awaitable[None]] | None = None, sigterm_drains: bool = False,
    groups: StageGroups | None = None,
) -> tuple[dict | None, int]:  # fmt: skip
    """Stage ``rank`` of ``world`` (with ``--tp``, on its leader: ``groups``)."""
    planes = await open_planes(c, rank, world, watchdog, groups)
    model = compute.call(load_model, c)  # torch work on the compute thread alone
    setup = await agree_setup(c, rank, world, planes.rounds, client is None, model)
    if groups is not None:  # the stage's other ranks build what this one builds
        send_plan(groups, None if setup is None else stage_plan(c, rank, world, setup))
    if setup is None:
        global _ended
        _ended = 2  # a signal from here on (the launcher, as another rank exits 2): exit 2
        return None, 2
    parts = build_stage_parts(c, rank, world, setup, planes, model, groups)
    del model  # the stage holds its own layers' weights
    stage = parts.stage
    # Every stage is ready (pools zeroed, layers compiled) before rank 0 admits anything:
    # otherwise the run's first round waits out the slowest stage's start-up (2.2 s of a
    # 9.9 s run at P = 2 with --compile), inside the measured time.
    _, attention_only = await planes.rounds.all_min([1, int(not stage.has_recurrent)])
    publisher = announcer = None
    if rank == 0 and c.kv_events:
        publisher, announcer = start_kv_events(c, world, parts.cache_log,
                                               hybrid=not attention_only)  # fmt: skip
    if watchdog is not None:  # this stage's figures ride on its heartbeat (for metrics)
        watchdog.publish(stage.figures)
    zero = (RankZero(c, world, setup, planes, parts, announcer, watchdog, client)
            if rank == 0 else None)  # fmt: skip
    interrupted: list[int] = []

    def on_signal(signum: int) -> bool | None:
        """Whether the signal ends the run now; None: it started a drain."""
        if sigterm_drains and signum == signal.SIGTERM:
            if zero is not None and not (watchdog is not None and watchdog.fatal):
                log("SIGTERM: draining (no new requests; the running ones finish)")
                zero.engine.drain()
            return None
        interrupted.append(signum)
        return True

    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_watch_signals, watchdog, on_signal, scope)
            if stage.handoffs is not None:
                tg.start_soon(stage.handoffs.run)
            await (zero.run() if zero is not None else follow(planes, parts))
            tg.cancel_scope.cancel()  # the run is over: stop watching signals
    if publisher is not None:
        publisher.close()
    if interrupted:  # a second Ctrl-C or SIGTERM must not lose the record being written
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)

    # Leak check on every stage, gathered on rank 0.
    report = stage_report(rank, parts, bool(interrupted))
    if interrupted:
        status = 128 + interrupted[0]
        log(f"interrupted by {signal.Signals(interrupted[0]).name}; stage {rank} holds "
            f"{report.leases} leases, {report.escrowed} escrowed and {report.pending} "
            f"pending blocks")  # fmt: skip
        if rank != 0:
            return None, status
        reports = [report]
    else:
        gathered = await planes.rounds.gather(encode(report))
        if rank != 0:
            return None, 0 if report.balanced else 1
        reports = [decode_untrusted(raw, StageReport) for raw in gathered]
        status = 0 if all(r.balanced for r in reports) else 1
    record = run_record(c, world, zero, reports, setup, planes, parts,
                        interrupted[0] if interrupted else None)  # fmt: skip
    return record, status


def stage_plan(c: RunConfig, rank: int, world: int, setup: Setup) -> StagePlan:
    units = setup.placement.spans[rank]
    return StagePlan([units.start, units.stop], rank == 0, rank == world - 1, setup.capacity,
                     c.snapshot_capacity or setup.capacity)  # fmt: skip


def follow_stage(c: RunConfig, layout: TPLayout, groups: StageGroups) -> int:
    """A rank of a stage other than its leader (``--tp``): build its shard of what the
    leader agreed with the other stages, then run the leader's posts until it stops.
    Returns the exit status (2: the run had nothing to run)."""
    cfg, weights = load_model(c)
    plan = receive_plan(groups, cfg.num_layers)
    if plan is None:
        return 2
    executor = stage_executor(c, cfg, weights, range(*plan.units), plan.first, plan.last,
                              plan.capacity, plan.snapshot_capacity, groups)  # fmt: skip
    del weights  # the shard holds its own
    groups.posts[0].set_limits(data_limits(c, executor))
    dist.barrier(group=groups.compute)  # every rank of the stage has built its shard
    follow_leader(executor, groups, c.tp, plan.first)
    return 0


RETAIN_ENDED = 10_000  # a server: ended requests whose ids stay taken (wavepp.ids.ID_RULE)


FAULT_GRACE_S = 2.0  # how long a client may answer its callers once the runtime failed


async def _beside_the_runtime(coordinator: Coordinator, client, engine: Engine,
                              watchdog: Watchdog | None) -> None:  # fmt: skip
    """Run ``client(engine)`` next to the runtime rather than inside it: when the runtime
    fails (a peer dead), the watchdog records why and the client (the HTTP server) gets up
    to FAULT_GRACE_S to answer every caller in its own shape, naming the cause, before the
    failure ends this rank."""
    client_done = anyio.Event()

    async def run_client() -> None:
        try:
            await client(engine)
        finally:
            client_done.set()
            if watchdog is not None:
                watchdog.answered()

    async with anyio.create_task_group() as tg:
        tg.start_soon(run_client)
        try:
            await coordinator.run(client_done.wait)
        except Exception as error:
            if watchdog is not None:
                watchdog.declare(_reason(error))
                with anyio.move_on_after(FAULT_GRACE_S, shield=True):
                    await client_done.wait()
            raise


def _leaves(error: BaseException) -> list[BaseException]:
    """The exceptions inside ``error``'s groups, however nested (task groups nest them)."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for e in error.exceptions for leaf in _leaves(e)]
    return [error]


def _reason(error: BaseException) -> str:
    return "; ".join(f"{type(e).__name__}: {e}" for e in _leaves(error)) or repr(error)


def _wave_planner(c: RunConfig, world: int, executor, policy: Policy) -> WavePlanner:
    ctx = PlanContext(c.budget, c.ring or 2 * world, c.min_budget, stages=world)
    fit = CostFit(prior=CostModel(*executor.prior_cost()), weight=PRIOR_WEIGHT)
    return WavePlanner(policy.planner, ctx, fit)


_failing = False  # a failure is being reported: signals no longer interrupt it
# The run's exit status once it has ended (2 as soon as nothing is runnable): a signal
# from then on is the launcher stopping every rank because one has exited, and this rank
# ends with that status, not as a failure.
_ended: int | None = None


def fail_fast(error: BaseException, watchdog: Watchdog | None) -> None:
    """Log why this rank fails (and which peer looks gone), tell the peers, exit 1."""
    global _failing
    _failing = True
    if threading.current_thread() is threading.main_thread():
        # When the run's signal receiver closed, asyncio put the default handlers back:
        # the launcher's SIGTERM (it stops every rank once one fails, often within 0.1 s)
        # would kill this rank silently before it has named the peer that failed.
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
    leaves = _leaves(error)
    reason = _reason(error)
    if isinstance(error, SystemExit) and isinstance(error.code, str):
        reason = error.code
    peers = ""
    if watchdog is not None:
        # the cause already found (watchdog.declare), or let a dead peer's heartbeat go stale
        peers = watchdog.fatal or watchdog.suspects()
        # the peers learn why, and whom this rank suspects, so they can name the cause too
        watchdog.finish(failure=(reason + (f" — {peers}" if peers else ""))[:2000])
    log(f"failed: {reason}" + (f" — {peers}" if peers and peers not in reason else ""))
    if not any(isinstance(e, SystemExit | PlaneError | KeyboardInterrupt) for e in leaves):
        traceback.print_exception(error)
    sys.stderr.flush()
    os._exit(1)


def run_ranks(
    config: RunConfig, client: Callable[[Engine], Awaitable[None]] | None = None,
    sigterm_drains: bool = False,
) -> int:  # fmt: skip
    """Run this rank (under torchrun, or alone as a one-stage run); returns the exit status.

    ``client`` None runs the configured workload; otherwise rank 0 calls
    ``client(engine)`` (see :mod:`wavepp.engine`) and ranks > 0 serve their stage.
    """
    try:
        preflight(config, int(os.environ.get("WORLD_SIZE", "1")))
    except SystemExit as error:
        _refuse_once(error)
    set_threads(config.threads)
    if "RANK" not in os.environ:  # plain `python -m wavepp.main`: a one-stage run
        with socket.socket() as probe:  # a free port for the one-rank store
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=config.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = TPLayout(world, config.tp, rank)
    watchdog = None
    if world > 1:
        watchdog = Watchdog(rank, world, log, dead_after_s=config.dead_after_s,
                            fault_grace_s=FAULT_GRACE_S if client and not layout.tp_rank
                            else 0.0, tp=config.tp).start()  # fmt: skip
    groups = None
    if config.tp > 1:
        try:
            groups = make_groups(layout, config.timeout_s, pick_device(config.device))
        except BaseException as error:
            fail_fast(error, watchdog)

    def outside_the_run(signum, frame) -> None:
        # While the run goes, rank_main watches the signals itself. Before it, or while a
        # failure is being reported (torchrun stops every rank when one fails), a signal
        # must not kill this rank before it has said why it fails; after it, it ends the
        # rank with the run's status.
        if _ended is not None and not _failing:
            sys.stderr.flush()
            os._exit(_ended or 128 + signum)
        if not _failing:
            status = watchdog.status if watchdog is not None else "starting"
            fail_fast(RuntimeError(f"stopped by {signal.Signals(signum).name} while {status}"),
                      watchdog)  # fmt: skip

    if layout.tp_rank:  # a TP follower: no record, no event loop
        status = _follow(config, layout, groups, watchdog, sigterm_drains)
        if watchdog is not None:
            watchdog.finish()
        if status:
            os._exit(status)
        dist.destroy_process_group()
        return 0
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, outside_the_run)
    try:
        record, status = anyio.run(rank_main, config, layout.stage, layout.stages, watchdog,
                                   client, sigterm_drains, groups)  # fmt: skip
    except BaseException as error:  # a failed rank exits now, naming what it waited for
        fail_fast(error, watchdog)
    global _ended
    _ended = status
    for signum in (signal.SIGINT, signal.SIGTERM):  # the run's own watch put back defaults
        signal.signal(signum, outside_the_run)
    if watchdog is not None:
        watchdog.finish()
    if record is not None:
        print(table(record))
        if config.json:
            Path(config.json).write_text(json.dumps(record, indent=2) + "\n")
            log(f"wrote {config.json}")
        if status == 1:
            log("leak check FAILED on some stage (see leak_check in the record)")
    sys.stdout.flush()
    sys.stderr.flush()
    if status in (2, 130, 143) or (record is None and status):
        os._exit(status)  # planes may hold abandoned transfers: do not wait on them
    dist.destroy_process_group()
    return status


INTERRUPT_GRACE_S = 10.0  # a follower interrupted waits this long for its leader to end


def _follow(c: RunConfig, layout: TPLayout, groups: StageGroups, watchdog: Watchdog | None,
            sigterm_drains: bool) -> int:  # fmt: skip
    """A TP follower's whole run; its exit status.

    The posts are followed on a thread of their own, so that this (main) thread takes
    signals while they wait inside a blocking Gloo call. SIGINT or SIGTERM (the user's,
    or the launcher's) does not end this rank at once: its leader takes the same signal
    and ends the stage (a server drains on SIGTERM, and its stop ends this rank); what
    fails here after the signal — the leader gone — ends it quietly, as an interrupted
    rank, and so does a leader that has not ended within INTERRUPT_GRACE_S."""
    interrupted: list[tuple[int, float]] = []  # (signal, when)

    def on_signal(signum, frame) -> None:
        if not (sigterm_drains and signum == signal.SIGTERM):
            interrupted.append((signum, time.monotonic()))

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)
    # the compute thread builds the shard and runs the posts (an interrupted rank exits
    # with it still waiting)
    future = compute.submit(follow_stage, c, layout, groups)
    while True:
        try:
            return future.result(timeout=0.5)
        except concurrent.futures.TimeoutError:
            if interrupted and time.monotonic() - interrupted[0][1] > INTERRUPT_GRACE_S:
                break
        except BaseException as error:
            if not interrupted:
                fail_fast(error, watchdog)
            break
    signum = interrupted[0][0]
    log(f"interrupted by {signal.Signals(signum).name}")
    sys.stderr.flush()
    os._exit(128 + signum)


def _refuse_once(error: SystemExit) -> None:
    """A refused option: rank 0 says why in one line, the other ranks exit quietly (each
    would say the same)."""
    if int(os.environ.get("RANK", "0") or 0) and isinstance(error.code, str):
        raise SystemExit(2) from None
    raise error


def main(argv: list[str] | None = None) -> None:
    try:
        config = load(argv)
    except SystemExit as error:
        _refuse_once(error)
    sys.exit(run_ranks(config))


if __name__ == "__main__":
    main()
