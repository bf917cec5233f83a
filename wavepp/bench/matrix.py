"""``python -m wavepp.bench``: the paper's experiment matrix, one torchrun per cell.

Runs (workload x concurrency x rung) cells of a preset, appends one JSON line per run
to the results file (top-level ``workload``, ``concurrency``, ``rung``,
``throughput_tok_s`` and the rest of the run's record), skips cells the file already
holds (so a half-done matrix resumes), shows progress, and prints the tables in the
paper's form: throughput per cell with Δ% against R1 and against the oracle, and
completion p50.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs

RUNGS = ("R1", "R2", "R3", "R4", "R5", "oracle")


@attrs.frozen
class Cell:
    workload: str  # a label: the workload and its shape, e.g. "cold-65k"
    concurrency: int
    rung: str
    args: tuple[str, ...]  # wavepp.main options besides --concurrency and --rung

    def key(self, preset: str) -> str:
        extra = " ".join(self.args)
        return f"{preset}|{self.workload}|{self.concurrency}|{self.rung}|{extra}"


def _sim(*extra: str) -> tuple[str, ...]:
    return ("--executor", "sim", *extra)


def preset_cells(name: str) -> tuple[int, list[Cell]]:
    """(ranks, cells) of a preset."""
    cells: list[Cell] = []

    def add(label: str, concurrencies, rungs, args) -> None:
        for c in concurrencies:
            for rung in rungs:
                cells.append(Cell(label, c, rung, tuple(args)))

    if name == "smoke":  # about 3 minutes here
        add("cold-8k", [16], RUNGS, _sim("--workload", "cold", "--prompt-tokens", "8192",
                                         "--requests", "32"))  # fmt: skip
        add("seeded-8k", [16], RUNGS, _sim("--workload", "seeded", "--prompt-tokens", "8192",
                                           "--requests", "48"))  # fmt: skip
        add("short-suffix-8k", [32], RUNGS, _sim("--workload", "short-suffix", "--prompt-tokens",
                                                 "8192", "--requests", "64"))  # fmt: skip
        return 4, cells
    if name == "paper":  # the paper's shapes, simulated
        cs = [1, 2, 4, 8, 16, 32, 64, 128]
        for tokens in (65_536, 131_072, 262_144):
            add(f"cold-{tokens // 1024}k", cs, RUNGS,
                _sim("--workload", "cold", "--prompt-tokens", str(tokens), "--requests", "64",
                     "--budget", "16384"))  # fmt: skip
        add("seeded-131k", cs, RUNGS, _sim("--workload", "seeded", "--prompt-tokens", "131072",
                                           "--requests", "128", "--budget", "16384"))  # fmt: skip
        add("mixed-131k-262k", cs, RUNGS,
            _sim("--workload", "mixed", "--prompt-tokens", "131072", "--cold-tokens", "262144",
                 "--requests", "64", "--budget", "16384"))  # fmt: skip
        add("short-suffix-4k", cs, RUNGS,
            _sim("--workload", "short-suffix", "--prompt-tokens", "131072", "--requests", "256",
                 "--budget", "16384"))  # fmt: skip
        return 4, cells
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
    raise SystemExit(f"unknown preset {name!r}: smoke, paper or cpu")


def load_results(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows


def run_cell(cell: Cell, ranks: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={ranks}", "-m", "wavepp.main", *cell.args,
               "--concurrency", str(cell.concurrency), "--rung", cell.rung,
               "--no-progress", "--json", str(out)]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"cell {cell} failed:\n{proc.stderr[-3000:]}")
        record = json.loads(out.read_text())
    # Per-request rows are large; keep only their completion times (for the CDF plots).
    requests = record.pop("requests", [])
    record["completion_times_s"] = [q["completion_s"] for q in requests if q["completion_s"]]
    return record


def fmt_delta(value: float | None, base: float | None) -> str:
    if value is None or not base:
        return "   —  "
    return f"{(value / base - 1) * 100:+6.1f}%"


def tables(rows: list[dict], preset: str | None = None) -> str:
    """Per workload: throughput per (concurrency, rung) with Δ vs R1 and vs oracle."""
    rows = [r for r in rows if preset is None or r.get("preset") == preset]
    out = []
    for workload in sorted({r["workload_label"] for r in rows}):
        sub = [r for r in rows if r["workload_label"] == workload]
        rungs = [g for g in RUNGS if any(r["rung"] == g for r in sub)]
        sim = " (SIMULATED)" if any(r.get("simulated") for r in sub) else ""
        out.append(f"\n{workload}{sim}: throughput tok/s  [Δ vs R1 | Δ vs oracle]  p50 s")
        out.append("    c  " + "".join(f"{g:>34}" for g in rungs))
        for c in sorted({r["concurrency"] for r in sub}):
            cell = {r["rung"]: r for r in sub if r["concurrency"] == c}
            base, oracle = cell.get("R1"), cell.get("oracle")
            line = f"{c:>5}  "
            for g in rungs:
                r = cell.get(g)
                if r is None:
                    line += f"{'—':>34}"
                    continue
                t = r["throughput_tok_s"]
                line += (
                    f"{t:>12,.0f} [{fmt_delta(t, base and base['throughput_tok_s'])}|"
                    f"{fmt_delta(t, oracle and oracle['throughput_tok_s'])}] "
                    f"{r['completion_p50_s'] or 0:>5.2f}"
                )
            out.append(line)
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m wavepp.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--preset", default="smoke", choices=("smoke", "paper", "cpu"))
    p.add_argument("--out", default="results.jsonl", help="results file (appended; resumes)")
    p.add_argument("--only", default="", help="run only workloads whose label contains this")
    p.add_argument("--concurrency", default="", help="comma list: only these concurrencies")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per cell")
    p.add_argument("--dry-run", action="store_true", help="list the cells and exit")
    p.add_argument(
        "--extra", default="",
        help="options appended to every cell, e.g. '--requests 64' (they override the "
        "preset's and are recorded in each config)",
    )  # fmt: skip
    args = p.parse_args(argv)
    ranks, cells = preset_cells(args.preset)
    if args.extra:
        cells = [attrs.evolve(c, args=(*c.args, *args.extra.split())) for c in cells]
    if args.only:
        cells = [c for c in cells if args.only in c.workload]
    if args.concurrency:
        wanted = {int(x) for x in args.concurrency.split(",")}
        cells = [c for c in cells if c.concurrency in wanted]
    out = Path(args.out)
    done = {r["cell_key"] for r in load_results(out)}
    todo = [c for c in cells if c.key(args.preset) not in done]
    print(f"preset {args.preset}: {len(cells)} cells, {len(cells) - len(todo)} already in {out}, "
          f"{len(todo)} to run on {ranks} ranks", flush=True)  # fmt: skip
    if args.dry_run:
        for cell in todo:
            print(f"  {cell.workload} c={cell.concurrency} {cell.rung}: {' '.join(cell.args)}")
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
        print(f"[{i}/{len(todo)}] {cell.workload} c={cell.concurrency} {cell.rung}: "
              f"{record['throughput_tok_s']:,.0f} tok/s in {time.time() - t0:.1f} s "
              f"(eta {eta:.0f} s)", flush=True)  # fmt: skip
    print(tables(load_results(out), args.preset))


if __name__ == "__main__":
    main()
