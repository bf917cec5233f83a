"""The simulator of a measured profile (``--sim-device measured:FILE``): the torch
executor's parts as fitted on one machine (``wavepp.sim.measured``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import numpy as np

from wavepp.config import RunConfig
from wavepp.launch.backends.base import Backend, sharing_refused
from wavepp.launch.log import log
from wavepp.plan.placement import Placement, WaveShape, balanced
from wavepp.sim.executor import SimExecutor
from wavepp.sim.links import SimulatedLink
from wavepp.sim.measured import (
    MeasuredProfile,
    MeasuredStageCost,
    ProfileError,
    load_profile,
    measured_path,
)
from wavepp.transport.planes import Planes

if TYPE_CHECKING:
    from wavepp.exec.tp import StageGroups


def read_profile(c: RunConfig) -> MeasuredProfile:
    """``--sim-device measured:FILE``'s profile, checked, for ``--model``."""
    try:
        profile = load_profile(measured_path(c.sim_device))
    except ProfileError as error:
        raise SystemExit(f"wavepp: --sim-device: {error}") from None
    if profile.model != c.model:
        raise SystemExit(f"wavepp: --sim-device {c.sim_device} was measured with "
                         f"{profile.model!r}, not --model {c.model!r}")  # fmt: skip
    return profile


class MeasuredBackend(Backend):
    """Every wave sleeps the time the profile's fits give the torch executor's parts; the
    placement is the torch executor's, from the same parts' predicted costs."""

    whole_layers = False

    def __init__(self, c: RunConfig) -> None:
        self.config = c
        self.profile = read_profile(c)

    @staticmethod
    def runs(c: RunConfig) -> bool:
        return c.executor == "sim" and measured_path(c.sim_device) is not None

    def check(self, stages: int) -> int:
        return self.profile.num_layers

    @property
    def num_layers(self) -> int:
        return self.profile.num_layers

    def vocab(self) -> int:
        """The workload's ids drawn as the torch run draws them."""
        return self.profile.vocab

    def links(self, planes: Planes, rank: int, world: int) -> Planes:
        """This machine's ranks: the activations' bytes over the measured link."""
        p = self.profile
        if planes.outbound is None or p.link is None:
            return planes
        outbound = SimulatedLink(planes.outbound, p.link, p.d_model * p.act_bytes,
                                 self.config.time_scale)  # fmt: skip
        return attrs.evolve(planes, outbound=outbound)

    def place(self, world: int, shape: WaveShape) -> Placement:
        """The torch executor's balanced placement, from the costs the profile predicts
        for the parts it would time on the same wave."""
        costs = self.profile.unit_costs(shape)
        return balanced(*costs, world, shape=shape.describe() + " (SIMULATED)",
                        shared=self.profile.rowless_costs(shape))  # fmt: skip

    def sharing_refused(self, placement: Placement | None = None) -> str | None:
        return sharing_refused(self.profile.mixers, self.config.tp, placement)

    def build_executor(self, rank: int, world: int, capacity: int, snapshot_capacity: int,
                       placement: Placement,
                       groups: StageGroups | None = None) -> SimExecutor:  # fmt: skip
        c, p = self.config, self.profile
        sharing = 1.0 if c.sim_burn else p.core_sharing(world, c.threads)
        if sharing > 1 and rank == 0:
            log(f"sim: {world} ranks share the {p.machine['cores']} cores the profile was "
                f"measured on: every simulated wave takes {sharing:g}x its parts' time")
        cost = MeasuredStageCost(p, placement.spans[rank], rank == 0, rank == world - 1,
                                 sharing, placement.shared_first(rank),
                                 placement.shared_last(rank))  # fmt: skip
        rng = np.random.default_rng([c.seed, rank])  # the noise: seeded, per rank
        return SimExecutor(cost, c.time_scale, c.sim_noise, rng, burn=c.sim_burn,
                           burn_rate=p.machine.get("burn_blocks_s"))  # fmt: skip
