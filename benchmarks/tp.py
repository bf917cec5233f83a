"""What tensor parallelism inside a stage costs on this machine:
``python -m benchmarks.tp --json out.json``.

The same workload on the same number of ranks, run as TP x PP (``--tp T``, stages =
ranks / T) and as a plain pipeline of as many stages as ranks, interleaved ``--repeats``
times (options it does not know go to both runs: ``--device cuda``, ``--dtype``, ...);
prints each run's throughput and the ratio of the medians, and checks that the
first tokens are equal on every request. On a CPU the layers' all-reduces go over Gloo
(through the kernel's loopback), and ranks share the cores: this measures the runtime's
overhead of TP on this host, not what TP buys on GPUs (where a stage's band may not fit
one device at all).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks._stats import emit, percentile


def _run(out: Path, ranks: int, options: list[str]) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={ranks}", "-m", "wavepp.main", "--no-progress", "--json",
           str(out), *options]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"benchmarks.tp: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default="tiny-kimi")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--json", metavar="PATH")
    args, passed = p.parse_known_args(argv)  # the rest goes to wavepp.main (e.g. --device)
    if args.ranks % args.tp:
        raise SystemExit(f"--tp {args.tp} does not divide --ranks {args.ranks}")
    common = ["--model", args.model, "--requests", str(args.requests), "--prompt-tokens",
              str(args.prompt_tokens), *passed]  # fmt: skip
    shapes = {"tp": ["--tp", str(args.tp)], "pp": []}
    runs: dict[str, list[float]] = {name: [] for name in shapes}
    firsts: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as name:
        for repeat in range(args.repeats):
            for shape, extra in shapes.items():
                record = _run(Path(name) / f"{shape}-{repeat}.json", args.ranks, common + extra)
                runs[shape].append(record["throughput_tok_s"])
                firsts.setdefault(shape, {r["id"]: r["first_token"] for r in record["requests"]})
                print(f"  {shape} run {repeat + 1}: {record['throughput_tok_s']:,.0f} tok/s",
                      file=sys.stderr, flush=True)  # fmt: skip
    median = {shape: percentile(values, 50) for shape, values in runs.items()}
    stages = args.ranks // args.tp
    result = {
        "benchmark": "tp", "ranks": args.ranks, "model": args.model,
        "workload": f"seeded, {args.requests} requests of {args.prompt_tokens} tokens",
        "command": " ".join(["python -m benchmarks.tp", "--ranks", str(args.ranks), "--tp",
                             str(args.tp), "--repeats", str(args.repeats), "--model",
                             args.model, *passed]),
        f"tp{args.tp}_pp{stages}_tok_s": runs["tp"], f"pp{args.ranks}_tok_s": runs["pp"],
        "ratio_tp_over_pp": median["tp"] / median["pp"],
        "first_tokens_equal": firsts["tp"] == firsts["pp"],
    }  # fmt: skip
    emit(result, args.json)
    if not result["first_tokens_equal"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
