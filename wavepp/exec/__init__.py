"""Execution: the executors behind one protocol, the planes, the stage's LOOP side.

- ``base``: the :class:`Executor` protocol and the records it exchanges;
- ``torch_exec`` / ``families``: real model math; ``sim``: the cost-model simulation;
- ``planes``: the rounds plane and the data-plane links over ``torch.distributed``;
  ``local_plane``: the rounds plane over Unix sockets, for ranks on one host;
- ``stage``: one stage's cache effects around each wave; ``watchdog``: heartbeats.
"""

from wavepp.exec.base import ChunkWork, Executor, StageOutput
from wavepp.exec.planes import Link, PlaneError, TorchRoundsPlane, build_planes
from wavepp.exec.sim import SimExecutor
from wavepp.exec.stage import Admitted, Stage
from wavepp.exec.watchdog import Watchdog

__all__ = [
    "Admitted",
    "ChunkWork",
    "Executor",
    "Link",
    "PlaneError",
    "SimExecutor",
    "Stage",
    "StageOutput",
    "TorchRoundsPlane",
    "Watchdog",
    "build_planes",
]
