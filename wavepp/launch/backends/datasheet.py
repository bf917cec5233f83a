"""The simulator of a datasheet device (``--executor sim --sim-device NAME``): a model
profile priced by a roofline of the device's peaks, stages on a simulated topology."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import attrs
import numpy as np

from wavepp.config import RunConfig
from wavepp.launch.backends.base import Backend
from wavepp.launch.log import log
from wavepp.plan.placement import Placement, WaveShape, whole_layers
from wavepp.sim.executor import SimExecutor, StageCostModel
from wavepp.sim.links import SimulatedLink, Topology
from wavepp.sim.profiles import DEVICES, KV_BYTES, MODELS, StagePool, stage_pool
from wavepp.transport.planes import Planes

if TYPE_CHECKING:
    from wavepp.exec.tp import StageGroups


class DatasheetBackend(Backend):
    """Every wave sleeps the time ``StageCostModel`` predicts; the pools follow each
    stage's device memory; the placement is whole layers."""

    whole_layers = True

    def __init__(self, c: RunConfig) -> None:
        self.config = c

    @staticmethod
    def runs(c: RunConfig) -> bool:
        return c.executor == "sim"

    def check(self, stages: int) -> int:
        c = self.config
        if c.model not in MODELS:
            raise SystemExit(f"wavepp: sim model {c.model!r} unknown; one of {sorted(MODELS)}")
        self.topology(stages)
        return MODELS[c.model].num_layers

    def topology(self, world: int) -> Topology:
        """Where the sim's stages sit (``--sim-device``, ``--sim-tp``, ``--sim-link``)."""
        c = self.config
        try:
            return Topology(DEVICES[c.sim_device], world, c.sim_tp, c.sim_link)
        except ValueError as error:
            raise SystemExit(f"wavepp: {error}") from None

    @property
    def num_layers(self) -> int:
        return MODELS[self.config.model].num_layers

    def links(self, planes: Planes, rank: int, world: int) -> Planes:
        """The link to the next stage takes the time its activations need over the link
        the topology gives it (``wavepp.sim.links``)."""
        c = self.config
        topology = self.topology(world)
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

    def place(self, world: int, shape: WaveShape) -> Placement:
        """Whole layers, each stage's time on the wave from the cost model."""
        c = self.config
        profile, topology = MODELS[c.model], self.topology(world)
        chunks = [(shape.prefix, shape.prefix + shape.tokens)] * shape.chunks

        @functools.cache
        def span(a: int, b: int, s: int) -> float:
            last = s == world - 1
            cost = StageCostModel(profile, topology.device, range(a, b), last, c.weight_format,
                                  tp=c.sim_tp, tp_link=topology.tp_link)  # fmt: skip
            return cost.cost(chunks, shape.chunks if last else 0).seconds

        counts = whole_layers(span, profile.num_layers, world)
        starts = [sum(counts[:s]) for s in range(world)]
        times = tuple(span(a, a + n, s)
                      for s, (a, n) in enumerate(zip(starts, counts, strict=True)))  # fmt: skip
        return Placement(tuple(2 * n for n in counts), "auto", times,
                         shape.describe() + " (SIMULATED)")  # fmt: skip

    def default_pools(self, world: int, placement: Placement) -> list[StagePool] | None:
        """Each stage's KV pool from its device memory minus its own weights
        (``wavepp.sim.profiles.stage_pool``), or None where the weights leave no room."""
        c = self.config
        model, device = MODELS[c.model], DEVICES[c.sim_device]
        stages = [range(u.start // 2, u.stop // 2) for u in placement.spans]
        try:
            return [stage_pool(model, device, layers, s == 0, s == world - 1, c.block_size,
                               c.snapshot_interval, c.weight_format, c.sim_tp)
                    for s, layers in enumerate(stages)]  # fmt: skip
        except ValueError as error:
            log(f"{error}; the pools follow the workload instead (as if memory were unbounded)")
            return None

    def build_executor(self, rank: int, world: int, capacity: int, snapshot_capacity: int,
                       placement: Placement,
                       groups: StageGroups | None = None) -> SimExecutor:  # fmt: skip
        c = self.config
        units = placement.spans[rank]
        layers = range(units.start // 2, units.stop // 2)
        topology = self.topology(world)
        cost = StageCostModel(MODELS[c.model], topology.device, layers, rank == world - 1,
                              c.weight_format, tp=c.sim_tp,
                              tp_link=topology.tp_link)  # fmt: skip
        rng = np.random.default_rng([c.seed, rank])  # the noise: seeded, per rank
        return SimExecutor(cost, c.time_scale, c.sim_noise, rng)
