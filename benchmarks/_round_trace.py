"""Reading a run's round traces (``wavepp.rounds.trace``): where a round's time goes.

Every rank's marks carry the round's broadcast number and the host's monotonic clock,
so one round's steps on every rank line up. :func:`breakdown` turns them into the
round's steps, p50 / p90 / p99 in µs over the rounds:

- on rank 0, its own steps in order (choosing the offers, its anchors and the message,
  writing the broadcast, its probes and leases, the wait for the peers' MIN frames, the
  reply, settling, the escrow flags' MIN, commit, applying the outcome);
- on the peers, the slowest of them in each step: waking up to the broadcast (from the
  moment rank 0 had encoded it), decoding it, their probes and leases, writing their
  frame, and waking up to rank 0's reply;
- the critical path: the MIN's wait on rank 0 is the slowest peer's wake-up and work
  less rank 0's own work meanwhile.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks._stats import percentile

# (label, rank-0 step it ends at, rank-0 step it starts at)
_RANK0 = (
    ("rank 0: choose offers", "anchors", "offers"),
    ("rank 0: anchors + encode", "encoded", "anchors"),
    ("rank 0: write broadcast", "bcast_sent", "encoded"),
    ("rank 0: probe + lease + masks", "leased", "start"),
    ("rank 0: settle at its guess", "guessed", "leased"),
    ("rank 0: agreement's results, AND windows", "min_done", "reduced"),
    ("rank 0: settle (or adopt its guess's)", "settled", "min_done"),
    ("rank 0: escrow flags' own MIN", "flags_done", "settled"),
    ("rank 0: cut + commit + counters", "end", "flags_done"),
    ("rank 0: apply (register, plan)", "applied", "end"),
)


def load(directory: str | Path) -> dict[int, dict[int, dict[str, list[int]]]]:
    """rank -> broadcast number -> step -> its marks (ns), from ``rank-<r>.json``."""
    ranks: dict[int, dict[int, dict[str, list[int]]]] = {}
    for path in sorted(Path(directory).glob("rank-*.json")):
        data = json.loads(path.read_text())
        steps, rounds = data["steps"], {}
        for seq, code, ns in data["marks"]:
            rounds.setdefault(seq, {}).setdefault(steps[code], []).append(ns)
        ranks[int(data["rank"])] = rounds
    return ranks


def _one(marks: dict[str, list[int]], step: str, k: int = 0) -> int | None:
    got = marks.get(step, [])
    return got[k] if len(got) > k else None


def breakdown(directory: str | Path, skip: int = 5) -> dict:
    """``steps_us``: per step, ``{"p50", "p90", "p99", "n"}`` in µs over the traced rounds
    (the first ``skip`` left out: the plane's first use); ``rounds_by_collectives``: how
    many rounds ran 1, 2, … reductions after their broadcast (the agreement, AND windows,
    the escrow flags' own MIN)."""
    ranks = load(directory)
    zero, peers = ranks.get(0, {}), sorted(r for r in ranks if r)
    rows: dict[str, list[float]] = {}
    collectives: dict[int, int] = {}  # reductions after the broadcast -> rounds
    resettled: dict[int, int] = {}  # rank -> rounds it settled twice

    def add(label: str, end: int | None, start: int | None) -> None:
        if end is not None and start is not None:
            rows.setdefault(label, []).append((end - start) / 1e3)

    seqs = sorted(s for s, m in zero.items() if "start" in m and "end" in m)[skip:]
    for seq in seqs:
        m0 = zero[seq]
        add("round (rank 0's run_round)", _one(m0, "end"), _one(m0, "start"))
        add("round + broadcast + apply (rank 0)", _one(m0, "applied"), _one(m0, "offers"))
        for label, end, start in _RANK0:
            add(label, _one(m0, end), _one(m0, start))
        last_in = _one(m0, "peer_in", len(peers) - 1)
        ready0 = _one(m0, "guessed") or _one(m0, "leased")
        add("rank 0: waits for the peers' agreement frames", last_in, ready0)
        if peers:  # reductions in the round: the agreement, AND windows, the flags' MIN
            k = len(m0.get("peer_in", [])) // len(peers)
            collectives[k] = collectives.get(k, 0) + 1
        for r, rounds in ranks.items():  # a guess settled, then settled again
            resettled[r] = resettled.get(r, 0) + ("resettled" in rounds.get(seq, {}))
        add("rank 0: combine + write the reply", _one(m0, "reduced"), last_in)
        encoded, reduced = _one(m0, "encoded"), _one(m0, "reduced")
        slowest: dict[str, float] = {}
        for r in peers:
            m = ranks[r].get(seq, {})
            b, s, le, sent = (_one(m, k) for k in ("bcast_recv", "start", "leased", "sent"))
            back, gu = _one(m, "reduced_recv"), _one(m, "guessed") or le
            for label, end, start in (
                ("peers: wake to the broadcast (from encoded)", b, encoded),
                ("peers: decode + offers", s, b),
                ("peers: probe + lease + masks", le, s),
                ("peers: settle at their guess", gu, le),
                ("peers: write agreement frame", sent, gu),
                ("peers: frame ready (from encoded)", sent, encoded),
                ("peers: wake to the reply", back, reduced),
            ):
                if end is not None and start is not None:
                    slowest[label] = max(slowest.get(label, 0.0), (end - start) / 1e3)
            if b is not None and encoded is not None:
                rows.setdefault("each peer: wake to the broadcast", []).append((b - encoded) / 1e3)
        for label, value in slowest.items():
            rows.setdefault(label + ", slowest", []).append(value)
    steps = {}
    for label, values in rows.items():
        steps[label] = {q: round(percentile(values, int(q[1:])), 1) for q in ("p50", "p90", "p99")}
        steps[label]["n"] = len(values)
    return {"steps_us": steps, "rounds_by_collectives": dict(sorted(collectives.items())),
            "rounds_resettled_by_rank": [resettled.get(r, 0) for r in sorted(ranks)],
            "rounds": len(seqs)}  # fmt: skip


def table(figures: dict) -> str:
    """:func:`breakdown` as aligned text, one step a line."""
    steps, lines = figures["steps_us"], []
    for label in sorted(steps, key=lambda k: (not k.startswith("round"), k)):
        s = steps[label]
        lines.append(f"  {label:48s} p50 {s['p50']:9.1f}  p90 {s['p90']:9.1f}  "
                     f"p99 {s['p99']:9.1f} µs  (n={s['n']})")  # fmt: skip
    lines.append(f"  rounds by reductions after the broadcast: {figures['rounds_by_collectives']}; "
                 f"settled twice, by rank: {figures['rounds_resettled_by_rank']} "
                 f"of {figures['rounds']}")  # fmt: skip
    return "\n".join(lines)
