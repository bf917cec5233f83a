"""Requests from a JSONL file: one ``{"id": ..., "tokens": [...]}`` per line.

A line may say ``"warmup": true``: it runs before measurement starts and is not timed
(how a benchmark seeds shared prefixes). ``"handoff": "unix:/path"`` (or ``true``, the
run's default target) hands the prompt's cache on when it ends (``docs/handoff.md``).
``"deadline_s": 2.5`` gives the request a deadline: its result is due that many wall-clock
seconds after it is submitted (``Engine.submit``'s ``deadline_s``).

A line ``{"cancel": "<id>", "after_s": 0.5}`` cancels an earlier line's request that
long after measurement starts (queued, admitted or running). A bad line — not JSON, no
tokens, token ids outside the vocabulary, a repeated id, a cancel of an unknown id — is
reported with its line number and skipped; the other lines run. Ids follow the one id
rule (``wavepp.runtime.records.ID_RULE``): a string — ``7``, ``null`` or ``true`` is refused,
not turned into text. A UTF-8 byte-order mark at the start is skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from wavepp.ids import id_problem
from wavepp.workload.generators import MAX_DEADLINE_S, RequestSpec


def read_requests_file(
    path: str | Path, vocab: int
) -> tuple[list[RequestSpec], list[dict], list[tuple[str, float]]]:
    """Returns (requests, rejected lines as {line, id, error}, cancels as (id, after_s))."""
    specs: list[RequestSpec] = []
    rejected: list[dict] = []
    cancels: list[tuple[str, float]] = []
    seen: set[str] = set()
    with open(path, encoding="utf-8-sig") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            rid = None
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError("not a JSON object")
                if "cancel" in row:
                    target = row["cancel"]
                    if id_problem(target):
                        raise ValueError(f"'cancel': {id_problem(target)}")
                    after = float(row.get("after_s", 0.0))
                    if target not in seen:
                        raise ValueError(f"cancel of unknown request {target!r}")
                    if not 0 <= after < 1e6:
                        raise ValueError(f"after_s must be in [0, 1e6), got {after}")
                    cancels.append((target, after))
                    continue
                if "id" not in row:
                    raise ValueError("no 'id'")
                if id_problem(row["id"]):
                    raise ValueError(id_problem(row["id"]))
                rid = row["id"]
                tokens = row.get("tokens")
                if not isinstance(tokens, list) or not tokens:
                    raise ValueError("no tokens (need a non-empty list of token ids)")
                if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
                    raise ValueError("token ids must be integers")
                bad = [t for t in tokens if not 0 <= t < vocab]
                if bad:
                    raise ValueError(
                        f"{len(bad)} token ids outside the vocabulary 0..{vocab - 1}, e.g. {bad[0]}"
                    )
                if rid in seen:
                    raise ValueError(f"duplicate request id {rid!r}")
                warmup = row.get("warmup", False)
                if not isinstance(warmup, bool):
                    raise ValueError(f"'warmup' must be true or false, got {warmup!r}")
                handoff = row.get("handoff")
                if handoff is not None and not isinstance(handoff, bool | str):
                    raise ValueError(f"'handoff' must be true or an address, got {handoff!r}")
                deadline_s = row.get("deadline_s")
                if deadline_s is not None and (
                    not isinstance(deadline_s, int | float) or isinstance(deadline_s, bool)
                    or not 0 < deadline_s <= MAX_DEADLINE_S
                ):  # fmt: skip
                    raise ValueError(f"'deadline_s' must be seconds in (0, {MAX_DEADLINE_S:g}], "
                                     f"got {deadline_s!r}")
            except (ValueError, TypeError) as error:  # json.JSONDecodeError is a ValueError
                rejected.append({"line": number, "id": rid, "error": f"{path}:{number}: {error}"})
                continue
            seen.add(rid)
            specs.append(RequestSpec(rid, np.asarray(tokens, dtype=np.int32), warmup, 0,
                                     handoff=handoff, deadline_s=deadline_s))  # fmt: skip
    return specs, rejected, cancels
