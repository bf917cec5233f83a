"""The backend protocol: everything that differs between the kinds of run.

A run is one kind — the torch executor, the simulator of a datasheet device, or the
simulator of a measured profile — chosen once from its options
(:func:`wavepp.launch.backends.backend_for`); the launch path then asks the backend,
never the options, how this kind checks its world, places layers, sizes pools, builds a
stage's executor and simulates its links. A new kind (a GPU profile, a remote executor)
is one class filling :class:`Backend`, listed in ``BACKENDS``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol

from wavepp.config import RunConfig
from wavepp.exec.base import Executor
from wavepp.model.config import RECURRENT
from wavepp.plan.placement import Placement, WaveShape
from wavepp.transport.planes import Planes

if TYPE_CHECKING:
    import torch

    from wavepp.exec.tp import StageGroups
    from wavepp.handoff.base import HandoffSettings
    from wavepp.runtime.handoff import HandoffTargets
    from wavepp.sim.profiles import StagePool


class Backend(Protocol):
    """One kind of run, for its whole run. The methods with a body are what a kind
    without weights, devices or handoffs (the simulators) does; the torch backend
    overrides them."""

    config: RunConfig
    # The cost model prices whole layers, not their halves: --layers-per-stage and the
    # auto placement give whole layers.
    whole_layers: ClassVar[bool]

    @staticmethod
    def runs(c: RunConfig) -> bool:
        """Whether this backend runs ``c`` (the first of ``BACKENDS`` that does is used)."""
        ...

    def check(self, stages: int) -> int | None:
        """The checks no rank is needed for (the model known, ``stages`` stages of it
        possible), raising SystemExit with one line; the model's layer count where it is
        known before loading (None: a checkpoint's, read by :meth:`load`)."""
        ...

    def check_fit(self, stages: int, default_blocks: int) -> None:
        """What the run needs of this machine against what it has, and a checkpoint's
        tensors against its config, before any rank allocates: SystemExit with one line
        (both figures, or the file and the tensor). ``default_blocks``: a stage's pool
        where --capacity-blocks gives none. Nothing to check for a simulator."""

    def load(self) -> None:
        """Read what the stages are built from, on the compute thread (nothing to read
        for a simulator)."""

    @property
    def num_layers(self) -> int:
        """The model's layers (after :meth:`load`)."""
        ...

    def vocab(self) -> int | None:
        """The token ids' bound (drawn and checked below it); None: ids are not checked."""
        return None

    def plane_device(self) -> torch.device | None:
        """Where received activations go (None: the CPU)."""
        return None

    def links(self, planes: Planes, rank: int, world: int) -> Planes:
        """The planes this kind runs over: a simulator's link to the next stage takes
        the time its activations would."""
        ...

    def place(self, world: int, shape: WaveShape) -> Placement:
        """Rank 0's balanced placement (``--layers-per-stage auto``) for waves of
        ``shape``."""
        ...

    def sharing_refused(self, placement: Placement | None = None) -> str | None:
        """Why this run cannot share a mixer between two stages (of ``placement``, if
        given), or None."""
        return ("a mixer shared by two stages runs on the torch executor (or the simulator "
                "of a measured profile) only")  # fmt: skip

    def default_pools(self, world: int, placement: Placement) -> list[StagePool] | None:
        """Each stage's KV pool when --capacity-blocks gives none, or None: the pools
        follow the workload. Every rank computes the same list."""
        return None

    def build_executor(self, rank: int, world: int, capacity: int, snapshot_capacity: int,
                       placement: Placement,
                       groups: StageGroups | None = None) -> Executor:  # fmt: skip
        """Stage ``rank``'s executor over pools of ``capacity`` blocks; with ``groups``
        (``--tp``) the leader's, posting every wave to the stage's other ranks."""
        ...

    def handoff(
        self, rank: int, world: int, sender: str = ""
    ) -> tuple[HandoffSettings | None, HandoffTargets | None]:
        """How stage ``rank`` hands a request's cache on (its bands' ``sender``: the run's
        id), and (rank 0) where to; (None, None): this kind holds no cache to hand on."""
        return None, None

    def follow_stage(self, groups: StageGroups) -> int:
        """A TP rank other than its stage's leader: build its shard, run the leader's
        posts until it stops; the exit status (2: nothing to run)."""
        raise SystemExit(f"wavepp: --executor {self.config.executor} has no --tp")


def sharing_refused(mixers: Sequence[str], tp: int,
                    placement: Placement | None = None) -> str | None:  # fmt: skip
    """Why a model of ``mixers`` (by layer) cannot share a mixer between two stages of
    ``placement`` with ``tp`` ranks a stage, or None: one rank a stage, attention
    mixers."""
    if tp > 1:
        return "a mixer shared by two stages cannot also be split by --tp"
    for b, share in enumerate(placement.shares if placement else ()):
        layer = (sum(placement.units[: b + 1]) - 1) // 2
        if share and mixers[layer] in RECURRENT:
            return (f"layer {layer}'s mixer ({mixers[layer]}) is recurrent; only attention "
                    "can be shared by two stages")  # fmt: skip
    return None
