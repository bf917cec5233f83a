"""Execution: what a stage runs for each wave, behind one protocol.

- ``base``: the :class:`Executor` protocol and the records it exchanges;
- ``torch_exec``: real model math (``wavepp.model``) over a paged pool; the simulated
  executor lives in ``wavepp.sim``;
- ``stage``: one stage's cache effects around each wave, and its handoff sender
  (``wavepp.handoff.send``); ``device``: where a rank computes.
"""

from wavepp.exec.base import ChunkWork, Executor, StageOutput
from wavepp.exec.stage import Admitted, Stage

__all__ = ["Admitted", "ChunkWork", "Executor", "Stage", "StageOutput"]
