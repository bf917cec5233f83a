"""``python -m benchmarks.scaling``: strong scaling of cold prefill in the simulator.

Runs the same cold workload (default: 32 prompts of 131,072 tokens at concurrency 16)
at P = 1, 2, 4, 8 pipeline stages, one ``torchrun`` each, and prints

- **efficiency** = throughput(P) / (P x throughput(1)): 1.0 is a pipeline that loses
  nothing to fill, drain, bubbles or its own overheads (SGLang reports 82.8% for its
  chunked pipeline; the issue aims at ≥ 90% at P = 4), with ``--rung`` (default R5);
- **latency at c = 1**: the completion time of one prompt alone, and its ratio to P = 1
  (one prompt split into chunks that overlap across stages; the aim is ≤ 0.3x at P = 4),
  with ``--latency-rung`` (default R5, whose cost planner sizes a lone prompt's chunks
  to equal time: :func:`wavepp.plan.cost.lone_chunk`).

Every figure is SIMULATED (the sim executor sleeps each wave's predicted time) and
every ratio comes from runs of this invocation. The runtime itself (admission, planning,
Gloo transfers, Python) runs for real on this machine's CPUs and is not scaled by
``--time-scale``.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import numpy as np

from benchmarks.matrix import _RUNG_PLANNER, Cell, run_cell
from wavepp.config import EXECUTOR_DEFAULTS
from wavepp.plan import PLANNERS, CostModel, Pending, PlanContext
from wavepp.plan.placement import whole_layers
from wavepp.sim.executor import StageCostModel
from wavepp.sim.profiles import DEVICES, MODELS, split_layers


def _chunks(prompt: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(a + size, prompt)) for a in range(0, prompt, size)]


def balanced_split(model: str, device: str, stages: int, prompt: int, budget: int) -> list[int]:
    """Layers per stage that minimize the slowest stage's predicted time for one prompt
    in chunks of ``budget`` (``wavepp.plan.placement.whole_layers``; the last stage also
    runs the LM head).

    Splitting by count puts unequal numbers of attention layers on the stages of a hybrid
    (Kimi-class: 15 MLA layers among 61), and at long prompts an attention layer costs far
    more than a linear one; this splits by predicted cost instead, each range's time from
    the same cost model as the runs."""
    m, dev = MODELS[model], DEVICES[device]
    chunks = _chunks(prompt, budget)

    @functools.cache
    def span(a: int, b: int, s: int) -> float:
        cost = StageCostModel(m, dev, range(a, b), s == stages - 1)
        return sum(cost.cost([ch], int(ch[1] == prompt)).seconds for ch in chunks)

    return whole_layers(span, m.num_layers, stages)


def planned_alone(planner: str, prior: CostModel, stages: int, prompt: int,
                  budget: int) -> list[tuple[int, int]]:  # fmt: skip
    """The chunks ``planner`` plans for one prompt alone in the pipeline, by the cost
    model it starts from (``prior``: the runtime refits it from measured waves)."""
    ctx = PlanContext(budget, 2 * stages, EXECUTOR_DEFAULTS["sim"]["min_budget"],
                      cost_model=prior, stages=stages)  # fmt: skip
    live, out = [Pending("alone", 0, prompt)], []
    while live:
        wave = PLANNERS[planner](live, len(out), ctx)
        (chunk,) = wave.chunks
        out.append((chunk.start, chunk.end))
        live = [p for p in [live[0].planned_to(chunk.end)] if p.remaining > 0]
    return out


def cost_model_fit(cost: StageCostModel) -> CostModel:
    """The cost model's own ``d + max(floor, a·t + c·t·(p + t/2))``: d its per-wave
    overhead, floor a 256-token wave, a and c least squares over compute-bound waves.
    The runtime's planner never sees this (it learns from observed waves, from a generic
    prior); the bound is what R5 would plan if it knew the cost model."""
    d = cost.device.wave_overhead_s
    floor = cost.cost([(0, 256)], 0).seconds - d
    rows, times = [], []
    for t in (4096, 8192, 16384, 32768):
        for p in (0, 16_384, 131_072):
            rows.append([t, t * (p + t / 2)])
            times.append(cost.cost([(p, p + t)], 0).seconds - d)
    (a, c), *_ = np.linalg.lstsq(np.array(rows), np.array(times), rcond=None)
    return CostModel(max(float(a), 1e-12), max(float(c), 0.0), d, floor)


def model_bounds(
    model: str, device: str, stages: int, prompt: int, budget: int, latency_budget: int,
    counts: list[int] | None = None, planner: str = "static",
) -> tuple[float, float]:  # fmt: skip
    """What the cost model alone allows, with no runtime overhead: (the balance bound on
    efficiency — all stages' time over P x the slowest stage's, for one prompt in chunks of
    ``budget`` — and one prompt's latency in seconds: the chunks ``planner`` plans for it
    at budget ``latency_budget``, flowing through the stages in order). ``counts``:
    layers per stage (default: even)."""
    m = MODELS[model]
    costs = [StageCostModel(m, DEVICES[device], layers, s == stages - 1)
             for s, layers in enumerate(split_layers(m.num_layers, stages, counts))]  # fmt: skip

    def times(chunks: list[tuple[int, int]]) -> list[list[float]]:  # [chunk][stage] s
        return [[c.cost([ch], int(ch[1] == prompt)).seconds for c in costs] for ch in chunks]

    per_stage = [sum(col) for col in zip(*times(_chunks(prompt, budget)), strict=True)]
    balance = sum(per_stage) / (stages * max(per_stage))
    prior = cost_model_fit(costs[0])  # R5 knowing the cost model (the runtime's does not)
    done = [0.0] * stages  # when each stage finished its previous chunk
    for row in times(planned_alone(planner, prior, stages, prompt, latency_budget)):
        for s, t in enumerate(row):
            done[s] = max(done[s], done[s - 1] if s else 0.0) + t
    return balance, done[-1]


def _cell(a: argparse.Namespace, ranks: int, concurrency: int, requests: int, budget: int,
          counts: list[int] | None = None, rung: str | None = None) -> Cell:  # fmt: skip
    split = ("--layers-per-stage", ",".join(map(str, counts)) if counts else "even")
    args = ("--executor", "sim", "--model", a.model, "--sim-device", a.sim_device,
            "--workload", "cold", "--prompt-tokens", str(a.prompt_tokens),
            "--requests", str(requests), "--budget", str(budget),
            "--time-scale", str(a.time_scale), *split, *a.extra.split())  # fmt: skip
    return Cell(f"cold-{a.prompt_tokens // 1024}k", concurrency, rung or a.rung, args, ranks=ranks)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.scaling",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--stages", default="1,2,4,8", help="comma list of P (must include 1)")
    p.add_argument("--model", default="kimi-k3-class")
    p.add_argument("--sim-device", default="gb300")
    p.add_argument("--prompt-tokens", type=int, default=131_072)
    p.add_argument("--requests", type=int, default=32, help="throughput runs")
    p.add_argument("--concurrency", type=int, default=16, help="throughput runs")
    p.add_argument("--rung", default="R5", choices=sorted(_RUNG_PLANNER),
                   help="rung of the throughput runs")  # fmt: skip
    p.add_argument(
        "--latency-rung", default="R5", choices=sorted(_RUNG_PLANNER),
        help="rung of the c = 1 runs (R5: the cost planner sizes a lone prompt's chunks "
        "to equal time; R4: MPU's equal-token chunks)",
    )  # fmt: skip
    p.add_argument("--budget", type=int, default=16_384, help="M of the throughput runs")
    p.add_argument(
        "--latency-budget", type=int, default=8192,
        help="M of the c = 1 runs (equal-token chunks need ≥ 15 for 0.3x at P = 4: "
        "1/P + (P-1)/(chunks x P); R5's equal-time chunks take at most this many tokens)",
    )  # fmt: skip
    p.add_argument(
        "--balance", choices=("cost", "count"), default="cost",
        help="layers per stage: 'cost' minimizes the slowest stage's predicted time for "
        "the prompt (hybrids with unevenly spread attention layers); 'count' splits evenly",
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
        counts = None
        if a.balance == "cost" and ranks > 1:
            counts = balanced_split(a.model, a.sim_device, ranks, a.prompt_tokens, a.budget)
        tput = run_cell(_cell(a, ranks, a.concurrency, a.requests, a.budget, counts), 1,
                        a.timeout)  # fmt: skip
        alone = run_cell(_cell(a, ranks, 1, 1, a.latency_budget, counts, a.latency_rung), 1,
                         a.timeout)  # fmt: skip
        balance, ideal_latency = model_bounds(a.model, a.sim_device, ranks, a.prompt_tokens,
                                              a.budget, a.latency_budget, counts,
                                              _RUNG_PLANNER[a.latency_rung])  # fmt: skip
        rows.append({"stages": ranks, "layers_per_stage": counts or "even",
                     "throughput_tok_s": tput["throughput_tok_s"],
                     "utilization": tput["stage_utilization"],
                     "latency_s": alone["completion_p50_s"], "balance_bound": balance,
                     "model_latency_s": ideal_latency})  # fmt: skip
        print(f"P={ranks}: {tput['throughput_tok_s']:,.0f} tok/s, one prompt alone in "
              f"{alone['completion_p50_s']:.2f} s", flush=True)  # fmt: skip
    base = next(r for r in rows if r["stages"] == 1)
    print(
        f"\nstrong scaling — SIMULATED — {a.model} on {a.sim_device}, cold "
        f"{a.prompt_tokens:,}-token prompts, rung {a.rung} (c = 1: {a.latency_rung}), "
        f"time scale {a.time_scale}"
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
        "alone (the chunks the c = 1 rung's planner plans knowing the cost model, flowing "
        "through the stages, no runtime overhead)"
    )
    if a.json:
        record = {"simulated": True, "config": vars(a), "rows": rows}
        Path(a.json).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
