"""Small helpers shared by the benchmarks."""

from __future__ import annotations

import json
from pathlib import Path

from wavepp.stats import percentile as percentile  # re-exported for the benchmarks


def emit(record: dict, json_path: str | None) -> None:
    """Print the record as one JSON object and, if asked, write it to a file."""
    text = json.dumps(record, indent=2, sort_keys=True)
    print(text)
    if json_path:
        Path(json_path).write_text(text + "\n")
