"""What the ranks check and agree on before a stage is built.

:func:`preflight` runs before any process group (on every rank, and in a launcher);
then every rank opens its planes (:func:`open_planes`) and agrees with the others on
the workload, the placement of layers and every stage's pool (:func:`agree_setup`);
once the stages are built, rank 0 learns where each serves its bands to decoders
(:func:`agree_band_servers`).
"""

from __future__ import annotations

import json
import re
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from wavepp.config import RunConfig, check_for_world, layer_counts, stage_capacities, validate
from wavepp.handoff import wire
from wavepp.launch.backends import Backend, backend_for
from wavepp.launch.log import log
from wavepp.plan.placement import Placement, PlacementError, even, given, typical_wave
from wavepp.rounds.plane import RoundsPlane
from wavepp.rungs import RUNGS, Admission
from wavepp.runtime.handoff import BandServers
from wavepp.state import block_hashes, num_blocks_for
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

if TYPE_CHECKING:
    from wavepp.exec.tp import StageGroups
    from wavepp.sim.profiles import StagePool


def preflight(c: RunConfig, world: int) -> Backend:
    """Every check that does not need the ranks, run before any process group: each
    option (whatever its source), the model, the split of layers and pools over
    ``world`` stages (``world`` ranks, ``--tp`` of them a stage), the input files.
    Returns the run's backend; raises SystemExit with one line."""
    validate(c)
    if world % c.tp:
        raise SystemExit(f"wavepp: --tp {c.tp} does not divide the {world} ranks; the ranks "
                         "are stages x tp (torchrun --nproc-per-node P x T)")  # fmt: skip
    world //= c.tp
    backend = backend_for(c)
    num_layers = backend.check(world)
    check_for_world(c, world, num_layers)
    backend.check_fit(world, auto_capacity(c, []))
    counts = layer_counts(c.layers_per_stage)
    if backend.whole_layers and counts and any(n % 1 for n in counts):
        raise SystemExit(f"wavepp: --layers-per-stage {c.layers_per_stage}: the sim places "
                         "whole layers (its cost model prices a layer, not its halves)")
    for option, path in (("--requests-file", c.requests_file), ("--trace", c.trace)):
        if path and not Path(path).is_file():
            raise SystemExit(f"wavepp: {option} {path}: no such file")
    return backend


async def open_planes(c: RunConfig, backend: Backend, rank: int, world: int,
                      watchdog: Watchdog | None,
                      groups: StageGroups | None = None) -> Planes:  # fmt: skip
    """The rounds plane and this rank's data-plane links, as configured, over the links
    the backend runs (a simulator's take the time its activations would)."""
    planes = await build_planes(c.timeout_s, c.rounds_plane, c.data_plane, log,
                                backend.plane_device(),
                                on_wait=watchdog.set_status if watchdog is not None else None,
                                leaders=groups.leaders if groups is not None else None)
    return backend.links(planes, rank, world)


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


@attrs.frozen
class Setup:
    """What every rank agreed on before its stage is built."""

    vocab: int | None  # None: ids are not checked (the datasheet sim)
    specs: list  # rank 0's offline workload, in release order
    rejected: list[dict]  # the lines of a requests file or trace refused
    cancels: list  # (request id, seconds after measurement starts)
    capacity: int  # this stage's pool, blocks
    min_capacity: int  # the smallest stage pool
    pools: list[StagePool] | None  # the pools from device memory (the sim's), else None
    placement: Placement  # the units (half layers) each stage holds
    run_id: str = ""  # rank 0's 16 random hex digits, every rank's (agree_run_id)


