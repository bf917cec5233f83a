"""The rounds plane: typed round messages with their codec, and the admission round.

No torch here; the Gloo implementation of the plane is in ``wavepp.exec``.
"""

from wavepp.rounds.admission import (
    Offer,
    RoundCounters,
    RoundMode,
    RoundResult,
    StageBook,
    agree_over,
    commit,
    cut,
    lease_all,
    probe_points,
    round_over,
    run_round,
    serve_masks,
    settle,
)
from wavepp.rounds.errors import ProtocolError
from wavepp.rounds.plane import RoundsPlane

__all__ = [
    "Offer",
    "ProtocolError",
    "RoundCounters",
    "RoundMode",
    "RoundResult",
    "RoundsPlane",
    "StageBook",
    "agree_over",
    "commit",
    "cut",
    "lease_all",
    "probe_points",
    "round_over",
    "run_round",
    "serve_masks",
    "settle",
]
