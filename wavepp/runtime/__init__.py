"""Rank 0's runtime in parts with one job each, and the other ranks' tasks (DESIGN §3).

Every rank runs one anyio event loop. Blocking ``torch.distributed`` calls run in worker
threads, so a pending data-plane receive never stalls an admission round and the other
way round. The rung (``wavepp.rungs``) says how admission, reservation and planning go.
"""

from wavepp.runtime.admitter import Admitter
from wavepp.runtime.coordinator import Coordinator
from wavepp.runtime.feed import Feed
from wavepp.runtime.followers import follow_rounds, follow_waves
from wavepp.runtime.intake import Intake
from wavepp.runtime.pace import Pace
from wavepp.runtime.planning import WavePlanner
from wavepp.runtime.records import (
    ProtocolError,
    Record,
    RequestRejected,
    Result,
    Signal,
    Status,
    StatusError,
)
from wavepp.runtime.stage_zero import StageZero
from wavepp.runtime.table import RequestTable

__all__ = [
    "Admitter",
    "Coordinator",
    "Feed",
    "Intake",
    "Pace",
    "ProtocolError",
    "Record",
    "RequestRejected",
    "RequestTable",
    "Result",
    "Signal",
    "StageZero",
    "Status",
    "StatusError",
    "WavePlanner",
    "follow_rounds",
    "follow_waves",
]
