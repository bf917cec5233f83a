"""One JSON record per run (DESIGN §7) and its readable table."""

from __future__ import annotations

from collections.abc import Sequence

from wavepp.rounds.messages import StageReport
from wavepp.stats import percentile


def _p(values: Sequence[float], q: float) -> float | None:
    return percentile(values, q) if values else None


def _reasons(measured: Sequence) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in measured:
        reason = "cancelled" if r.cancelled and r.spec.expected_reuse else r.miss_reason
        if reason and r.spec.expected_reuse:
            counts[reason] = counts.get(reason, 0) + 1
    return counts


def _deadline_met(record) -> bool | None:
    met = getattr(record, "deadline_met", None)
    return met() if callable(met) else None


def summarize(
    records: Sequence, reports: Sequence[StageReport], *, measure_start: float,
    measure_end: float, round_seconds: Sequence[float], time_scale: float, simulated: bool,
    config: dict, round_cpu_s: Sequence[float] = (), num_rounds: int | None = None,
) -> dict:  # fmt: skip
    """Figures in simulated seconds where the executor is simulated (real / time_scale).
    ``round_seconds``: the recent rounds' times, of ``num_rounds`` (default: as many)."""
    measured = [r for r in records if not r.spec.warmup]
    ok = [r for r in measured if r.error is None and r.done_at is not None]
    unfinished = [r for r in measured if r.done_at is None]  # an interrupted run
    wall = max(measure_end - measure_start, 1e-9)
    span = wall / time_scale
    tokens = sum(r.spec.num_tokens for r in ok)
    completion = [(r.done_at - r.released_at) / time_scale for r in ok]
    queued = [(r.admitted_at - r.released_at) / time_scale for r in ok]
    expecting = [r for r in ok if r.spec.expected_reuse > 0]
    good = [r for r in expecting if r.cached_tokens >= 0.8 * r.spec.expected_reuse]
    utilization = [min(1.0, rep.busy_s / wall) for rep in reports]
    probes = [us for rep in reports for us in rep.probe_us]
    timed = [r for r in measured if _deadline_met(r) is not None]
    met = sum(1 for r in timed if _deadline_met(r))
    return {
        "simulated": simulated,
        "rung": config["rung"],
        "workload": config["workload"],
        "concurrency": config["concurrency"],
        "stages": len(reports),
        "throughput_tok_s": tokens / span,
        "completion_p50_s": _p(completion, 50),
        "completion_p99_s": _p(completion, 99),
        "queue_p50_s": _p(queued, 50),
        "good_hit_rate": len(good) / len(expecting) if expecting else None,
        # SLO attainment: measured requests done by their deadline / those with one
        # (cancelled, failed and unfinished ones count as missed, rejected ones not at all)
        "slo_attainment": met / len(timed) if timed else None,
        "deadline_requests": len(timed),
        "deadlines_met": met,
        "miss_reasons": _reasons(measured),
        "reused_share": sum(r.cached_tokens for r in ok) / tokens if tokens else 0.0,
        # what a perfect cache of unbounded size would reuse of the same requests
        "ideal_reused_share": sum(r.spec.expected_reuse for r in ok) / tokens if tokens else 0.0,
        "stage_utilization": utilization,
        "stage_waves": [rep.num_waves for rep in reports],  # measured waves each stage ran
        "bubble_share": [1.0 - u for u in utilization],
        "probe_p50_us": _p(probes, 50),
        "probe_p99_us": _p(probes, 99),
        "admission_p50_ms": (_p(round_seconds, 50) or 0.0) * 1e3 if round_seconds else None,
        "admission_p99_ms": (_p(round_seconds, 99) or 0.0) * 1e3 if round_seconds else None,
        "admission_cpu_p50_ms": _p(round_cpu_s, 50) * 1e3 if round_cpu_s else None,
        "admission_cpu_p99_ms": _p(round_cpu_s, 99) * 1e3 if round_cpu_s else None,
        "admission_rounds": len(round_seconds) if num_rounds is None else num_rounds,
        "makespan_s": span,
        "measured_requests": len(measured),
        # how the measured requests that did not finish ended, each counted once
        "rejected_requests": sum(1 for r in measured if r.status == "rejected"),
        "failed_requests": sum(1 for r in measured if r.status == "failed"),
        "cancelled_requests": sum(1 for r in measured if r.status == "cancelled"),
        "unfinished_requests": len(unfinished),  # interrupted: never ended
        # warm-up requests that did not complete (rejected, cancelled, failed, unfinished)
        "warmup_not_done": sum(1 for r in records if r.spec.warmup and r.status != "done"),
        "input_tokens": tokens,
        "leak_check": [
            {
                "stage": rep.stage,
                "leases": rep.leases,
                "escrowed": rep.escrowed,
                "referenced": rep.referenced,
                "pending": rep.pending,
                "cached": rep.cached,
                "free": rep.free,
                "capacity": rep.capacity,
                "snapshots": rep.snapshots,
                "snapshot_pending": rep.snapshot_pending,
                "snapshot_pinned": rep.snapshot_pinned,
                "snapshot_capacity": rep.snapshot_capacity,
                "kv_bytes": rep.kv_bytes,
                "snapshot_bytes": rep.snapshot_bytes,
                "balanced": rep.balanced,
            }
            for rep in reports
        ],
        "requests": [
            {
                "id": r.spec.request_id,
                "num_tokens": r.spec.num_tokens,
                "cached_tokens": r.cached_tokens,
                "expected_reuse": r.spec.expected_reuse,
                "miss_reason": "cancelled" if r.cancelled and r.spec.expected_reuse
                else getattr(r, "miss_reason", None),
                "first_token": r.first_token,
                "top_logit": r.top_logit,
                "completion_s": None
                if r.done_at is None or r.error
                else (r.done_at - r.released_at) / time_scale,
                "status": getattr(r, "status", None),
                "error": r.error,
                **({"deadline_s": r.spec.deadline_s, "deadline_met": _deadline_met(r)}
                   if getattr(r.spec, "deadline_s", None) is not None else {}),
                **({"handoff": r.handoff_summary()}
                   if getattr(getattr(r, "offer", None), "handoff", "") else {}),
            }
            for r in measured
        ],
        "config": config,
    }


