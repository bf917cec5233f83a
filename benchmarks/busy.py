"""``python -m benchmarks.busy``: how busy the pipeline's stages are, before and after a
change to the runtime.

One run is ``torchrun --nproc-per-node RANKS -m wavepp.main OPTIONS --json F``; the
change is judged in pairs of runs, the code at a git ref (``--before``, checked out into
a temporary worktree) against this working tree, back to back, the order alternating
from pair to pair (before first in even pairs), each a fresh ``torchrun`` — with nothing
else on the machine. Per run: every stage's busy share (executor busy over the measured
wall, ``stage_utilization``), the least busy, throughput and p50; per side the means;
after ÷ before as the ratio of means with a paired bootstrap 95% interval
(``_stats.ratio_of_means_interval``). The sim's runs say SIMULATED.

    python -m benchmarks.busy --before 65b2144 --ranks 4 --json out.json -- \\
        --executor sim --workload short-suffix --concurrency 64 --rung R4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import mean

from benchmarks._stats import emit, ratio_of_means_interval

FIGURES = (("least_busy", "least busy stage"), ("throughput_tok_s", "tok/s"),
           ("completion_p50_s", "p50 s"))  # fmt: skip


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()  # fmt: skip


def _run(tree: Path, ranks: int, options: list[str], out: Path, timeout_s: float) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
               "-m", "wavepp.main", *options, "--json", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree)}  # this side's package, not the installed one
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True,
                          timeout=timeout_s)  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"run failed ({done.returncode}) in {tree}:\n{done.stderr[-3000:]}")
    record = json.loads(out.read_text())
    busy = record["stage_utilization"]
    return {"stage_utilization": busy, "least_busy": min(busy),
            "throughput_tok_s": record["throughput_tok_s"],
            "completion_p50_s": record["completion_p50_s"],
            "simulated": record["simulated"]}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.busy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="git ref of the code before")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("options", nargs=argparse.REMAINDER,
                        help="wavepp.main's options, after --")  # fmt: skip
    args = parser.parse_args(argv)
    options = args.options[1:] if args.options[:1] == ["--"] else args.options
    if args.pairs < 2:
        parser.error("--pairs: at least 2 (an interval needs them)")
    root = Path(_git("rev-parse", "--show-toplevel", cwd=Path.cwd()))
    before_commit = _git("rev-parse", args.before, cwd=root)
    after_commit = _git("rev-parse", "HEAD", cwd=root)
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no", cwd=root))
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="wavepp-busy-") as tmp:
        tree = Path(tmp) / "before"
        _git("worktree", "add", "--detach", str(tree), before_commit, cwd=root)
        try:
            for i in range(args.pairs):
                order = ("before", "after") if i % 2 == 0 else ("after", "before")
                for side in order:
                    where = tree if side == "before" else root
                    run = _run(where, args.ranks, options, Path(tmp) / f"{side}-{i}.json",
                               args.timeout_s)  # fmt: skip
                    runs[side].append(run)
                    label = " SIMULATED" if run["simulated"] else ""
                    print(f"pair {i} {side}:{label} least busy {run['least_busy']:.1%}, "
                          f"{run['throughput_tok_s']:,.0f} tok/s, p50 "
                          f"{run['completion_p50_s']:.3f} s", file=sys.stderr, flush=True)  # fmt: skip
        finally:
            _git("worktree", "remove", "--force", str(tree), cwd=root)
    summary = {}
    for key, name in FIGURES:
        before = [r[key] for r in runs["before"]]
        after = [r[key] for r in runs["after"]]
        low, high = ratio_of_means_interval(after, before)
        summary[key] = {"before": mean(before), "after": mean(after),
                        "after_over_before": mean(after) / mean(before),
                        "interval": [low, high]}  # fmt: skip
        print(f"{name}: {mean(before):.4g} -> {mean(after):.4g}, after / before "
              f"{mean(after) / mean(before):.3f} [{low:.3f}, {high:.3f}]", file=sys.stderr)  # fmt: skip
    emit({"benchmark": "busy", "simulated": runs["after"][0]["simulated"],
          "before": before_commit, "after": after_commit, "after_dirty": dirty,
          "ranks": args.ranks, "options": options, "pairs": args.pairs, "runs": runs,
          "summary": summary}, args.json)  # fmt: skip


if __name__ == "__main__":
    main()
