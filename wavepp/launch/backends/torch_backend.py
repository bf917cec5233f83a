"""The torch executor's runs: real model math, a built-in model or a checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from wavepp.config import RunConfig, handoff_secret, stage_capacities
from wavepp.exec import compute
from wavepp.exec.device import pick_device, pick_dtype
from wavepp.exec.layer_costs import measure as measure_costs
from wavepp.exec.torch_exec import TorchExecutor
from wavepp.exec.tp import StageGroups, TPLeader, follow_leader, receive_plan, stage_built
from wavepp.handoff.base import HandoffSettings
from wavepp.handoff.socket_send import INLINE_BYTES
from wavepp.host import available_memory
from wavepp.launch.backends.base import Backend, sharing_refused
from wavepp.launch.log import log
from wavepp.model import BUILTIN, build_stage, random_weights
from wavepp.model.checkpoint import check_tensors, config_file, load_checkpoint, read_config
from wavepp.model.config import ModelConfig
from wavepp.model.fields import CheckpointError
from wavepp.model.footprint import Footprint, footprint
from wavepp.model.tp import NO_TP, DistTPGroup, check_tp
from wavepp.plan.placement import Placement, WaveShape, balanced
from wavepp.runtime.handoff import HandoffTargets, fingerprint
from wavepp.transport.planes import Planes


class TorchBackend(Backend):
    """``--executor torch``: the model's weights (random for a built-in model) on
    ``--device``; stages hand their bands of a request's cache on; ``--tp``."""

    whole_layers = False

    def __init__(self, c: RunConfig) -> None:
        self.config = c
        self._cfg: ModelConfig | None = None  # read by load
        self._weights: dict[str, torch.Tensor] | None = None  # until the stage is built
        self._described: ModelConfig | None = None  # the config, checked by check

    @staticmethod
    def runs(c: RunConfig) -> bool:
        return c.executor == "torch"

    def check(self, stages: int) -> int:
        c = self.config
        if c.model not in BUILTIN and not Path(c.model).is_dir():
            raise SystemExit(f"wavepp: --model {c.model!r} is neither built in "
                             f"({', '.join(BUILTIN)}) nor a checkpoint directory")  # fmt: skip
        try:
            cfg = BUILTIN[c.model] if c.model in BUILTIN else read_config(c.model)
        except CheckpointError as error:
            raise SystemExit(f"wavepp: --model {c.model}: {error}") from None
        try:
            check_tp(cfg, c.tp)
        except ValueError as error:
            raise SystemExit(f"wavepp: {error}") from None
        self._described = cfg
        return cfg.num_layers

    def check_fit(self, stages: int, default_blocks: int) -> None:
        """The model's weights and the KV pools at the run's settings (at least: every
        stage's pool at the smallest stage's size; snapshots of recurrent states) against
        this machine's available memory, on this machine's share of the ranks; on a GPU
        the weights alone (they are read into host memory first). Then a checkpoint's
        tensors against its config, from their headers."""
        c = self.config
        cfg = self._described
        try:
            model = footprint(cfg)
        except OverflowError as error:
            raise SystemExit(f"wavepp: --model {c.model}: the model cannot be held: "
                             f"{error}") from None
        need, parts = memory_need(c, model, stages, default_blocks)
        have = available_memory()
        if have is not None and need > have:
            source = "" if c.model in BUILTIN else f"{config_file(Path(c.model)).name}: "
            raise SystemExit(f"wavepp: --model {c.model}: {source}the run needs at least "
                             f"{need / 1e9:,.1f} GB ({parts}); this machine has "
                             f"{have / 1e9:,.1f} GB available")  # fmt: skip
        if c.model not in BUILTIN:
            try:
                check_tensors(c.model, model.tensors)
            except CheckpointError as error:
                raise SystemExit(f"wavepp: --model {c.model}: {error}") from None

    def load(self) -> None:
        self._cfg, self._weights = self._read()

    def _read(self) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
        """The model's config and every layer's weights."""
        c = self.config
        if c.model in BUILTIN:
            cfg = BUILTIN[c.model]
            model = cfg, random_weights(cfg, c.seed)
        elif Path(c.model).is_dir():
            try:
                model = load_checkpoint(c.model, pick_dtype(c.dtype))
            except CheckpointError as error:
                raise SystemExit(f"wavepp: --model {c.model}: {error}") from None
        else:
            raise SystemExit(f"wavepp: --model {c.model!r} is neither built in "
                             f"({', '.join(BUILTIN)}) nor a checkpoint directory")  # fmt: skip
        try:
            check_tp(model[0], c.tp)
        except ValueError as error:
            raise SystemExit(f"wavepp: {error}") from None
        return model

    @property
    def num_layers(self) -> int:
        return self._cfg.num_layers

    def vocab(self) -> int:
        return self._cfg.vocab_size

    def plane_device(self) -> torch.device:
        return pick_device(self.config.device)

    def links(self, planes: Planes, rank: int, world: int) -> Planes:
        return planes

    def place(self, world: int, shape: WaveShape) -> Placement:
        """From the costs rank 0 measures for each part of the model on the wave."""
        c = self.config
        share = self.sharing_refused() is None
        costs = compute.call(measure_costs, self._cfg, self._weights, shape,
                             pick_device(c.device), pick_dtype(c.dtype), c.block_size,
                             c.full_last_layer, shared=share)  # fmt: skip
        return balanced(costs.mixers, costs.mlps, costs.last_layer, costs.embed, costs.head,
                        world, shape=shape.describe(),
                        shared=costs.shared if share else None)  # fmt: skip

    def sharing_refused(self, placement: Placement | None = None) -> str | None:
        return sharing_refused(self._cfg.mixers, self.config.tp, placement)

    def build_executor(self, rank: int, world: int, capacity: int, snapshot_capacity: int,
                       placement: Placement,
                       groups: StageGroups | None = None) -> TorchExecutor | TPLeader:  # fmt: skip
        c = self.config
        units = placement.spans[rank]
        shares = (placement.shared_first(rank), placement.shared_last(rank))
        if c.compile:
            log(f"compiling stage {rank}'s layers (--compile)")
        executor = compute.call(self._stage_executor, self._cfg, self._weights, units,
                                rank == 0, rank == world - 1, capacity, snapshot_capacity,
                                groups, shares)  # fmt: skip
        self._weights = None  # the stage holds its own layers' weights
        for line in executor.describe():
            log(f"stage {rank}: {line}")
        if groups is None:
            return executor
        leader = TPLeader(executor, groups, c.tp, c.handoff_timeout_s)
        leader.set_limits(leader.limits(c.budget))
        stage_built(groups)
        return leader

    def _stage_executor(self, cfg: ModelConfig, weights: dict, units: range, first: bool,
                        last: bool, capacity: int, snapshot_capacity: int | None,
                        groups: StageGroups | None,
                        shared: tuple[float | None, float | None] = (None, None),
                        ) -> TorchExecutor:  # fmt: skip
        """This rank's torch executor: its stage's layers (with ``--tp``, its shard of
        them, reducing over the stage's group) over pools of ``capacity`` blocks;
        ``shared``: the shares of the mixers it shares with the stage before and after
        (``Placement``)."""
        c = self.config
        tp = NO_TP if groups is None else DistTPGroup(groups.compute)
        modules = build_stage(cfg, range(0), first, last, weights, pick_device(c.device),
                              pick_dtype(c.dtype), units, tp=tp)  # fmt: skip
        return TorchExecutor(modules, capacity, c.block_size, snapshot_capacity, c.compile,
                             c.full_last_layer, *shared)  # fmt: skip

    def handoff(self, rank: int, world: int,
                sender: str = "") -> tuple[HandoffSettings, HandoffTargets]:  # fmt: skip
        """Every stage can hand its band of a request's cache on."""
        c = self.config
        on_cpu = pick_device(c.device).type == "cpu"
        settings = HandoffSettings(rank, world, fingerprint(c.model, self._cfg, c.dtype),
                                   c.handoff_timeout_s, c.handoff_budget_mib << 20,
                                   INLINE_BYTES if on_cpu else 0,
                                   c.handoff_lease_s, c.handoff_serve, c.handoff_advertise,
                                   secret=handoff_secret(c), sender=sender)  # fmt: skip
        targets = HandoffTargets(c.handoff_to, pulls=c.handoff_serve is not None)
        return settings, targets

    def follow_stage(self, groups: StageGroups) -> int:
        """Build this rank's shard of what the leader agreed with the other stages, then
        run the leader's posts until it stops."""
        c = self.config
        cfg, weights = self._read()
        plan = receive_plan(groups, cfg.num_layers)
        if plan is None:
            return 2
        executor = self._stage_executor(cfg, weights, range(*plan.units), plan.first,
                                        plan.last, plan.capacity, plan.snapshot_capacity,
                                        groups)  # fmt: skip
        del weights  # the shard holds its own
        groups.posts[0].set_limits(executor.limits(c.budget))
        stage_built(groups)
        follow_leader(executor, groups, c.tp, plan.first)
        return 0



def memory_need(c: RunConfig, model: Footprint, stages: int,
                default_blocks: int) -> tuple[int, str]:  # fmt: skip
    """(bytes this machine's ranks need at least, what they are), for :meth:`check_fit`."""
    element = torch.empty((), dtype=pick_dtype(c.dtype)).element_size()
    weights = model.weight_elements * element
    capacity = min(stage_capacities(c, stages) or [default_blocks])
    kv = stages * capacity * c.block_size * model.cache_row * element
    snapshots = stages * (c.snapshot_capacity or capacity) * model.state * 4  # fp32
    # this machine's share of the run's ranks (all of them for one node, and a launcher)
    local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    share = min(1.0, int(local) / int(world)) if local and world else 1.0
    on_gpu = pick_device(c.device).type != "cpu"
    parts = [f"{weights / 1e9:,.1f} GB of weights in {c.dtype}"]
    if not on_gpu:
        parts.append(f"{(kv + snapshots) / 1e9:,.1f} GB of KV pools: {capacity:,} blocks of "
                     f"{c.block_size} tokens a stage"
                     + (", with recurrent-state snapshots" if snapshots else ""))  # fmt: skip
    need = weights if on_gpu else weights + kv + snapshots
    return int(need * share), ", ".join(parts)
