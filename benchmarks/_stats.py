"""Small helpers shared by the benchmarks."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from wavepp.stats import percentile as percentile  # re-exported for the benchmarks


def ratio_of_means_interval(
    on: Sequence[float], off: Sequence[float], level: float = 0.95, resamples: int = 10_000,
    seed: int = 0,
) -> tuple[float, float]:  # fmt: skip
    """A paired bootstrap interval of ``mean(on) / mean(off)``: the pairs (``on[i]``,
    ``off[i]``, measured side by side) drawn with replacement ``resamples`` times, the
    ratio of means of each draw, and the central ``level`` of those ratios. Drawing pairs,
    not runs, keeps what a pair shares (the machine's speed at the time) out of the
    spread. A fixed seed: the same figures give the same interval."""
    if len(on) != len(off) or len(on) < 2:
        raise ValueError(f"a bootstrap needs two or more pairs, got {len(on)} and {len(off)}")
    pairs = np.asarray([on, off], dtype=float)
    draws = np.random.default_rng(seed).integers(0, pairs.shape[1], (resamples, pairs.shape[1]))
    ratios = pairs[0][draws].mean(axis=1) / pairs[1][draws].mean(axis=1)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(ratios, [tail, 100 - tail])
    return float(low), float(high)


def emit(record: dict, json_path: str | None) -> None:
    """Print the record as one JSON object and, if asked, write it to a file."""
    text = json.dumps(record, indent=2, sort_keys=True)
    print(text)
    if json_path:
        Path(json_path).write_text(text + "\n")