async def agree_setup(c: RunConfig, backend: Backend, rank: int, world: int,
                      plane: RoundsPlane, offline: bool) -> Setup | None:  # fmt: skip
    """The workload (rank 0, offline), the placement of layers and every stage's pool
    size; None when a requests file holds no runnable request (every rank then ends the
    run)."""
    vocab = backend.vocab()
    specs, rejected, cancels = [], [], []
    if rank == 0 and offline:
        specs, rejected, cancels = build_workload(c, vocab or VOCAB)
        if c.handoff_all:  # every measured request hands its cache to the default target
            specs = [s if s.warmup else attrs.evolve(s, handoff=True) for s in specs]
    # Every rank needs the pool size; rank 0 derives it from the workload. A requests
    # file with no runnable line ends the run on every rank (runnable = 0).
    placement = await agree_placement(c, backend, rank, world, plane, specs)
    given = stage_capacities(c, world)
    pools = None if given else backend.default_pools(world, placement)
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
    run_id = await agree_run_id(plane, rank)
    return Setup(vocab, specs, rejected, cancels, capacity, min_capacity, pools, placement,
                 run_id)  # fmt: skip


_RUN_ID = re.compile(r"[0-9a-f]{16}")


async def agree_run_id(plane: RoundsPlane, rank: int) -> str:
    """The run's id, the same on every rank: 16 random hex digits of rank 0's. It names
    the run to decoders (its bands' sender: ids of two runs never meet at one) and
    prefixes the request ids the engine names."""
    raw = await plane.broadcast(secrets.token_hex(8).encode() if rank == 0 else None)
    text = raw.decode("ascii", "replace")
    if not _RUN_ID.fullmatch(text):
        raise RuntimeError(f"rank 0 sent a run id that is not 16 hex digits: {raw[:40]!r}")
    return text


async def agree_band_servers(plane: RoundsPlane, address: str | None,
                             lease_s: float) -> BandServers | None:  # fmt: skip
    """Rank 0: every stage's band server (``address``: this stage's, as decoders reach
    it), or None when the stages serve none; None on the other ranks. A stage's address
    is checked as any peer's input."""
    gathered = await plane.gather((address or "").encode())
    if gathered is None:
        return None
    addresses = []
    for stage, raw in enumerate(gathered):
        try:
            text = raw.decode()
            if text:
                wire.parse_address(text)
        except (UnicodeDecodeError, ValueError) as error:
            raise RuntimeError(f"stage {stage} sent a band server address that is not one: "
                               f"{raw[:200]!r} ({error})") from None  # fmt: skip
        addresses.append(text)
    if not any(addresses):
        return None
    if not all(addresses):
        raise RuntimeError(f"only some stages serve bands to decoders: {addresses}")
    return BandServers(tuple(addresses), lease_s)


async def agree_placement(c: RunConfig, backend: Backend, rank: int, world: int,
                          plane: RoundsPlane, specs: list) -> Placement:  # fmt: skip
    """Which units of the model each stage holds (``wavepp.plan.placement``): the even
    split or the given counts, or (auto) rank 0's balanced placement from the costs the
    backend gives the run's typical wave, sent to every rank."""
    num_layers = backend.num_layers
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
            why = backend.sharing_refused(placement)
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
        placement = backend.place(world, shape)
        log(f"layers per stage {placement.describe()}, placed in "
            f"{time.perf_counter() - started:.2f} s")  # fmt: skip
    raw = await plane.broadcast(None if placement is None else json.dumps(
        {"units": placement.units, "shares": placement.shares}).encode())
    return placement or received_placement(raw, world, num_layers)


def received_placement(raw: bytes, world: int, num_layers: int) -> Placement:
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


def auto_capacity(c: RunConfig, specs) -> int:
    """Enough blocks for 1.5 x concurrency of the longest prompt (--prompt-tokens when
    the requests come from a client), and for the seeded prefixes of a seeded or mixed
    workload plus the new blocks of ``concurrency`` requests in flight."""
    longest = max((s.num_tokens for s in specs), default=c.prompt_tokens)
    return max(num_blocks_for(longest, c.block_size),
               int(1.5 * c.concurrency * num_blocks_for(longest, c.block_size)),
               seeded_need(c, specs))  # fmt: skip


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
