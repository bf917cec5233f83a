"""Admission hot path under load (issue 9): round time and rank 0's CPU per round.

A simulated 4-stage run at concurrency 256 whose pool holds about 192 of the 2,048-token
prompts, so about 64 requests wait at any time and every materialization evicts: the
figures are the admission round's wall time p50 / p99 and rank 0's process CPU time
during a round, from the run's own record. ``--dry-run`` prints the command.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks._stats import emit

COMMAND = ["--executor", "sim", "--workload", "cold", "--prompt-tokens", "2048",
           "--block-size", "64", "--requests", "1024", "--concurrency", "256",
           "--capacity-blocks", "6144", "--rung", "R4", "--time-scale", "0.2",
           "--no-progress"]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.admission", description=__doc__)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--dry-run", action="store_true", help="print the torchrun command only")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={args.stages}", "-m", "wavepp.main", *COMMAND,
               "--json", str(out)]  # fmt: skip
        if args.dry_run:
            print(" ".join(cmd))
            return
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        record = json.loads(out.read_text())
    keys = ("admission_p50_ms", "admission_p99_ms", "admission_cpu_p50_ms",
            "admission_cpu_p99_ms", "admission_rounds", "throughput_tok_s")  # fmt: skip
    figures = {k: record.get(k) for k in keys}
    figures["simulated"] = record["simulated"]
    figures["command"] = " ".join(["torchrun", f"--nproc-per-node {args.stages}",
                                   "-m wavepp.main", *COMMAND])  # fmt: skip
    emit(figures, args.json)


if __name__ == "__main__":
    main()
