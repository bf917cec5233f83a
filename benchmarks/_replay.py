"""Replaying a conversation trace through a router, one record per request: where the
router sent it, what it knew of every replica then (``--explain``'s header), what the
replica answered (``benchmarks.fleet``'s driver; docs/fleet.md).

Requests are sent open loop at their arrival times, with one rule a recorded trace cannot
keep by itself: a conversation's turn is never sent before the previous turn's answer (a
user reads the answer before writing the next message). A turn whose previous answer comes
late is sent when it comes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import anyio
import attrs
import httpx
import numpy as np

from wavepp.route.explain import CAUSES, breakdown, producers
from wavepp.state import block_hashes
from wavepp.stats import percentile

KEEPALIVE_S = 2.0  # the client keeps an idle connection this long (the server: 5 s)


@attrs.frozen
class Turn:
    """One request to replay."""

    request_id: str
    tokens: np.ndarray  # int32 token ids
    arrival_s: float  # due this many seconds after the replay starts
    after: int | None  # the index of the request it must follow (its previous turn)
    deadline_s: float | None = None  # sent as the body's deadline_s


@attrs.define
class Sent:
    """One request as the client saw it. Times are seconds after the replay started."""

    num_tokens: int
    status: str = "unsent"  # the answer's status (done, ...), or error / http-<code>
    replica: str | None = None  # x-wavepp-replica
    predicted: int | None = None  # x-wavepp-predicted-cached-tokens
    views: dict[str, tuple[int | None, ...]] | None = None  # x-wavepp-route-views, parsed
    cached_tokens: int = 0
    sent_s: float | None = None
    answered_s: float | None = None
    deadline_met: bool | None = None
    queued_s: float | None = None  # the replica's submission to admission (its timings)
    server_s: float | None = None  # the replica's submission to result

    @property
    def latency_s(self) -> float | None:
        if self.sent_s is None or self.answered_s is None:
            return None
        return self.answered_s - self.sent_s


def parse_views(header: str | None) -> dict[str, tuple[int | None, ...]] | None:
    """``x-wavepp-route-views`` as {replica: (predicted, announced or None, in flight,
    answered not yet confirmed, queued uncached tokens, requests in flight)}."""
    if not header:
        return None
    out = {}
    for part in header.split(";"):
        name, _, fields = part.partition("=")
        out[name] = tuple(None if f == "-" else int(f) for f in fields.split("/"))
    return out


async def _send(client: httpx.AsyncClient, turn: Turn, sent: Sent, start: float) -> None:
    body: dict = {"tokens": turn.tokens.tolist(), "id": turn.request_id}
    if turn.deadline_s is not None:
        body["deadline_s"] = turn.deadline_s
    sent.sent_s = time.monotonic() - start
    try:
        reply = await client.post("/v1/prefill", json=body)
    except httpx.HTTPError as error:
        sent.status = f"error: {type(error).__name__}"
        sent.answered_s = time.monotonic() - start
        return
    sent.answered_s = time.monotonic() - start
    sent.replica = reply.headers.get("x-wavepp-replica")
    predicted = reply.headers.get("x-wavepp-predicted-cached-tokens")
    sent.predicted = int(predicted) if predicted is not None else None
    sent.views = parse_views(reply.headers.get("x-wavepp-route-views"))
    try:
        data = reply.json()
    except ValueError:
        sent.status = f"http-{reply.status_code}"
        return
    result = data.get("wavepp", data) if isinstance(data, dict) else {}
    if reply.status_code != 200 or "status" not in result:
        sent.status = f"http-{reply.status_code}"
        return
    sent.status = str(result["status"])
    sent.cached_tokens = int(result.get("cached_tokens") or 0)
    sent.deadline_met = result.get("deadline_met")
    timings = result.get("timings") or {}
    sent.queued_s, sent.server_s = timings.get("queued_s"), timings.get("total_s")


async def replay(url: str, turns: Sequence[Turn], timeout_s: float = 600.0) -> list[Sent]:
    """Send ``turns`` to ``url`` (a router or one server), each at its arrival time and not
    before the answer to the turn it follows; one record per turn, in the same order."""
    records = [Sent(len(t.tokens)) for t in turns]
    answered = [anyio.Event() for _ in turns]
    # idle connections are dropped before the server's keep-alive timeout (uvicorn's 5 s)
    # closes them under a request being sent: a ReadError the request never recovers from
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=512,
                          keepalive_expiry=KEEPALIVE_S)  # fmt: skip
    timeout = httpx.Timeout(timeout_s, connect=30.0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        start = time.monotonic()

        async def one(i: int) -> None:
            turn = turns[i]
            try:
                delay = turn.arrival_s - (time.monotonic() - start)
                if delay > 0:
                    await anyio.sleep(delay)
                if turn.after is not None:
                    await answered[turn.after].wait()
                await _send(client, turn, records[i], start)
            finally:
                answered[i].set()

        async with anyio.create_task_group() as tg:
            for i in sorted(range(len(turns)), key=lambda i: turns[i].arrival_s):
                tg.start_soon(one, i)
    return records


def summarize(records: Sequence[Sent], time_scale: float = 1.0) -> dict:
    """Throughput (prompt tokens done per second, first send to last answer), reuse and
    completion times of a replay; seconds divided by ``time_scale`` (a sim's real seconds
    per simulated second)."""
    done = [r for r in records if r.status == "done"]
    by_status: dict[str, int] = {}
    for r in records:
        by_status[r.status] = by_status.get(r.status, 0) + 1
    if not done:
        return {"done": 0, "by_status": by_status}
    first = min(r.sent_s for r in records if r.sent_s is not None)
    span = (max(r.answered_s for r in done) - first) / time_scale
    tokens = sum(r.num_tokens for r in done)
    latencies = [r.latency_s / time_scale for r in done]
    met = [r.deadline_met for r in records if r.deadline_met is not None]
    return {
        "done": len(done),
        "by_status": by_status,
        "input_tokens": tokens,
        "cached_tokens": sum(r.cached_tokens for r in done),
        "reused_share": sum(r.cached_tokens for r in done) / tokens,
        "throughput_tok_s": tokens / max(span, 1e-9),
        "makespan_s": span,
        "completion_p50_s": percentile(latencies, 50),
        "completion_p99_s": percentile(latencies, 99),
        "completion_mean_s": sum(latencies) / len(latencies),
        "server_slo_attainment": sum(met) / len(met) if met else None,
    }


def turns_at(token_lists: Sequence[np.ndarray], arrivals_s: Sequence[float],
             after: Sequence[int | None], offered_tok_s: float, time_scale: float = 1.0,
             prefix: str = "") -> tuple[list[Turn], float]:  # fmt: skip
    """A trace's requests as turns, its arrival times (trace seconds) compressed so that
    prompt tokens arrive at ``offered_tok_s`` a second on average, then multiplied by
    ``time_scale`` (a sim's real seconds per simulated second); and the compression
    (trace seconds per replayed second)."""
    tokens = sum(len(t) for t in token_lists)
    span = max(max(arrivals_s) - min(arrivals_s), 1e-9)
    speed = offered_tok_s / (tokens / span)
    start = min(arrivals_s)
    turns = [Turn(f"{prefix}{i}", t, (a - start) / speed * time_scale, b)
             for i, (t, a, b) in enumerate(zip(token_lists, arrivals_s, after, strict=True))]
    return turns, speed


def session_line(row: dict) -> str:
    """One replayed run as a log line (``benchmarks.fleet``)."""
    why = row["why"]
    return (f"{row['workload']:<8} seed {row['seed']} N={row['replicas']} {row['policy']:<13} "
            f"load {row['load']:.2f}: {row.get('throughput_tok_s', 0):>9,.0f} tok/s, reused "
            f"{100 * row.get('reused_share', 0):5.1f}% of {100 * row['expected_share']:.1f}%, "
            f"p50/p99 {row.get('completion_p50_s', 0):.2f}/{row.get('completion_p99_s', 0):.2f}"
            f" s, moved {why['moved_from_producer']}/{why['requests']}")


def session_table(record: dict) -> str:
    """The replayed runs of a ``benchmarks.fleet`` record as a table."""
    setup = record["setup"]
    kind = "SIMULATED" if record["simulated"] else "torch executor"
    lines = [f"WavePP fleet, conversation traces — {kind} ({setup['model']}, P = "
             f"{setup['stages']}; throughput and times in {'simulated ' * record['simulated']}s)",
             "workload seed N  policy         load  tok/s      reused  ideal   p50 s  p99 s"]
    for r in record["rows"]:
        if "seed" not in r:
            continue
        lines.append(f"{r['workload']:<8} {r['seed']:>4} {r['replicas']}  {r['policy']:<13} "
                     f"{r['load']:4.2f}  {r.get('throughput_tok_s', 0):>9,.0f}  "
                     f"{100 * r.get('reused_share', 0):5.1f}%  {100 * r['expected_share']:5.1f}%"
                     f"  {r.get('completion_p50_s', 0):5.2f}  {r.get('completion_p99_s', 0):5.2f}")
    return "\n".join(lines)


def measure(url: str, token_lists: Sequence[np.ndarray], arrivals_s: Sequence[float],
            after: Sequence[int | None], offered_tok_s: float, time_scale: float,
            block_size: int, prefix: str = "", reads_memory: bool = False,
            head_tokens: int = 0) -> dict:  # fmt: skip
    """One replay (:func:`turns_at`, :func:`replay`) summarized (:func:`summarize`) and
    explained (:func:`wavepp.route.explain.breakdown`), with every request's record."""
    hashes = [block_hashes(t, block_size) for t in token_lists]
    expected = producers(hashes, [len(t) for t in token_lists], block_size)
    turns, speed = turns_at(token_lists, arrivals_s, after, offered_tok_s, time_scale, prefix)
    sent = anyio.run(replay, url, turns)
    records = [attrs.asdict(r) for r in sent]
    return {"trace_speed": speed, **summarize(sent, time_scale),
            "expected_share": sum(e for _, e in expected) / sum(len(t) for t in token_lists),
            "why": breakdown(records, expected, reads_memory, head_tokens),
            "records": records}  # fmt: skip


def why_table(record: dict) -> str:
    """Per replayed run: reused against ideal, and the ideal's lost tokens by cause (each a
    share of the ideal's reused tokens), the requests sent away from their producer's
    replica, the busiest replica's share of the requests, and how often the chosen
    replica's predicted cached tokens were exact / under / over what it granted."""
    short = ("cut<30%", "load", "comp.else", "events", "snap.floor", "evicted", "comp.here",
             "admission", "no-answer")  # CAUSES, in order
    lines = ["workload seed policy        load  got/ideal " + " ".join(
        f"{name:>10}" for name in short) + "  moved busiest  pred =/</>"]  # fmt: skip
    for r in record["rows"]:
        why = r.get("why")
        if not why:
            continue
        ideal = max(why["expected_tokens"], 1)
        lost = " ".join(f"{100 * why['lost_tokens'][c] / ideal:9.1f}%" for c in CAUSES)
        by = why.get("by_replica") or {"-": 1}
        busiest = max(by.values()) / max(sum(by.values()), 1)
        lines.append(f"{r['workload']:<8} {r['seed']:>4} {r['policy']:<13} {r['load']:4.1f}  "
                     f"{100 * why['cached_tokens'] / ideal:8.1f}%  {lost}  "
                     f"{why['moved_from_producer']:>5} {100 * busiest:6.0f}%  "
                     f"{why['predicted_exact']}/{why['predicted_under']}/"
                     f"{why['predicted_over']}")  # fmt: skip
    return "\n".join(lines)


def goal_table(record: dict, policy: str = "prefix") -> str:
    """Issue 58's goals per trace: ``policy``'s reused share against the big pipeline's
    (≥ 90%), its throughput against round-robin's (≥ 1.3×), its p99 completion against
    least-load's (no worse)."""
    runs = {(r["workload"], r["seed"], r["replicas"], r["load"], r["policy"]): r
            for r in record["rows"] if "seed" in r and r.get("done")}  # fmt: skip
    lines = [f"workload seed N  load  {policy}: reused/big  tok/s / round-robin  "
             "p99 s / least-load"]
    for (workload, seed, n, load, name), row in sorted(runs.items()):
        if name != policy:
            continue
        big, rr, ll = (runs.get((workload, seed, n, load, p)) for p in
                       ("big", "round-robin", "least-load"))  # fmt: skip
        reuse = f"{row['reused_share'] / big['reused_share']:7.1%}" if big else "    n/a"
        speed = f"{row['throughput_tok_s'] / rr['throughput_tok_s']:6.2f}x" if rr else "   n/a"
        tail = (f"{row['completion_p99_s']:5.2f} / {ll['completion_p99_s']:5.2f}" if ll
                else "  n/a")  # fmt: skip
        lines.append(f"{workload:<8} {seed:>4} {n}  {load:4.1f}  {reuse:>19}  {speed:>20}  "
                     f"{tail:>18}")
    return "\n".join(lines)