def table(record: dict) -> str:
    cfg = record["config"]
    kind = (
        f"SIMULATED — sim executor, {cfg['model']} on {cfg.get('sim_device', cfg.get('device'))}"
        + (f" (TP {cfg['sim_tp']} per stage)" if cfg.get("sim_tp", 1) > 1 else "")
        if record["simulated"]
        else f"real model (torch executor, {cfg['model']}"
        + (f", TP {cfg['tp']} ranks per stage)" if cfg.get("tp", 1) > 1 else ")")
    )

    def fmt(value, unit="", scale=1.0, digits=2):
        return "n/a" if value is None else f"{value * scale:,.{digits}f}{unit}"

    lines = [
        f"WavePP run — {kind}",
        f"  rung {record['rung']}, {record['stages']} stages, workload {record['workload']}, "
        f"{record['measured_requests']} requests at concurrency {record['concurrency']}",
        f"  throughput          {fmt(record['throughput_tok_s'], ' tok/s', digits=0)}"
        f"   (input tokens incl. cached / makespan {fmt(record['makespan_s'], ' s')})",
        f"  completion p50/p99  {fmt(record['completion_p50_s'], ' s')} / "
        f"{fmt(record['completion_p99_s'], ' s')}",
        f"  good-hit rate       {fmt(record['good_hit_rate'], '%', 100, 1)}"
        f"   reused share {fmt(record['reused_share'], '%', 100, 1)}"
        f" (ideal {fmt(record['ideal_reused_share'], '%', 100, 1)})",
        *([f"  SLO attainment      {fmt(record['slo_attainment'], '%', 100, 1)}"
           f"   ({record['deadlines_met']} of {record['deadline_requests']} requests with a "
           "deadline done by it)"] if record.get("deadline_requests") else []),
        f"  admission p50       {fmt(record['admission_p50_ms'], ' ms')} over "
        f"{record['admission_rounds']} rounds   probe p50/p99 {fmt(record['probe_p50_us'], ' us')}"
        f" / {fmt(record['probe_p99_us'], ' us')}",
        "  stage  utilization  leases  escrowed  referenced  cached/capacity  balanced",
    ]
    for util, leak in zip(record["stage_utilization"], record["leak_check"], strict=True):
        lines.append(
            f"  {leak['stage']:>5}  {util:>11.3f}  {leak['leases']:>6}  {leak['escrowed']:>8}  "
            f"{leak['referenced']:>10}  {leak['cached']:>7}/{leak['capacity']:<7}  "
            f"{'yes' if leak['balanced'] else 'NO'}"
        )
    counters = record.get("admission_counters")
    if counters is not None:
        lines.append(f"  agreement           {counters['disagreements']} disagreements, "
                     f"{counters['rollbacks']} roll-backs, {counters['fallbacks']} mask "
                     "fallbacks (admitted requests)")  # fmt: skip
        lines.append("                      (not errors: a disagreement is a round where some "
                     "stage cached less of a prefix than another, so the stages agreed on "
                     "the shorter one; the count follows timing and varies between runs)")
    steal = record.get("cpu_steal_share")
    if steal is not None and not record["simulated"]:
        lines.append(f"  CPU steal           {steal:.1%} of this machine's CPU time went to other "
                     "guests while the requests ran (throughput falls with it: compare runs "
                     "beside it)")  # fmt: skip
    if record.get("miss_reasons"):
        why = ", ".join(f"{n} {reason}" for reason, n in sorted(record["miss_reasons"].items()))
        lines.append(f"  missed reuse        {why}")
    if record.get("interrupted"):
        lines.append(f"  INTERRUPTED by {record['interrupted']}: "
                     f"{record['unfinished_requests']} requests unfinished; the leak check "
                     "shows what rank 0's stage still held")  # fmt: skip
    for key, words in (("rejected_requests", "rejected at submission (bad input)"),
                       ("failed_requests", "failed while running"),
                       ("cancelled_requests", "cancelled"),
                       ("unfinished_requests", "interrupted (never ended)")):  # fmt: skip
        if record.get(key):
            lines.append(f"  {words}: {record[key]} (see 'requests' in the JSON)")
    return "\n".join(lines)
