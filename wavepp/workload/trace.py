"""Mooncake-format trace replay (DESIGN §7).

Each line: ``timestamp`` (ms), ``input_length``, ``hash_ids`` (one id per 512 tokens;
equal ids at equal positions mean a shared prefix). Token ids are made from hash ids:
the same id always gives the same 512 tokens, the last block cut to ``input_length``.

A line may also carry ``deadline_ms`` (not in Mooncake's format): the request's result is
due that many trace milliseconds after its arrival. :func:`trace`'s ``deadline_s`` gives
the lines without one a deadline of that many trace seconds. Both are scaled by
``time_scale`` like the timestamps (``RequestSpec.deadline_s`` is wall seconds).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from wavepp.workload.generators import VOCAB, RequestSpec

TRACE_BLOCK = 512


def read_trace(path: str | Path, limit: int | None = None) -> tuple[list[dict], list[dict]]:
    """The first ``limit`` good lines, and the bad ones as ``{line, id, error}`` (a bad
    line is reported with its number and skipped, like a bad requests-file line)."""
    rows: list[dict] = []
    rejected: list[dict] = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError("not a JSON object")
                ids = [int(h) for h in row["hash_ids"]]
                length = int(row["input_length"])
                stamp = float(row["timestamp"])
                if length <= 0:
                    raise ValueError(f"input_length {length} (a prompt needs ≥ 1 token)")
                if length > len(ids) * TRACE_BLOCK:
                    raise ValueError(f"input_length {length:,} exceeds its {len(ids)} hash ids "
                                     f"of {TRACE_BLOCK} tokens")  # fmt: skip
                if not 0 <= stamp < 1e12:
                    raise ValueError(f"timestamp {stamp} outside [0, 1e12) ms")
                deadline = row.get("deadline_ms")
                if deadline is not None and (not isinstance(deadline, int | float)
                                             or isinstance(deadline, bool)
                                             or not 0 < deadline <= 1e9):  # fmt: skip
                    raise ValueError(f"deadline_ms {deadline!r} is not in (0, 1e9] ms")
                rows.append({"timestamp": stamp, "input_length": length, "hash_ids": ids,
                             "line": number, "deadline_ms": deadline})  # fmt: skip
            except (ValueError, KeyError, TypeError) as error:
                text = f"{path}:{number}: not a usable Mooncake trace line ({error})"
                rejected.append({"line": number, "id": None, "error": text})
    return rows, rejected


def _block_tokens(seed: int, hash_id: int, vocab: int) -> np.ndarray:
    return np.random.default_rng([seed, hash_id]).integers(0, vocab, TRACE_BLOCK, dtype=np.int32)


def trace(
    path: str | Path, limit: int | None, seed: int, block_size: int = 64,
    open_loop: bool = False, time_scale: float = 1.0, vocab: int = VOCAB,
    deadline_s: float | None = None,
) -> list[RequestSpec]:  # fmt: skip
    """Replay a trace prefix (bad lines skipped; :func:`read_trace` lists them).
    ``expected_reuse`` is the longest leading run of hash ids that an earlier request of
    the trace already had (what a perfect cache reuses)."""
    rows, _ = read_trace(path, limit)
    cache: dict[int, np.ndarray] = {}
    seen: set[int] = set()
    out = []
    for i, row in enumerate(rows):
        parts = []
        key, shared, sharing = 0, 0, True
        for h in row["hash_ids"]:
            if h not in cache:
                cache[h] = _block_tokens(seed, h, vocab)
            parts.append(cache[h])
            key = hash((key, h))
            if sharing and key in seen:
                shared += 1
            else:
                sharing = False
            seen.add(key)
        tokens = np.concatenate(parts)[: row["input_length"]] if parts else np.zeros(0, np.int32)
        expected = min(shared * TRACE_BLOCK, max(len(tokens) - 1, 0)) // block_size * block_size
        arrival = row["timestamp"] / 1000 * time_scale if open_loop else None
        due = row["deadline_ms"] / 1000 if row["deadline_ms"] is not None else deadline_s
        due = None if due is None else due * time_scale
        out.append(RequestSpec(f"trace-{i}", tokens, False, expected, arrival, deadline_s=due))
    return out
