"""Why a routed request reused less than one big cache would have: the causes, counted
(docs/fleet.md, *Why prefix routing lost reuse*). Pure functions over a replay's records.

For each request the *producer* is the earlier request of the trace that holds the
deepest prefix of its prompt (a conversation's previous turn, or any request for the
shared head) and *expected* what one unbounded cache reuses: that prefix in full blocks,
at most the prompt's tokens less one. A request that got less lost ``expected − got``
tokens, charged to one cause. With ``R`` the replica that answered the producer and ``C``
the one the router chose, and the router's knowledge of a replica = the most of
predicted (events), in flight and — for a policy that reads it — answered-not-yet-
confirmed:

- ``C ≠ R`` and the router knew more at ``R`` than at ``C``: **policy**, split by whether
  what it knew at ``R`` was under 30% of the prompt (``prefix``'s old cut: the replicas
  looked equal to it) or not (a load override, or a policy that ignores reuse);
- ``C ≠ R``, the router knew no more at ``R``, and the producer was not answered yet:
  **computing elsewhere**;
- ``C ≠ R`` and the events announced more at ``R`` than the hybrid's snapshot floor let
  the prediction count: **snapshot floor**;
- ``C ≠ R`` and the answered prompt was in the router's memory, not yet in the events:
  **events not yet arrived**;
- ``C ≠ R`` otherwise (neither events nor memory showed it): **evicted** at ``R``;
- ``C = R``: **computing here** (producer not answered yet), **admission** (the events
  announced it all: the replica granted less), **snapshot floor**, or **evicted**.

A view is the ``x-wavepp-route-views`` tuple (predicted, announced or None, in flight,
answered not yet confirmed, queued uncached tokens, requests in flight).
"""

from __future__ import annotations

from collections.abc import Sequence

CUT_SHARE = 0.3  # prefix's old cut: a match under this share of the prompt counted as none
CAUSES = ("policy: under 30% (looked equal)", "policy: load or no reuse", "computing elsewhere",
          "events not yet arrived", "snapshot floor", "evicted", "computing here",
          "admission", "no producer answer")  # fmt: skip


def producers(hash_lists: Sequence[Sequence[int]], num_tokens: Sequence[int],
              block_size: int) -> list[tuple[int | None, int]]:  # fmt: skip
    """Per request (trace order): (the earlier request holding the deepest prefix of it or
    None, expected reused tokens with one unbounded cache)."""
    latest: dict[int, int] = {}  # block hash -> the last request whose prompt had it
    out: list[tuple[int | None, int]] = []
    for i, hashes in enumerate(hash_lists):
        limit = max(num_tokens[i] - 1, 0) // block_size
        depth = 0
        while depth < min(limit, len(hashes)) and hashes[depth] in latest:
            depth += 1
        producer = latest[hashes[depth - 1]] if depth else None
        out.append((producer, depth * block_size))
        for h in hashes:
            latest[h] = i
    return out


def _known(view: Sequence[int | None] | None, reads_memory: bool) -> int:
    if view is None:
        return 0
    predicted, _, in_flight, answered = view[:4]
    return max(predicted or 0, in_flight or 0, (answered or 0) if reads_memory else 0)


def cause(record: dict, producer: dict | None, expected: int, reads_memory: bool) -> str | None:
    """The cause of one request's lost reuse (None: it lost none). ``record`` and
    ``producer`` are ``benchmarks._replay.Sent`` as dicts."""
    if expected <= record["cached_tokens"]:
        return None
    if producer is None or producer["status"] != "done":
        return "no producer answer"
    chosen, home = record["replica"], producer["replica"]
    views = record.get("views") or {}
    answered_before = (producer["answered_s"] is not None and record["sent_s"] is not None
                       and producer["answered_s"] <= record["sent_s"])  # fmt: skip
    at_home = views.get(home)
    if chosen == home:
        if not answered_before:
            return "computing here"
        if at_home is not None and (at_home[0] or 0) >= expected:
            return "admission"
        if at_home is not None and (at_home[1] or 0) >= expected:
            return "snapshot floor"
        return "evicted"
    known_home = _known(at_home, reads_memory)
    if known_home > _known(views.get(chosen), reads_memory):
        small = known_home < CUT_SHARE * record["num_tokens"]
        return "policy: under 30% (looked equal)" if small else "policy: load or no reuse"
    if not answered_before:
        return "computing elsewhere"
    if at_home is not None and (at_home[1] or 0) > (at_home[0] or 0):
        return "snapshot floor"
    if at_home is not None and (at_home[3] or 0) > (at_home[0] or 0):
        return "events not yet arrived"
    return "evicted"


def breakdown(records: Sequence[dict], expected: Sequence[tuple[int | None, int]],
              reads_memory: bool, head_tokens: int = 0) -> dict:  # fmt: skip
    """The replay's lost reuse by cause, and the chosen replica's prediction against what it
    granted. ``expected``: :func:`producers`' answer for the same requests; ``head_tokens``:
    the trace's shared head (views that all show at most it looked equal)."""
    done = [i for i, r in enumerate(records) if r["status"] == "done"]
    lost = dict.fromkeys(CAUSES, 0)
    count = dict.fromkeys(CAUSES, 0)
    exact = under = over = under_tokens = over_tokens = equal = moved = 0
    for i in done:
        record = records[i]
        producer_index, want = expected[i]
        producer = records[producer_index] if producer_index is not None else None
        why = cause(record, producer, want, reads_memory)
        if why is not None:
            lost[why] += want - record["cached_tokens"]
            count[why] += 1
        if producer is not None and producer["replica"] != record["replica"]:
            moved += 1
        views = record.get("views") or {}
        known = {_known(v, reads_memory) for v in views.values()}
        if want > head_tokens and len(known) == 1 and max(known) <= head_tokens:
            equal += 1
        predicted = record.get("predicted")
        if predicted is None:
            continue
        gap = record["cached_tokens"] - predicted
        exact += gap == 0
        under += gap > 0  # got more than predicted
        over += gap < 0
        under_tokens += max(gap, 0)
        over_tokens += max(-gap, 0)
    input_tokens = sum(records[i]["num_tokens"] for i in done)
    by_replica: dict[str, int] = {}
    for i in done:
        name = records[i]["replica"] or "-"
        by_replica[name] = by_replica.get(name, 0) + 1
    return {
        "requests": len(done),
        "input_tokens": input_tokens,
        "expected_tokens": sum(expected[i][1] for i in done),
        "cached_tokens": sum(records[i]["cached_tokens"] for i in done),
        "lost_tokens": lost,
        "lost_requests": count,
        "by_replica": by_replica,  # done requests each replica answered ("-": not routed)
        "moved_from_producer": moved,  # done requests not sent where their producer ran
        "looked_equal": equal,  # expected more than the head; every view the same, ≤ head
        "predicted_exact": exact,
        "predicted_under": under,  # the replica granted more than the header predicted
        "predicted_over": over,
        "predicted_under_tokens": under_tokens,
        "predicted_over_tokens": over_tokens,
    }
