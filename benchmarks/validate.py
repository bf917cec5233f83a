"""The simulator against real runs: the same workloads on the torch executor and on the
sim with this machine's measured profile, predicted against measured side by side.

    python -m benchmarks.validate --quick --json validation.json

Each cell (model x workload x P) runs as ``python -m benchmarks`` runs a cell (torchrun,
``--json``), once with ``--executor torch`` and once with ``--executor sim --sim-device
measured:FILE``, every other option the same, ``--repeat`` times each (medians).
Profiles come from ``--profile FILE`` (one per model), else ``python -m
wavepp.sim.calibrate`` measures them first. Every rank runs one torch thread (the
profiles are measured so): on a 2-core machine, P = 4 runs four ranks on two cores. The
sim runs with ``--sim-burn``: each wave spent as work on a core at the rate the profile
measured, so the OS shares the cores among the ranks' waves and their host work as it
does for torch waves (``--sleep``: slept instead, every wave P / 2 times as long where
the ranks outnumber the cores, ``MeasuredProfile.core_sharing``). Goal: throughput
within ±10% and p50 completion within ±15%; a cell that misses says what differs between
its real and simulated runs (seconds a wave, waves, busy share, balance: :func:`why`).
``--table FILE`` prints a recorded validation again.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import attrs

from benchmarks.matrix import Cell, run_cell
from wavepp.host import usable_cores

TOK_S_GOAL = 0.10
P50_GOAL = 0.15
BUSY_GAP = 0.10  # a miss's note names busy shares this far apart
MODELS = ("tiny-kimi", "tiny-llama")
WORKLOADS = ("cold", "seeded", "short-suffix", "conversation")
STAGES = (1, 2, 4)
QUICK = (("tiny-kimi", "cold", 2), ("tiny-kimi", "seeded", 2), ("tiny-kimi", "short-suffix", 1),
         ("tiny-kimi", "conversation", 2), ("tiny-llama", "seeded", 1),
         ("tiny-llama", "short-suffix", 4))  # fmt: skip
CORES = usable_cores()  # P ranks of one thread each oversubscribe beyond this


@attrs.frozen
class Spec:
    model: str
    workload: str
    stages: int

    @property
    def name(self) -> str:
        return f"{self.model}/{self.workload}/P{self.stages}"

    def args(self, a: argparse.Namespace) -> tuple[str, ...]:
        return ("--model", self.model, "--workload", self.workload, "--requests",
                str(a.requests), "--prompt-tokens", str(a.prompt_tokens), "--suffix-tokens",
                str(a.suffix_tokens), "--budget", str(a.budget), "--min-budget", "64",
                "--block-size", "16", "--threads", "1", "--seed", str(a.seed))  # fmt: skip


def error(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured:
        return None
    return predicted / measured - 1


def stage_medians(runs: list[dict], key: str) -> list[float]:
    """Each stage's median of ``key`` (a per-stage list) over ``runs``."""
    return [statistics.median(r[key][i] for r in runs) for i in range(len(runs[0][key]))]


def slowest_wave_s(runs: list[dict]) -> float | None:
    """Median over runs of the slowest stage's busy seconds per wave."""
    waves = [max(b / max(w, 1) for b, w in zip(r["stage_busy_s"], r["stage_waves"],
                                                strict=True)) for r in runs]  # fmt: skip
    return statistics.median(waves) if waves else None


