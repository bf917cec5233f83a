"""``python -m benchmarks``: the paper's experiment matrix, one torchrun per cell.

Runs (workload x concurrency x rung) cells of a preset, ``--repeat N`` times each,
appends one JSON line per run to the results file (top-level ``workload``,
``concurrency``, ``rung``, ``planner``, ``repeat``, ``throughput_tok_s`` and the rest of
the run's record), skips runs the file already holds (so a half-done matrix resumes),
shows progress, and prints the tables in the paper's form: the median throughput per
cell with its spread, Δ% against R1 and against the oracle, and the median completion
p50.

The oracle is free admission with the best planner for the cell: it runs once with each
planner (``static``, ``mpu``, ``cost``), and the tables take the one with the highest
median throughput, labelled with the planner that won (``oracle[cost]``). Every Δ-vs-oracle
column is against it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs

RUNGS = ("R1", "R2", "R3", "R4", "R5", "oracle")
ORACLE_PLANNERS = ("static", "mpu", "cost")
_RUNG_PLANNER = {
    "R1": "static",
    "R2": "static",
    "R3": "static",
    "R4": "mpu",
    "R5": "cost",
    "oracle": "mpu",
}  # fmt: skip  (wavepp.rungs, without importing the runtime)


@attrs.frozen
class Cell:
    workload: str  # a label: the workload and its shape, e.g. "cold-65k"
    concurrency: int
    rung: str
    args: tuple[str, ...]  # wavepp.main options besides --concurrency and --rung
    planner: str | None = None  # --planner override (the oracle runs once per planner)
    repeat: int = 0  # which of the --repeat runs (0-based)
    ranks: int | None = None  # pipeline stages, when the cell differs from its preset's

    def key(self, preset: str) -> str:
        extra = " ".join(self.args)
        key = f"{preset}|{self.workload}|{self.concurrency}|{self.rung}|{extra}"
        if self.planner:
            key += f"|planner={self.planner}"
        if self.ranks:
            key += f"|P={self.ranks}"
        return key + (f"|#{self.repeat}" if self.repeat else "")

    @property
    def effective_planner(self) -> str:
        return self.planner or _RUNG_PLANNER.get(self.rung, "?")


def _sim(*extra: str) -> tuple[str, ...]:
    return ("--executor", "sim", *extra)


def preset_cells(name: str, workdir: Path | None = None) -> tuple[int, list[Cell]]:
    """(ranks, cells) of a preset; oracle cells once per planner, no repeats yet.
    ``workdir``: where presets that replay generated traces write them (default: cwd)."""
    cells: list[Cell] = []

    def add(label: str, concurrencies, rungs, args, ranks: int | None = None) -> None:
        for c in concurrencies:
            for rung in rungs:
                if rung == "oracle":
                    for planner in ORACLE_PLANNERS:
                        cells.append(Cell(label, c, rung, tuple(args), planner, ranks=ranks))
                else:
                    cells.append(Cell(label, c, rung, tuple(args), ranks=ranks))

    if name == "smoke":  # about 3 minutes here per repeat of R3, R4, R5 and the oracle
        # Each run measures 0.9-3 s of simulated prefill: in runs under a second, two
        # runs of the same plan differed by 2% here (start-up and drain jitter).
        add("cold-8k", [16], RUNGS, _sim("--workload", "cold", "--prompt-tokens", "8192",
                                         "--requests", "128"))  # fmt: skip
        add("seeded-8k", [16], RUNGS, _sim("--workload", "seeded", "--prompt-tokens", "8192",
                                           "--requests", "192"))  # fmt: skip
        add("short-suffix-8k", [32], RUNGS, _sim("--workload", "short-suffix", "--prompt-tokens",
                                                 "8192", "--requests", "256"))  # fmt: skip
        return 4, cells
    if name == "paper":  # the paper's shapes, simulated (Qwen3-Next-80B on H200)
        cs = [1, 2, 4, 8, 16, 32, 64, 128]
        for tokens in (65_536, 131_072, 262_144):
            add(f"cold-{tokens // 1024}k", cs, RUNGS,
                _sim("--workload", "cold", "--prompt-tokens", str(tokens), "--requests", "64",
                     "--budget", "16384"))  # fmt: skip
        # 64 requests: 16 seeded prefixes of 117,952 tokens (29,488 blocks) fit the pool
        # (each stage's pool from H200 memory holds 55K blocks; wavepp.launch's
        # DatasheetBackend.default_pools).
        add("seeded-131k", cs, RUNGS, _sim("--workload", "seeded", "--prompt-tokens", "131072",
                                           "--requests", "64", "--budget", "16384"))  # fmt: skip
        add("mixed-131k-262k", cs, RUNGS,
            _sim("--workload", "mixed", "--prompt-tokens", "131072", "--cold-tokens", "262144",
                 "--requests", "64", "--budget", "16384"))  # fmt: skip
        add("short-suffix-4k", cs, RUNGS,
            _sim("--workload", "short-suffix", "--prompt-tokens", "131072", "--requests", "256",
                 "--budget", "16384"))  # fmt: skip
        return 4, cells
    if name == "paper-cells":  # the cells the paper reports, on its hardware and models
        cells.extend(paper_cells())
        return 4, cells
    if name == "retention":  # good-hit rate against arrival rate, open loop (paper §5.8)
        cells.extend(retention_cells(workdir or Path(".")))
        return 8, cells
    if name == "cpu":  # the real model at sizes this machine runs
        rungs = ("R1", "R3", "R4", "R5", "oracle")
        torch_args = ("--executor", "torch", "--model", "small-hybrid", "--budget", "1024",
                      "--block-size", "64")  # fmt: skip
        add("seeded-2k", [4], rungs, (*torch_args, "--workload", "seeded", "--prompt-tokens",
                                      "2048", "--requests", "16"))  # fmt: skip
        add("short-suffix-2k", [8], rungs, (*torch_args, "--workload", "short-suffix",
                                            "--prompt-tokens", "2048", "--suffix-tokens", "256",
                                            "--requests", "16"))  # fmt: skip
        return 2, cells
    raise SystemExit(f"unknown preset {name!r}: smoke, paper, paper-cells, retention or cpu")


def paper_cells() -> list[Cell]:
    """The paper's reported cells (its summary, §5.2–§5.9) in the simulator.

    Kimi-class cells: P = 8 GB300, NVFP4 (the paper's Kimi K3 runs, TP1 x PP8); GLM- and
    MiniMax-class cells: P = 4 B300, NVFP4 (its Table 1). ``--time-scale`` is set by the
    runner's option of that name (real seconds slept per simulated second).
    """
    kimi = ("--model", "kimi-k3-class", "--sim-device", "gb300", "--weight-format", "nvfp4",
            "--budget", "16384")  # fmt: skip
    cells: list[Cell] = []

    def add(label, c, rungs, args, ranks):
        for rung in rungs:
            planners = ORACLE_PLANNERS if rung == "oracle" else (None,)
            for planner in planners:
                cells.append(Cell(label, c, rung, _sim(*args), planner, ranks=ranks))

    ladder = ("R1", "R2", "R3", "R4", "R5", "oracle")
    add(
        "kimi-cold-131k",
        16,
        ladder,
        (*kimi, "--workload", "cold", "--prompt-tokens", "131072", "--requests", "32"),
        8,
    )
    add(
        "kimi-reuse-131k",
        8,
        ladder,
        (*kimi, "--workload", "seeded", "--prompt-tokens", "131072", "--requests", "32"),
        8,
    )
    add(
        "kimi-reuse-262k",
        32,
        ladder,
        (*kimi, "--workload", "seeded", "--prompt-tokens", "262144", "--requests", "64"),
        8,
    )
    add("kimi-mixed-131k-262k", 32, ladder,
        (*kimi, "--workload", "mixed", "--prompt-tokens", "131072", "--cold-tokens", "262144",
         "--requests", "64"), 8)  # fmt: skip
    for model, device in (("glm5-class", "b300"), ("minimax-m2-class", "b300")):
        add(f"{model.split('-')[0]}-short-suffix-4k", 128, ("R1", "R3", "R4", "R5", "oracle"),
            ("--model", model, "--sim-device", device, "--weight-format", "nvfp4",
             "--workload", "short-suffix", "--prompt-tokens", "16384", "--requests", "256",
             "--budget", "16384"), 4)  # fmt: skip
    return cells


RETENTION_RATES = (2.0, 8.0, 32.0)  # requests per simulated second


def retention_trace(path: Path, rate: float, seed: int = 0, documents: int = 24,
                    doc_blocks: int = 64, suffix_blocks: int = 4,
                    requests: int = 120) -> Path:  # fmt: skip
    """A Mooncake-format trace for the retention experiment, written to ``path``: requests
    arrive as a Poisson process of ``rate`` per second, each extends one of ``documents``
    documents (``doc_blocks`` blocks of 512 tokens, the first request of a document
    prefills it) by a new suffix of ``suffix_blocks`` blocks. Later requests of a document
    expect to reuse it; whether it is still cached when they arrive is the good-hit rate."""
    import numpy as np

    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, requests)
    docs = rng.integers(0, documents, requests)
    lines, t, fresh = [], 0.0, documents * doc_blocks
    for gap, doc in zip(gaps, docs, strict=True):
        t += gap
        ids = [int(doc) * doc_blocks + k for k in range(doc_blocks)]
        ids += list(range(fresh, fresh + suffix_blocks))
        fresh += suffix_blocks
        lines.append(json.dumps({"timestamp": round(t * 1000, 3),
                                 "input_length": len(ids) * 512, "hash_ids": ids}))  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def retention_cells(workdir: Path) -> list[Cell]:
    """Kimi-class, P = 8 GB300: the retention trace at each rate, R1 (eager reservation on
    the execution path) against R4; a pool of two thirds of the documents' blocks (8,192 of
    12,288), so arrivals and the room they reserve compete with the cached documents."""
    cells = []
    for rate in RETENTION_RATES:
        trace = retention_trace(workdir / "traces" / f"retention-{rate:g}.jsonl", rate)
        args = _sim("--model", "kimi-k3-class", "--sim-device", "gb300", "--workload", "trace",
                    "--trace", str(trace), "--open-loop", "--requests", "120",
                    "--capacity-blocks", "8192", "--budget", "16384")  # fmt: skip
        for rung in ("R1", "R4"):
            cells.append(Cell(f"retention-{rate:g}rps", 1, rung, args, ranks=8))
    return cells


def load_results(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows


def run_cell(cell: Cell, ranks: int, timeout: float, extra: tuple[str, ...] = ()) -> dict:
    planner = ("--planner", cell.planner) if cell.planner else ()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={cell.ranks or ranks}", "-m", "wavepp.main", *cell.args,
               *extra, "--concurrency", str(cell.concurrency), "--rung", cell.rung, *planner,
               "--no-progress", "--json", str(out)]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"cell {cell} failed:\n{proc.stderr[-3000:]}")
        record = json.loads(out.read_text())
        warnings = [line for line in proc.stderr.splitlines() if "thrash" in line]
    # Per-request rows are large; keep only their completion times (for the CDF plots).
    requests = record.pop("requests", [])
    record["completion_times_s"] = [q["completion_s"] for q in requests if q["completion_s"]]
    record["planner"] = cell.effective_planner
    record["repeat"] = cell.repeat
    if warnings:
        record["warnings"] = warnings
    return record


def fmt_delta(value: float | None, base: float | None) -> str:
    if value is None or not base:
        return "   —  "
    return f"{(value / base - 1) * 100:+6.1f}%"


def _label(row: dict) -> str:
    return row.get("workload_label", row.get("workload", "?"))


def row_planner(row: dict) -> str:
    """The planner a recorded run used (older rows: the --planner override or the rung's)."""
    return (
        row.get("planner")
        or (row.get("config") or {}).get("planner")
        or _RUNG_PLANNER.get(row["rung"], "?")
    )


@attrs.frozen
class Summary:
    """The runs of one (workload, concurrency, rung[, planner]): medians and spread."""

    throughput: float  # median tok/s
    low: float  # least tok/s of the runs
    high: float  # most tok/s of the runs
    p50_s: float  # median of the runs' completion p50
    runs: int
    planner: str
    good_hit: float | None  # median good-hit rate

    @property
    def spread(self) -> float:
        """(max - min) / median, as a share."""
        return (self.high - self.low) / self.throughput if self.throughput else 0.0


def summarize_runs(rows: list[dict]) -> Summary:
    tput = [r["throughput_tok_s"] for r in rows]
    hits = [r["good_hit_rate"] for r in rows if r.get("good_hit_rate") is not None]
    return Summary(
        statistics.median(tput), min(tput), max(tput),
        statistics.median(r.get("completion_p50_s") or 0.0 for r in rows), len(rows),
        row_planner(rows[0]), statistics.median(hits) if hits else None,
    )  # fmt: skip


def cell_summaries(rows: list[dict]) -> dict[tuple[str, int], dict[str, Summary]]:
    """(workload, c) -> rung -> Summary; the oracle as ``oracle`` (the best planner's) and
    each planner's as ``oracle[<planner>]``."""
    groups: dict[tuple[str, int, str], list[dict]] = {}
    for r in rows:
        rung = r["rung"]
        if rung == "oracle":
            rung = f"oracle[{row_planner(r)}]"
        groups.setdefault((_label(r), r["concurrency"], rung), []).append(r)
    out: dict[tuple[str, int], dict[str, Summary]] = {}
    for (label, c, rung), runs in groups.items():
        out.setdefault((label, c), {})[rung] = summarize_runs(runs)
    for summaries in out.values():
        oracles = [s for name, s in summaries.items() if name.startswith("oracle[")]
        if oracles:
            summaries["oracle"] = max(oracles, key=lambda s: s.throughput)
    return out


def tables(rows: list[dict], preset: str | None = None) -> str:
    """Per workload: median throughput per (concurrency, rung) ± spread, Δ vs R1 and vs the
    true oracle (best planner), median p50; then the acceptance ratios per cell."""
    rows = [r for r in rows if preset is None or r.get("preset") == preset]
    summaries = cell_summaries(rows)
    out = []
    width = 44
    for workload in sorted({label for label, _ in summaries}):
        sub = [r for r in rows if _label(r) == workload]
        cells = {c: s for (label, c), s in summaries.items() if label == workload}
        rungs = [g for g in RUNGS if any(g in s for s in cells.values())]
        sim = " (SIMULATED)" if any(r.get("simulated") for r in sub) else ""
        runs = max(s.runs for cs in cells.values() for s in cs.values())
        out.append(f"\n{workload}{sim}: median throughput tok/s ±spread (max−min over median, "
                   f"{runs} runs)  [Δ vs R1 | Δ vs oracle]  p50 s")  # fmt: skip
        out.append("    c  " + "".join(f"{g:>{width}}" for g in rungs))
        for c in sorted(cells):
            cell = cells[c]
            base, oracle = cell.get("R1"), cell.get("oracle")
            line = f"{c:>5}  "
            for g in rungs:
                s = cell.get(g)
                if s is None:
                    line += f"{'—':>{width}}"
                    continue
                line += (
                    f"{s.throughput:>12,.0f} ±{s.spread * 100:4.1f}% "
                    f"[{fmt_delta(s.throughput, base and base.throughput)}|"
                    f"{fmt_delta(s.throughput, oracle and oracle.throughput)}] "
                    f"{s.p50_s:>6.2f}"
                )
            out.append(line)
            if oracle is not None:
                each = ", ".join(f"{name[7:-1]} {s.throughput:,.0f}" for name, s in
                                 sorted(cell.items()) if name.startswith("oracle["))  # fmt: skip
                out.append(f"       oracle = oracle[{oracle.planner}] (per planner: {each})")
    checks = acceptance(summaries)
    if checks:
        out.append("\nacceptance (medians): R5 vs max(R3, R4) | R5 / oracle | "
                   "R4 / oracle[mpu]")  # fmt: skip
        out.extend(checks)
    return "\n".join(out)


def acceptance(summaries: dict[tuple[str, int], dict[str, Summary]]) -> list[str]:
    """Issue 15's bars per cell: R5 ≥ max(R3, R4) − 1%, R5 ≥ 95% of the oracle, R4 ≥ 95%
    of the oracle run with MPU."""
    lines = []
    for (label, c), cell in sorted(summaries.items()):
        r5, oracle, omp = cell.get("R5"), cell.get("oracle"), cell.get("oracle[mpu]")
        best = max((cell[g].throughput for g in ("R3", "R4") if g in cell), default=None)
        parts = []
        if r5 and best:
            d = r5.throughput / best - 1
            parts.append(f"R5 {d * 100:+.1f}% {'ok' if d >= -0.01 else 'FAIL'}")
        if r5 and oracle:
            q = r5.throughput / oracle.throughput
            parts.append(f"R5/oracle {q * 100:.1f}% {'ok' if q >= 0.95 else 'FAIL'}")
        if cell.get("R4") and omp:
            q = cell["R4"].throughput / omp.throughput
            parts.append(f"R4/oracle[mpu] {q * 100:.1f}% {'ok' if q >= 0.95 else 'FAIL'}")
        if parts:
            lines.append(f"  {label} c={c}: " + " | ".join(parts))
    return lines


def expand(cells: list[Cell], repeat: int) -> list[Cell]:
    """Each cell ``repeat`` times, repeat-major (a stopped run leaves whole sweeps)."""
    return [attrs.evolve(c, repeat=i) for i in range(repeat) for c in cells]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--preset", default="smoke", choices=("smoke", "paper", "paper-cells", "retention", "cpu")
    )
    p.add_argument("--out", default="results.jsonl", help="results file (appended; resumes)")
    p.add_argument("--only", default="", help="run only workloads whose label contains this")
    p.add_argument("--rungs", default="", help="comma list: only these rungs")
    p.add_argument("--concurrency", default="", help="comma list: only these concurrencies")
    p.add_argument("--repeat", type=int, default=1, help="runs per cell (tables show medians)")
    p.add_argument(
        "--time-scale", type=float, default=None,
        help="sim cells: real seconds slept per simulated second (< 1 shrinks the runs; the "
        "runtime's own overheads — admission, Python, Gloo — stay real, so they weigh more)",
    )  # fmt: skip
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--dry-run", action="store_true", help="list the runs and exit")
    p.add_argument("--tables", action="store_true", help="print the tables of --out and exit")
    p.add_argument(
        "--extra", default="",
        help="options appended to every cell, e.g. '--requests 64' (they override the "
        "preset's and are recorded in each config)",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.repeat < 1:
        raise SystemExit(f"--repeat must be ≥ 1, got {args.repeat}")
    out = Path(args.out)
    if args.tables:
        print(tables(load_results(out), args.preset))
        return
    ranks, cells = preset_cells(args.preset, out.parent)
    extra = args.extra.split()
    if args.time_scale is not None:
        extra += ["--time-scale", str(args.time_scale)]
    if extra:
        cells = [attrs.evolve(c, args=(*c.args, *extra)) for c in cells]
    if args.only:
        cells = [c for c in cells if args.only in c.workload]
    if args.rungs:
        keep = set(args.rungs.split(","))
        cells = [c for c in cells if c.rung in keep]
    if args.concurrency:
        wanted = {int(x) for x in args.concurrency.split(",")}
        cells = [c for c in cells if c.concurrency in wanted]
    cells = expand(cells, args.repeat)
    done = {r.get("cell_key") for r in load_results(out)}
    todo = [c for c in cells if c.key(args.preset) not in done]
    sizes = sorted({c.ranks or ranks for c in todo}) or [ranks]
    print(f"preset {args.preset}: {len(cells)} runs, {len(cells) - len(todo)} already in {out}, "
          f"{len(todo)} to run on {' or '.join(map(str, sizes))} ranks", flush=True)  # fmt: skip
    if args.dry_run:
        for cell in todo:
            planner = f" --planner {cell.planner}" if cell.planner else ""
            print(f"  {cell.workload} c={cell.concurrency} {cell.rung}{planner} #{cell.repeat} "
                  f"on {cell.ranks or ranks} ranks: {' '.join(cell.args)}")  # fmt: skip
        return
    started = time.time()
    for i, cell in enumerate(todo, 1):
        t0 = time.time()
        record = run_cell(cell, ranks, args.timeout)
        record.update(preset=args.preset, workload_label=cell.workload,
                      cell_key=cell.key(args.preset))  # fmt: skip
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")
        eta = (time.time() - started) / i * (len(todo) - i)
        planner = f"[{cell.planner}]" if cell.planner else ""
        print(f"[{i}/{len(todo)}] {cell.workload} c={cell.concurrency} {cell.rung}{planner} "
              f"#{cell.repeat}: {record['throughput_tok_s']:,.0f} tok/s in "
              f"{time.time() - t0:.1f} s (eta {eta:.0f} s)", flush=True)  # fmt: skip
    print(tables(load_results(out), args.preset))


if __name__ == "__main__":
    main()
