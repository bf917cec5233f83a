"""``--trace-out PATH``: a Chrome-trace JSON of the run (open it in Perfetto).

One track per stage with each wave's span (warm-up waves marked), the idle gaps
between waves as ``bubble`` spans, and a track for rank 0's admission rounds.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from wavepp.rounds.messages import StageReport


def chrome_trace(
    reports: Sequence[StageReport], rounds: Sequence[tuple[float, float, int]], simulated: bool
) -> dict:
    starts = [s.start for r in reports for s in r.spans] + [a for a, _, _ in rounds]
    origin = min(starts) if starts else 0.0

    def us(t: float) -> float:
        return round((t - origin) * 1e6, 1)

    events: list[dict] = []
    label = " (simulated)" if simulated else ""
    for report in reports:
        tid = report.stage
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": tid,
                       "args": {"name": f"stage {tid}{label}"}})  # fmt: skip
        previous = None
        for span in sorted(report.spans, key=lambda s: s.start):
            if previous is not None and span.start > previous:
                gap = us(span.start) - us(previous)
                events.append({"ph": "X", "name": "bubble", "cat": "bubble", "pid": 0,
                               "tid": tid, "ts": us(previous), "dur": gap})  # fmt: skip
            events.append({
                "ph": "X", "name": f"wave {span.wave_id}",
                "cat": "warm-up" if span.free else "wave", "pid": 0, "tid": tid,
                "ts": us(span.start), "dur": us(span.end) - us(span.start),
                "args": {"tokens": span.num_tokens},
            })  # fmt: skip
            previous = span.end
    admission = len(reports)
    events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": admission,
                   "args": {"name": "admission rounds (rank 0)"}})  # fmt: skip
    for start, end, n in rounds:
        events.append({"ph": "X", "name": f"round ({n} requests)", "cat": "admission", "pid": 0,
                       "tid": admission, "ts": us(start), "dur": us(end) - us(start)})  # fmt: skip
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(path: str | Path, trace: dict) -> None:
    Path(path).write_text(json.dumps(trace) + "\n")