def why(spec: Spec, tok_err: float | None, p50_err: float | None,
        torch_runs: list[dict] = (), sim_runs: list[dict] = (),
        burned: bool = False) -> str:  # fmt: skip
    """Where a cell misses, what differs between its real and simulated runs: the slowest
    stage's seconds per wave, the waves a stage ran, the share of the run the stages were
    busy, and how evenly the stages were loaded (slowest over fastest busy time).
    ``burned``: the sim ran with ``--sim-burn`` (its waves share the cores as well)."""
    if tok_err is None or p50_err is None:
        return "no figure"
    if abs(tok_err) <= TOK_S_GOAL and abs(p50_err) <= P50_GOAL:
        return ""
    if not torch_runs or not sim_runs:
        return "miss: no runs to compare"
    reasons = []
    real_wave, sim_wave = slowest_wave_s(torch_runs), slowest_wave_s(sim_runs)
    if real_wave and sim_wave and abs(real_wave / sim_wave - 1) > TOK_S_GOAL:
        reasons.append(f"a real wave took {real_wave / sim_wave:.2f}x the predicted one (the "
                       "parts timed alone by calibrate, summed)")  # fmt: skip
    real_waves = max(stage_medians(torch_runs, "stage_waves"))
    sim_waves = max(stage_medians(sim_runs, "stage_waves"))
    if sim_waves and abs(real_waves / sim_waves - 1) > TOK_S_GOAL:
        reasons.append(f"{real_waves:.0f} real waves a stage against {sim_waves:.0f} "
                       "simulated")  # fmt: skip
    real_busy = statistics.mean(stage_medians(torch_runs, "stage_utilization"))
    sim_busy = statistics.mean(stage_medians(sim_runs, "stage_utilization"))
    if abs(real_busy - sim_busy) > BUSY_GAP:
        reason = (f"the real stages busy {real_busy:.0%} of the run against {sim_busy:.0%} "
                  "simulated")
        if spec.stages > CORES and real_busy < sim_busy and not burned:
            reason += (f" ({spec.stages} ranks on {CORES} cores: the runtime's own work "
                       "between waves shares them too; the sim stretches only the waves)")
        reasons.append(reason)
    real_busy_s, sim_busy_s = (stage_medians(runs, "stage_busy_s")
                               for runs in (torch_runs, sim_runs))  # fmt: skip
    if spec.stages > 1 and min(real_busy_s) > 0 and min(sim_busy_s) > 0:
        real_spread = max(real_busy_s) / min(real_busy_s)
        sim_spread = max(sim_busy_s) / min(sim_busy_s)
        if abs(real_spread / sim_spread - 1) > TOK_S_GOAL:
            reasons.append(f"stages loaded {real_spread:.2f}x unevenly (slowest over fastest "
                           f"busy time) real, {sim_spread:.2f}x simulated")  # fmt: skip
    return "; ".join(reasons) or "miss: cause not identified"


KEPT = ("throughput_tok_s", "completion_p50_s", "makespan_s", "stage_utilization",
        "stage_waves", "reused_share", "input_tokens", "placement")


def compact(record: dict) -> dict:
    """What a row keeps of a run: its figures, each stage's busy seconds and waves."""
    out = {k: record.get(k) for k in KEPT}
    out["stage_busy_s"] = [u * record["makespan_s"] for u in record["stage_utilization"]]
    return out


def row(spec: Spec, torch_runs: list[dict], sim_runs: list[dict], burned: bool = False) -> dict:
    def med(runs: list[dict], key: str) -> float | None:
        values = [r[key] for r in runs if r.get(key) is not None]
        return statistics.median(values) if values else None

    out = {"cell": spec.name, "model": spec.model, "workload": spec.workload,
           "stages": spec.stages, "repeats": len(torch_runs),
           "predicted_tok_s": med(sim_runs, "throughput_tok_s"),
           "measured_tok_s": med(torch_runs, "throughput_tok_s"),
           "predicted_p50_s": med(sim_runs, "completion_p50_s"),
           "measured_p50_s": med(torch_runs, "completion_p50_s"),
           "runs": {"torch": [compact(r) for r in torch_runs],
                    "sim": [compact(r) for r in sim_runs]}}  # fmt: skip
    out["tok_s_error"] = error(out["predicted_tok_s"], out["measured_tok_s"])
    out["p50_error"] = error(out["predicted_p50_s"], out["measured_p50_s"])
    out["within_goal"] = (out["tok_s_error"] is not None and out["p50_error"] is not None
                          and abs(out["tok_s_error"]) <= TOK_S_GOAL
                          and abs(out["p50_error"]) <= P50_GOAL)  # fmt: skip
    real, simulated = slowest_wave_s(out["runs"]["torch"]), slowest_wave_s(out["runs"]["sim"])
    out["wave_ratio"] = real / simulated if real and simulated else None
    out["note"] = why(spec, out["tok_s_error"], out["p50_error"], out["runs"]["torch"],
                      out["runs"]["sim"], burned)
    return out


