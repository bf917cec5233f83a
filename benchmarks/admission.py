"""Admission hot path (issues 9 and 60): a round's wall time, where it goes, and the
host's round trip it is judged against.

- default: a simulated 4-stage run at concurrency 256 whose pool holds about 192 of the
  2,048-token prompts, so about 64 requests wait at any time and every materialization
  evicts;
- ``--light``: the ``seeded-8k`` smoke cell (4 stages, sim, 192 requests of 8,192 tokens
  on shared prefixes, concurrency 16), where every stage has room;
- ``--rtt``: the host's round trips only (``benchmarks._rtt``): a ping-pong between two
  processes, raw and in event loops, the rounds plane's two-rank MIN, a round's
  skeleton on every rank, and Gloo's.

A run's figures come from its record — the admission round's wall time p50 / p99 (rank
0's ``run_round``, the broadcast before it not included) and rank 0's CPU in the
round's own steps — and from its round trace (``WAVEPP_ROUND_TRACE``, every rank's
steps on one clock: ``benchmarks._round_trace``), each step's p50 / p90 / p99. Every
measurement carries the load average and the CPU steal over its span. ``--dry-run``
prints the command.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._round_trace import breakdown, table
from benchmarks._stats import emit

COMMAND = ["--executor", "sim", "--workload", "cold", "--prompt-tokens", "2048",
           "--block-size", "64", "--requests", "1024", "--concurrency", "256",
           "--capacity-blocks", "6144", "--rung", "R4", "--time-scale", "0.2",
           "--no-progress"]  # fmt: skip
LIGHT = ["--executor", "sim", "--workload", "seeded", "--prompt-tokens", "8192",
         "--requests", "192", "--concurrency", "16", "--rung", "R4", "--no-progress"]  # fmt: skip
KEYS = ("admission_p50_ms", "admission_p99_ms", "admission_cpu_p50_ms", "admission_cpu_p99_ms",
        "admission_rounds", "throughput_tok_s")  # fmt: skip


class Machine:
    """The load average and the CPU steal (from /proc/stat) over a measurement."""

    def __init__(self) -> None:
        self.start = self._stat()

    @staticmethod
    def _stat() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        return sum(fields), fields[7] if len(fields) > 7 else 0

    def figures(self) -> dict:
        total, steal = self._stat()
        with open("/proc/loadavg") as f:
            load = [float(v) for v in f.read().split()[:3]]
        spent = max(total - self.start[0], 1)
        return {"load_1_5_15": load, "steal_pct": round(100 * (steal - self.start[1]) / spent, 2)}


def run_once(args: list[str], stages: int) -> dict:
    """One traced run: its record's figures, its round breakdown, the machine's load."""
    with tempfile.TemporaryDirectory(prefix="wavepp-admission-") as tmp:
        out, trace = Path(tmp) / "run.json", Path(tmp) / "trace"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={stages}", "-m", "wavepp.main", *args,
               "--json", str(out)]  # fmt: skip
        env = {**os.environ, "WAVEPP_ROUND_TRACE": str(trace)}
        machine, t0 = Machine(), time.monotonic()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
        record = json.loads(out.read_text())
        figures = {k: record.get(k) for k in KEYS}
        figures["simulated"] = record["simulated"]
        figures["wall_s"] = round(time.monotonic() - t0, 1)
        figures["machine"] = machine.figures()
        figures["round_trace"] = breakdown(trace) if trace.exists() else None
    return figures


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.admission", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--light", action="store_true", help="the seeded-8k smoke cell instead")
    p.add_argument("--rtt", action="store_true", help="the host's round trips only")
    p.add_argument("--iterations", type=int, default=4000, help="of each --rtt figure")
    p.add_argument("--repeats", type=int, default=1, help="runs, one after the other")
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--dry-run", action="store_true", help="print the torchrun command only")
    args = p.parse_args(argv)
    run_args = LIGHT if args.light else COMMAND
    command = " ".join(["torchrun", f"--nproc-per-node {args.stages}", "-m wavepp.main",
                        *run_args])  # fmt: skip
    if args.dry_run:
        print(command)
        return
    if args.rtt:
        from benchmarks._rtt import measure

        machine = Machine()
        figures = {"round_trips_us": measure(args.stages, args.iterations),
                   "machine": machine.figures(), "stages": args.stages}  # fmt: skip
        emit(figures, args.json)
        return
    runs = []
    for _ in range(args.repeats):
        runs.append(run_once(run_args, args.stages))
        if runs[-1]["round_trace"] is not None:
            print(table(runs[-1]["round_trace"]), file=sys.stderr)
    figures = {"command": command, "cell": "light" if args.light else "evicting", "runs": runs}
    emit(figures, args.json)


if __name__ == "__main__":
    main()
