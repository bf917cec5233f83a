"""How a run starts and ends, above the runtime and the engine (``python -m wavepp.main``).

- ``backends``: what differs between the kinds of run (torch executor, datasheet sim,
  measured sim), one :class:`Backend` chosen once per run (:func:`backend_for`);
- ``setup``: the checks before any process group (:func:`preflight`), the planes, what
  the ranks agree on before a stage is built;
- ``rank``: one stage's run, rank 0's coordinator and client; ``record``: the leak
  check and rank 0's record;
- ``lifecycle``: a rank's signals, fail-fast and exit status (:class:`Lifecycle`).

``wavepp.main.run_ranks`` puts them together.
"""

from wavepp.launch.backends import Backend, backend_for
from wavepp.launch.lifecycle import Lifecycle, refuse_once
from wavepp.launch.log import log
from wavepp.launch.setup import preflight

__all__ = ["Backend", "Lifecycle", "backend_for", "log", "preflight", "refuse_once"]
