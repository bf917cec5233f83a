"""Where an admission round's time goes: timestamps of its steps, on every rank.

A :class:`RoundTrace` keeps ``(broadcast number, step, perf_counter_ns)`` marks in a
window of fixed length and writes them out as JSON when asked. Every rank counts the
rounds plane's broadcasts (each round, heartbeat and stop opens with one, in the same
order everywhere), so marks of one round line up across ranks by that number, and
``perf_counter_ns`` is the host's monotonic clock, the same in every process: a
round's steps on four ranks read as one time line (``benchmarks.admission`` does).

Off by default: :data:`NO_TRACE` marks nothing. ``WAVEPP_ROUND_TRACE=<dir>`` makes the
rounds plane of a run keep one (``wavepp.transport.planes.build_planes``), written to
``<dir>/rank-<r>.json`` when the run gathers its stage reports (its last rounds-plane
operation). A diagnostic: a mark costs a clock read and a tuple.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque

ENV = "WAVEPP_ROUND_TRACE"
WINDOW = 1 << 18  # marks kept (the latest): ~12K rounds of four ranks' steps

# The steps, in a round's order. Rank 0 marks `offers` .. `encoded` before its broadcast
# (they count towards the round that broadcast opens); the plane marks the frames.
STEPS = (
    "offers",  # rank 0: the admitter starts choosing the round's offers
    "anchors",  # rank 0: offers chosen, its own probes (the window anchors) next
    "encoded",  # rank 0: anchors probed, AdmitRound encoded
    "bcast_sent",  # rank 0: the broadcast written to every peer
    "bcast_recv",  # a peer: the broadcast read (it woke up and read the frame)
    "start",  # run_round begins (a peer: the message decoded, offers built)
    "probed",  # hint probes done
    "leased",  # leases taken, serve masks and spare room computed
    "guessed",  # settled at the guessed points (a stage short of room), or not
    "sent",  # a peer: its frame of a MIN / AND / gather written to rank 0
    "peer_in",  # rank 0: one peer's frame read (one mark per peer)
    "reduced",  # rank 0: the reduced frame written to every peer
    "reduced_recv",  # a peer: the reduced frame read
    "min_done",  # the first MIN's results unpacked (and any AND windows run)
    "settled",  # reconcile + escrow done
    "flags_done",  # the escrow flags' MIN done (or skipped: every stage had room)
    "end",  # the round's cut, commit and counters done
    "applied",  # rank 0: the admitter applied the outcome (registered, planned)
    "resettled",  # settled again after the collective, its cache having moved meanwhile
)
_CODE = {name: i for i, name in enumerate(STEPS)}


class RoundTrace:
    """Marks of this rank's rounds, the latest :data:`WINDOW` of them."""

    enabled = True

    def __init__(self, rank: int, out_dir: str | None = None, window: int = WINDOW) -> None:
        self.rank = rank
        self.out_dir = out_dir
        self.seq = 0  # broadcasts seen: the number of the round under way
        self.marks: deque[tuple[int, int, int]] = deque(maxlen=window)

    def opened(self) -> None:
        """A broadcast opens the next round (or heartbeat, or stop)."""
        self.seq += 1

    def mark(self, step: str, ahead: bool = False) -> None:
        """``step`` happens now; ``ahead``: it belongs to the round the next broadcast
        opens (rank 0's work before it)."""
        self.marks.append((self.seq + ahead, _CODE[step], time.perf_counter_ns()))

    def to_json(self) -> dict:
        return {"rank": self.rank, "steps": list(STEPS), "marks": list(self.marks)}

    def write(self) -> str | None:
        """Write the marks to ``<out_dir>/rank-<r>.json`` (none without a directory)."""
        if not self.out_dir:
            return None
        os.makedirs(self.out_dir, exist_ok=True)
        path = os.path.join(self.out_dir, f"rank-{self.rank}.json")
        with open(path, "w") as f:
            json.dump(self.to_json(), f)
        return path

    @classmethod
    def from_env(cls, rank: int) -> RoundTrace | None:
        """A trace writing to ``$WAVEPP_ROUND_TRACE`` if that is set, else None."""
        out = os.environ.get(ENV, "")
        return cls(rank, out) if out else None


class _NoTrace:
    """Marks nothing: what a plane without a trace holds."""

    enabled = False
    seq = 0

    def opened(self) -> None:
        pass

    def mark(self, step: str, ahead: bool = False) -> None:
        pass

    def write(self) -> str | None:
        return None


NO_TRACE = _NoTrace()