def run_spread(rows: list[dict]) -> float | None:
    """The torch runs' run-to-run spread: the median over cells (of two runs or more) of
    their throughputs' sample standard deviation over mean. The sim's default noise
    (``wavepp.config.SIM_NOISE``) is this figure of the recorded validation."""
    spreads = []
    for r in rows:
        values = [x["throughput_tok_s"] for x in r["runs"]["torch"]]
        if len(values) >= 2 and statistics.mean(values) > 0:
            spreads.append(statistics.stdev(values) / statistics.mean(values))
    return statistics.median(spreads) if spreads else None


def table(rows: list[dict]) -> str:
    def pct(v: float | None) -> str:
        return "    —  " if v is None else f"{v:+7.1%}"

    lines = [f"predicted (sim, measured profile — SIMULATED) against measured (torch); goal "
             f"±{TOK_S_GOAL:.0%} tok/s, ±{P50_GOAL:.0%} p50",
             f"{'cell':34s} {'pred tok/s':>11s} {'meas tok/s':>11s} {'err':>7s} "
             f"{'pred p50':>9s} {'meas p50':>9s} {'err':>7s}  note"]  # fmt: skip
    for r in rows:
        lines.append(
            f"{r['cell']:34s} {r['predicted_tok_s'] or 0:11,.0f} {r['measured_tok_s'] or 0:11,.0f}"
            f" {pct(r['tok_s_error'])} {r['predicted_p50_s'] or 0:9.3f} "
            f"{r['measured_p50_s'] or 0:9.3f} {pct(r['p50_error'])}  "
            + (r["note"] or "ok"))  # fmt: skip
    met = sum(1 for r in rows if r["within_goal"])
    lines.append(f"{met} of {len(rows)} cells within the goal")
    spread = run_spread(rows)
    if spread is not None:
        lines.append(f"torch runs' spread (median over cells of stdev / mean): {spread:.1%}")
    return "\n".join(lines)


def cells(names: str) -> list[Spec]:
    """The cells named ``model/workload/P<stages>``, comma-separated."""
    specs = []
    for name in filter(None, (n.strip() for n in names.split(","))):
        model, workload, stages = [*name.split("/"), "", "", ""][:3]
        if (model not in MODELS or workload not in WORKLOADS or not stages.startswith("P")
                or not stages[1:].isdigit() or int(stages[1:]) not in STAGES):
            raise SystemExit(f"--cells: {name!r} is not a cell (model/workload/P<stages>: "
                             f"{'|'.join(MODELS)} / {'|'.join(WORKLOADS)} / "
                             f"{'|'.join(f'P{s}' for s in STAGES)})")
        specs.append(Spec(model, workload, int(stages[1:])))
    return specs


def ensure_profile(model: str, given: dict[str, str], workdir: Path) -> str:
    """The profile of ``model``: given, or measured now by wavepp.sim.calibrate."""
    if model in given:
        return given[model]
    out = workdir / f"calibration-{model}.json"
    print(f"calibrating {model} -> {out}", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "wavepp.sim.calibrate", "--model", model,
                    "--threads", "1", "--out", str(out)], check=True)  # fmt: skip
    return str(out)


