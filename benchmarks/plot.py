"""``python -m benchmarks.plot RESULTS --out DIR``: pictures of a results file.

- ``throughput_<workload>.png``: median throughput against concurrency, one line per
  rung (the oracle: the best planner's, see :mod:`benchmarks.matrix`);
- ``ladder_<workload>.png``: the ablation ladder as bars of medians at the highest
  concurrency (like the paper's Fig. 14), the runs' min–max as error bars, with Δ% over
  the rung below;
- ``completion_cdf_<workload>.png``: completion-time CDFs per rung at that concurrency.

Figures from the simulated executor say SIMULATED in their titles.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from benchmarks.matrix import RUNGS, cell_summaries, load_results, row_planner


def _title(base: str, rows: list[dict]) -> str:
    return base + (" — SIMULATED" if any(r.get("simulated") for r in rows) else "")


def plot_results(path: Path, out: Path) -> list[Path]:
    rows = load_results(path)
    if not rows:
        raise SystemExit(f"{path} holds no results")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    summaries = cell_summaries(rows)
    for workload in sorted({r.get("workload_label", r["workload"]) for r in rows}):
        sub = [r for r in rows if r.get("workload_label", r["workload"]) == workload]
        cells = {c: s for (label, c), s in summaries.items() if label == workload}
        rungs = [g for g in RUNGS if any(g in s for s in cells.values())]
        # Throughput vs concurrency (medians).
        fig, ax = plt.subplots(figsize=(6, 4))
        for rung in rungs:
            pts = sorted((c, s[rung].throughput) for c, s in cells.items() if rung in s)
            ax.plot([c for c, _ in pts], [t for _, t in pts], marker="o", label=rung)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("throughput (input tok/s, cached included)")
        ax.set_title(_title(workload, sub))
        ax.legend()
        ax.grid(alpha=0.3)
        written.append(_save(fig, out / f"throughput_{workload}.png"))
        # The ladder at the highest concurrency.
        top = max(cells)
        at_top = cells[top]
        names = [g for g in rungs if g in at_top]
        values = [at_top[g].throughput for g in names]
        errors = [[v - at_top[g].low for g, v in zip(names, values, strict=True)],
                  [at_top[g].high - v for g, v in zip(names, values, strict=True)]]  # fmt: skip
        labels = [f"oracle[{at_top[g].planner}]" if g == "oracle" else g for g in names]
        fig, ax = plt.subplots(figsize=(6, 4))
        bars = ax.bar(labels, values, color="tab:blue", yerr=errors, capsize=3)
        for i, bar in enumerate(bars):
            if i:
                delta = (values[i] / values[i - 1] - 1) * 100
                ax.annotate(f"{delta:+.1f}%", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=8)  # fmt: skip
        ax.set_ylabel("throughput (tok/s, median)")
        ax.set_title(_title(f"ablation ladder, {workload}, c={top}", sub))
        written.append(_save(fig, out / f"ladder_{workload}.png"))
        first = {}  # one run per rung at the top concurrency (the oracle: the winner's)
        for r in sub:
            if r["concurrency"] != top or r.get("repeat", 0):
                continue
            if r["rung"] == "oracle" and row_planner(r) != at_top["oracle"].planner:
                continue
            first[r["rung"]] = r
        # Completion-time CDFs (records keep per-request rows only if the run kept them).
        fig, ax = plt.subplots(figsize=(6, 4))
        drew = False
        for g in names:
            if g not in first:
                continue
            times = sorted(q["completion_s"] for q in first[g].get("requests", [])
                           if q.get("completion_s") is not None)  # fmt: skip
            if not times:
                times = sorted(first[g].get("completion_times_s", []))
            if times:
                ax.step(times, [(i + 1) / len(times) for i in range(len(times))], label=g)
                drew = True
        ax.set_xlabel("completion time (s, queue included)")
        ax.set_ylabel("share of requests")
        ax.set_title(_title(f"completion CDF, {workload}, c={top}", sub))
        if drew:
            ax.legend()
        ax.grid(alpha=0.3)
        written.append(_save(fig, out / f"completion_cdf_{workload}.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.plot",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("results", help="JSONL written by python -m benchmarks")
    p.add_argument("--out", default="plots", help="directory for the PNGs")
    args = p.parse_args(argv)
    for path in plot_results(Path(args.results), Path(args.out)):
        print(path)


if __name__ == "__main__":
    main()
