"""Rank 0's count of the requests running out their last waves: what the cost planner
weighs a lone request's chunking by (``StageZero._running``)."""

from __future__ import annotations

from types import SimpleNamespace

from wavepp.plan import Pending
from wavepp.plan.wave import Chunk, Wave
from wavepp.runtime.stage_zero import StageZero


def _running(queue: list[Pending], sent: list[Wave]) -> int:
    zero = SimpleNamespace(planner=SimpleNamespace(queue=queue),
                           sent={w.wave_id: (w, 0.0) for w in sent})  # fmt: skip
    return StageZero._running(zero)


def test_running_counts_requests_in_flight_with_nothing_left_to_plan():
    a_head, a_tail = Chunk("a", 0, 64, 128), Chunk("a", 64, 128, 128)
    b_head = Chunk("b", 0, 64, 256)
    # Nothing sent: nothing running, whatever is queued.
    assert _running([Pending("a", 0, 128)], []) == 0
    # a's first half in flight and its second still queued: not running out.
    assert _running([Pending("a", 64, 128)], [Wave(0, 64, (a_head,))]) == 0
    # a fully planned (two waves in flight), b still queued behind its own first wave.
    waves = [Wave(0, 128, (a_head, b_head)), Wave(1, 64, (a_tail,))]
    assert _running([Pending("b", 64, 256)], waves) == 1
    # Both planned to the end: both running; a request counts once over its waves.
    assert _running([], waves) == 2
    # A wave that carries only cancels counts no one.
    assert _running([], [Wave(2, 0, ())]) == 0
