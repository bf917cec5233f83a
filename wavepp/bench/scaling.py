"""``python -m wavepp.bench.scaling``: strong scaling of cold prefill in the simulator.

Runs the same cold workload (default: 32 prompts of 131,072 tokens at concurrency 16)
at P = 1, 2, 4, 8 pipeline stages, one ``torchrun`` each, and prints

- **efficiency** = throughput(P) / (P x throughput(1)): 1.0 is a pipeline that loses
  nothing to fill, drain, bubbles or its own overheads (SGLang reports 82.8% for its
  chunked pipeline; the issue aims at ≥ 90% at P = 4);
- **latency at c = 1**: the completion time of one prompt alone, and its ratio to P = 1
  (one prompt split into chunks that overlap across stages; the aim is ≤ 0.3x at P = 4).

Every figure is SIMULATED (the sim executor sleeps each wave's predicted time) and
every ratio comes from runs of this invocation. The runtime itself (admission, planning,
Gloo transfers, Python) runs for real on this machine's CPUs and is not scaled by
``--time-scale``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from wavepp.bench.matrix import Cell, run_cell
from wavepp.exec.profiles import DEVICES, MODELS, split_layers
from wavepp.exec.sim import StageCostModel


def model_bounds(
    model: str, device: str, stages: int, prompt: int, budget: int, latency_budget: int
) -> tuple[float, float]:
    """What the cost model alone allows, with no runtime overhead: (the balance bound on
    efficiency — all stages' time over P x the slowest stage's, for one prompt in chunks of
    ``budget`` — and one prompt's latency in seconds, chunks of ``latency_budget`` flowing
    through the stages in order)."""
    m = MODELS[model]
    costs = [StageCostModel(m, DEVICES[device], layers, s == stages - 1)
             for s, layers in enumerate(split_layers(m.num_layers, stages))]  # fmt: skip

    def times(size: int) -> list[list[float]]:  # [chunk][stage] seconds
        chunks = [(a, min(a + size, prompt)) for a in range(0, prompt, size)]
        return [[c.cost([ch], int(ch[1] == prompt)).seconds for c in costs] for ch in chunks]

    per_stage = [sum(col) for col in zip(*times(budget), strict=True)]
    balance = sum(per_stage) / (stages * max(per_stage))
    done = [0.0] * stages  # when each stage finished its previous chunk
    for row in times(latency_budget):
        for s, t in enumerate(row):
            done[s] = max(done[s], done[s - 1] if s else 0.0) + t
    return balance, done[-1]


def _cell(a: argparse.Namespace, ranks: int, concurrency: int, requests: int,
          budget: int) -> Cell:  # fmt: skip
    args = ("--executor", "sim", "--model", a.model, "--sim-device", a.sim_device,
            "--workload", "cold", "--prompt-tokens", str(a.prompt_tokens),
            "--requests", str(requests), "--budget", str(budget),
            "--time-scale", str(a.time_scale), *a.extra.split())  # fmt: skip
    return Cell(f"cold-{a.prompt_tokens // 1024}k", concurrency, a.rung, args, ranks=ranks)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m wavepp.bench.scaling",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--stages", default="1,2,4,8", help="comma list of P (must include 1)")
    p.add_argument("--model", default="kimi-k3-class")
    p.add_argument("--sim-device", default="gb300")
    p.add_argument("--prompt-tokens", type=int, default=131_072)
    p.add_argument("--requests", type=int, default=32, help="throughput runs")
    p.add_argument("--concurrency", type=int, default=16, help="throughput runs")
    p.add_argument("--rung", default="R4")
    p.add_argument("--budget", type=int, default=16_384, help="M of the throughput runs")
    p.add_argument(
        "--latency-budget", type=int, default=8192,
        help="M of the c = 1 runs (a prompt needs ≥ 15 chunks for 0.3x at P = 4: "
        "1/P + (P-1)/(chunks x P))",
    )  # fmt: skip
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--extra", default="", help="more wavepp.main options for every run")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    stages = [int(x) for x in a.stages.split(",")]
    if 1 not in stages:
        raise SystemExit("--stages must include 1 (the single-stage reference)")
    rows = []
    for ranks in stages:
        tput = run_cell(_cell(a, ranks, a.concurrency, a.requests, a.budget), 1, a.timeout)
        alone = run_cell(_cell(a, ranks, 1, 1, a.latency_budget), 1, a.timeout)
        balance, ideal_latency = model_bounds(a.model, a.sim_device, ranks, a.prompt_tokens,
                                              a.budget, a.latency_budget)  # fmt: skip
        rows.append({"stages": ranks, "throughput_tok_s": tput["throughput_tok_s"],
                     "utilization": tput["stage_utilization"],
                     "latency_s": alone["completion_p50_s"], "balance_bound": balance,
                     "model_latency_s": ideal_latency})  # fmt: skip
        print(f"P={ranks}: {tput['throughput_tok_s']:,.0f} tok/s, one prompt alone in "
              f"{alone['completion_p50_s']:.2f} s", flush=True)  # fmt: skip
    base = next(r for r in rows if r["stages"] == 1)
    print(
        f"\nstrong scaling — SIMULATED — {a.model} on {a.sim_device}, cold "
        f"{a.prompt_tokens:,}-token prompts, rung {a.rung}, time scale {a.time_scale}"
    )
    print(f"  {'P':>2}  {'tok/s (c=' + str(a.concurrency) + ')':>16}  {'efficiency':>10}  "
          f"{'model bound':>11}  {'mean util':>9}  {'latency c=1 s':>13}  {'vs P=1':>6}  "
          f"{'model':>6}")  # fmt: skip
    model_base = next(r for r in rows if r["stages"] == 1)["model_latency_s"]
    for r in rows:
        r["efficiency"] = r["throughput_tok_s"] / (r["stages"] * base["throughput_tok_s"])
        r["latency_ratio"] = r["latency_s"] / base["latency_s"]
        util = sum(r["utilization"]) / len(r["utilization"])
        r["model_latency_ratio"] = r["model_latency_s"] / model_base
        print(f"  {r['stages']:>2}  {r['throughput_tok_s']:>16,.0f}  {r['efficiency']:>10.1%}  "
              f"{r['balance_bound']:>11.1%}  {util:>9.3f}  {r['latency_s']:>13.2f}  "
              f"{r['latency_ratio']:>5.2f}x  {r['model_latency_ratio']:>5.2f}x")  # fmt: skip
    print(
        "  model bound: all stages' predicted time over P x the slowest stage's (uneven "
        "layer kinds per stage); model: one prompt's latency ratio from the cost model "
        "alone (chunks flowing through the stages, no runtime overhead)"
    )
    if a.json:
        record = {"simulated": True, "config": vars(a), "rows": rows}
        Path(a.json).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
