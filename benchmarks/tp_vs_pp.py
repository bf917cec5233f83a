"""``python -m benchmarks.tp_vs_pp``: tensor against pipeline parallelism at 8 devices,
in the simulator, beside the paper's figures.

Runs the paper's three layouts of 8 devices — TP8/EP8 (one stage over 8 devices,
``--sim-tp 8``), PP8 (8 stages of one device) and TP2×PP4 (4 stages of 2, the paper's
first open question) — on the Kimi-class profile (GB300, NVFP4: the paper's Kimi K3
hardware) and the MiniMax-class profile (B300, NVFP4: its MiniMax hardware, there at
PP4), with cold, seeded-reuse (90%) and mixed (75% warm 131K, 25% cold 262K) cells at
c = 8 and 32, one ``torchrun`` each with the same runtime and rung (WavePP's, ``--rung``),
so the layouts differ only in where the devices' work and transfers go
(docs/design.md §6). Pipelines of several stages split their layers by predicted cost
(``benchmarks.scaling.balanced_split``).

Prints the throughput table, the geometric mean of PP8 over TP8/EP8 and of TP2×PP4 over
TP8/EP8 per model, and the paper's figures beside them (copied below with their source).
Every figure of this benchmark is SIMULATED. ``--quick`` (c requests a cell, 36 runs)
took 19 minutes on 2 shared CPU cores; ``--models kimi-k3-class`` runs half the cells.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path

from benchmarks.matrix import _RUNG_PLANNER, Cell, run_cell
from benchmarks.scaling import balanced_split

# The paper: "WavePP: High-Throughput Pipeline Parallel LLM Prefill under Prefix Reuse"
# (Baseten), Kimi K3 on 8 GB300 (two 4-GPU nodes), input tok/s at c = 32 of WavePP
# (TP1 x PP8; its Tables 4, 6, 8 and §5.5-§5.7), and its geometric-mean comparisons (§5.4,
# §5.5, §5.7). The paper has no TP2 x PP4 run and no MiniMax run at 8 devices.
PAPER_KIMI_PP8_C32 = {"cold-131k": 35_878, "seeded-131k": 289_096, "mixed-131k-262k": 61_190}
PAPER_GEOMEANS = (
    ("SGLang PP8 over SGLang TP8/EP8, every Kimi K3 cell (§5.4)", 26.8),
    ("WavePP PP8 over TRT-LLM TP8/EP8, cold 131K (§5.5)", 49.1),
    ("WavePP PP8 over TP8/EP8, mixed, lowest of the range (§5.7)", 46.1),
)
PAPER_SOURCE = ("WavePP paper (Baseten), Kimi K3 on 8 GB300: Tables 4, 6, 8 and "
                "§5.4-§5.7")  # fmt: skip

LAYOUTS = (("TP8/EP8", 1, 8), ("PP8", 8, 1), ("TP2xPP4", 4, 2))  # (name, stages, tp)
MODELS = (("kimi-k3-class", "gb300"), ("minimax-m2-class", "b300"))


BALANCED_FOR = 131_072  # prompt tokens the pipelines' layer splits are balanced for


def workloads() -> list[tuple[str, tuple[str, ...]]]:
    """(label, wavepp.main options)."""
    return [
        ("cold-131k", ("--workload", "cold", "--prompt-tokens", "131072")),
        ("seeded-131k", ("--workload", "seeded", "--prompt-tokens", "131072")),
        ("mixed-131k-262k", ("--workload", "mixed", "--prompt-tokens", "131072",
                             "--cold-tokens", "262144")),
    ]


def cells(a: argparse.Namespace) -> list[tuple[dict, Cell]]:
    out = []
    for model, device in MODELS:
        if a.models and model not in a.models.split(","):
            continue
        splits = {stages: ",".join(map(str, balanced_split(model, device, stages,
                                                           BALANCED_FOR, a.budget)))
                  for _, stages, _ in LAYOUTS if stages > 1}  # fmt: skip
        for label, options in workloads():
            for c in (8, 32):
                requests = c if a.quick else 2 * c
                for name, stages, tp in LAYOUTS:
                    split = ("--layers-per-stage", splits[stages]) if stages > 1 else ()
                    args = ("--executor", "sim", "--model", model, "--sim-device", device,
                            "--weight-format", "nvfp4", "--sim-tp", str(tp), "--budget",
                            str(a.budget), "--requests", str(requests), "--time-scale",
                            str(a.time_scale), *options, *split)  # fmt: skip
                    key = {"model": model, "device": device, "cell": label,
                           "concurrency": c, "layout": name, "stages": stages, "tp": tp}
                    out.append((key, Cell(label, c, a.rung, args, ranks=stages)))
    return out


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def table(rows: list[dict]) -> str:
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        sub = [r for r in rows if r["model"] == model]
        device = sub[0]["device"]
        lines.append(f"\nTP vs PP at 8 devices — SIMULATED — {model} on {device}, NVFP4 "
                     "(input tok/s incl. cached; p50 completion s)")  # fmt: skip
        head = f"  {'cell':<18} {'c':>3}"
        for name, _, _ in LAYOUTS:
            head += f"  {name:>20}"
        head += f"  {'PP8/TP8':>8}  {'paper PP8 (WavePP)':>18}"
        lines.append(head)
        ratios: dict[str, list[float]] = {name: [] for name, _, _ in LAYOUTS}
        for cell, c in dict.fromkeys((r["cell"], r["concurrency"]) for r in sub):
            got = {r["layout"]: r for r in sub if (r["cell"], r["concurrency"]) == (cell, c)}
            line = f"  {cell:<18} {c:>3}"
            for name, _, _ in LAYOUTS:
                r = got.get(name)
                line += (f"  {r['throughput_tok_s']:>11,.0f} {r['completion_p50_s']:>7.1f}s"
                         if r else f"  {'—':>20}")  # fmt: skip
            tp8, pp8 = got.get("TP8/EP8"), got.get("PP8")
            for name in ratios:
                if tp8 and got.get(name):
                    ratios[name].append(got[name]["throughput_tok_s"] / tp8["throughput_tok_s"])
            delta = (f"{pp8['throughput_tok_s'] / tp8['throughput_tok_s'] - 1:+.1%}"
                     if tp8 and pp8 else "—")  # fmt: skip
            paper = (PAPER_KIMI_PP8_C32.get(cell) if model == "kimi-k3-class" and c == 32
                     else None)  # fmt: skip
            line += f"  {delta:>8}  {f'{paper:,}' if paper else '—':>18}"
            lines.append(line)
        for name in ("PP8", "TP2xPP4"):
            if ratios[name]:
                lines.append(f"  geomean {name} over TP8/EP8: "
                             f"{geomean(ratios[name]) - 1:+.1%} over {len(ratios[name])} cells")
    lines.append(f"\nThe paper ({PAPER_SOURCE}):")
    for what, pct in PAPER_GEOMEANS:
        lines.append(f"  {what}: +{pct}%")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tp_vs_pp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="requests = c in every cell (default 2 x c)")  # fmt: skip
    p.add_argument("--models", default="",
                   help="comma list of kimi-k3-class, minimax-m2-class (default: both)")
    p.add_argument("--rung", default="R4", choices=sorted(_RUNG_PLANNER),
                   help="runtime configuration of every cell")  # fmt: skip
    p.add_argument("--budget", type=int, default=16_384, help="M, tokens per wave")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="real seconds slept per simulated second (the runtime's own work "
                   "is not scaled: at 0.1 here TP8/EP8's cold c = 32 cell lost a third of "
                   "its throughput to it, PP8's 60%%)")
    p.add_argument("--timeout", type=float, default=900, help="per run, seconds")
    p.add_argument("--json", help="write every row and the paper's figures here")
    a = p.parse_args(argv)
    rows = []
    for key, cell in cells(a):
        record = run_cell(cell, cell.ranks, a.timeout)
        row = {**key, "throughput_tok_s": record["throughput_tok_s"],
               "completion_p50_s": record["completion_p50_s"],
               "simulated": record["simulated"]}  # fmt: skip
        rows.append(row)
        print(f"{key['model']} {key['cell']} c={key['concurrency']} {key['layout']}: "
              f"{row['throughput_tok_s']:,.0f} tok/s (SIMULATED)", file=sys.stderr, flush=True)
    print(table(rows))
    if a.json:
        given = sys.argv[1:] if argv is None else argv
        command = shlex.join(["python", "-m", "benchmarks.tp_vs_pp", *given])
        record = {"simulated": True, "command": command, "config": vars(a), "rows": rows,
                  "paper": {"source": PAPER_SOURCE, "kimi_pp8_c32_tok_s": PAPER_KIMI_PP8_C32,
                            "geomean_pct": dict(PAPER_GEOMEANS)}}  # fmt: skip
        Path(a.json).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