def reprint(path: Path, out: str | None) -> None:
    """The table of the validation recorded in ``path``, each row worked out again from
    its runs (so a record written before a change to :func:`why` reads as it would now)."""
    try:
        record = json.loads(path.read_text())
        rows = [row(Spec(r["model"], r["workload"], r["stages"]), r["runs"]["torch"],
                    r["runs"]["sim"], record.get("sim_burn", False))
                for r in record["rows"]]  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        sys.exit(f"{path}: not a validation record ({type(e).__name__}: {e})")
    print(table(rows), flush=True)
    if out:
        record.update(rows=rows, run_spread=run_spread(rows))
        Path(out).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {out}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.validate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"{len(QUICK)} cells, one run each (a few minutes here)")
    p.add_argument("--sleep", action="store_true",
                   help="the sim sleeps each wave and stretches it by the ranks over the cores "
                        "(the default: --sim-burn, each wave spent as work on a core)")
    p.add_argument("--cells", default=None, metavar="LIST",
                   help="only these cells, comma-separated as the table names them "
                        "(e.g. tiny-llama/cold/P1)")
    p.add_argument("--profile", action="append", default=[], metavar="FILE",
                   help="a calibrate profile (repeat for each model; the rest are measured)")
    p.add_argument("--json", default=None, metavar="FILE", help="one row per cell")
    p.add_argument("--repeat", type=int, default=None, help="runs per cell [quick 1, else 3]")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--suffix-tokens", type=int, default=128)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=".", help="where measured profiles are written")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    p.add_argument("--table", default=None, metavar="FILE",
                   help="print the table of a recorded validation (--json's file), its notes "
                        "worked out again from its runs, and run nothing (with --json: "
                        "write the record so)")  # fmt: skip
    a = p.parse_args(argv)
    if a.table:
        reprint(Path(a.table), a.json)
        return
    repeat = a.repeat or (1 if a.quick else 3)
    specs = ([Spec(*s) for s in QUICK] if a.quick else
             [Spec(m, w, s) for m in MODELS for w in WORKLOADS for s in STAGES])  # fmt: skip
    if a.cells:
        specs = cells(a.cells)
    given = {}
    for path in a.profile:
        given[json.loads(Path(path).read_text())["model"]] = path
    workdir = Path(a.workdir)
    profiles = {m: ensure_profile(m, given, workdir) for m in sorted({s.model for s in specs})}
    rows, started = [], time.perf_counter()
    for n, spec in enumerate(specs, 1):
        runs: dict[str, list[dict]] = {"torch": [], "sim": []}
        for _ in range(repeat):  # alternate, so a slow spell of the machine hits both
            for executor in ("torch", "sim"):
                device = f"measured:{profiles[spec.model]}"
                extra = (("--sim-device", device, *(() if a.sleep else ("--sim-burn",)))
                         if executor == "sim" else ())  # fmt: skip
                cell = Cell(spec.workload, a.concurrency, "R4",
                            ("--executor", executor, *spec.args(a), *extra), ranks=spec.stages)
                runs[executor].append(run_cell(cell, spec.stages, a.timeout))
        rows.append(row(spec, runs["torch"], runs["sim"], burned=not a.sleep))
        r = rows[-1]
        print(f"[{n}/{len(specs)} {time.perf_counter() - started:.0f} s] {spec.name}: "
              f"tok/s {r['predicted_tok_s']:,.0f} predicted, {r['measured_tok_s']:,.0f} "
              f"measured; p50 {r['predicted_p50_s']:.3f} / {r['measured_p50_s']:.3f} s",
              file=sys.stderr)  # fmt: skip
    print(table(rows), flush=True)
    if a.json:
        record = {"command": "python -m benchmarks.validate " + " ".join(argv or sys.argv[1:]),
                  "profiles": profiles, "sim_burn": not a.sleep, "repeat": repeat,
                  "run_spread": run_spread(rows),
                  "rows": rows}  # fmt: skip
        Path(a.json).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {a.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
