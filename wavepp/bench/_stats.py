"""Small helpers shared by the benchmarks."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 100]."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[rank]


def emit(record: dict, json_path: str | None) -> None:
    """Print the record as one JSON object and, if asked, write it to a file."""
    text = json.dumps(record, indent=2, sort_keys=True)
    print(text)
    if json_path:
        Path(json_path).write_text(text + "\n")
