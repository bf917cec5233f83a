"""``python -m wavepp.bench.plot RESULTS --out DIR``: pictures of a results file.

- ``throughput_<workload>.png``: throughput against concurrency, one line per rung;
- ``ladder_<workload>.png``: the ablation ladder as bars at the highest concurrency
  (like the paper's Fig. 14), with Δ% over the rung below;
- ``completion_cdf_<workload>.png``: completion-time CDFs per rung at that concurrency.

Figures from the simulated executor say SIMULATED in their titles.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from wavepp.bench.matrix import RUNGS, load_results


def _title(base: str, rows: list[dict]) -> str:
    return base + (" — SIMULATED" if any(r.get("simulated") for r in rows) else "")


def plot_results(path: Path, out: Path) -> list[Path]:
    rows = load_results(path)
    if not rows:
        raise SystemExit(f"{path} holds no results")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for workload in sorted({r.get("workload_label", r["workload"]) for r in rows}):
        sub = [r for r in rows if r.get("workload_label", r["workload"]) == workload]
        rungs = [g for g in RUNGS if any(r["rung"] == g for r in sub)]
        # Throughput vs concurrency.
        fig, ax = plt.subplots(figsize=(6, 4))
        for rung in rungs:
            pts = sorted(
                (r["concurrency"], r["throughput_tok_s"]) for r in sub if r["rung"] == rung
            )
            ax.plot([c for c, _ in pts], [t for _, t in pts], marker="o", label=rung)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("throughput (input tok/s, cached included)")
        ax.set_title(_title(workload, sub))
        ax.legend()
        ax.grid(alpha=0.3)
        written.append(_save(fig, out / f"throughput_{workload}.png"))
        # The ladder at the highest concurrency.
        top = max(r["concurrency"] for r in sub)
        at_top = {r["rung"]: r for r in sub if r["concurrency"] == top}
        names = [g for g in rungs if g in at_top]
        values = [at_top[g]["throughput_tok_s"] for g in names]
        fig, ax = plt.subplots(figsize=(6, 4))
        bars = ax.bar(names, values, color="tab:blue")
        for i, bar in enumerate(bars):
            if i:
                delta = (values[i] / values[i - 1] - 1) * 100
                ax.annotate(f"{delta:+.1f}%", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=8)  # fmt: skip
        ax.set_ylabel("throughput (tok/s)")
        ax.set_title(_title(f"ablation ladder, {workload}, c={top}", sub))
        written.append(_save(fig, out / f"ladder_{workload}.png"))
        # Completion-time CDFs (records keep per-request rows only if the run kept them).
        fig, ax = plt.subplots(figsize=(6, 4))
        drew = False
        for g in names:
            times = sorted(q["completion_s"] for q in at_top[g].get("requests", [])
                           if q.get("completion_s") is not None)  # fmt: skip
            if not times:
                times = sorted(at_top[g].get("completion_times_s", []))
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
        prog="python -m wavepp.bench.plot",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("results", help="JSONL written by python -m wavepp.bench")
    p.add_argument("--out", default="plots", help="directory for the PNGs")
    args = p.parse_args(argv)
    for path in plot_results(Path(args.results), Path(args.out)):
        print(path)


if __name__ == "__main__":
    main()
