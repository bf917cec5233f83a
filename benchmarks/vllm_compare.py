"""WavePP against vLLM CPU, like for like, by the protocol written in docs/benchmarks.md
(section "Against vLLM CPU"), fixed before the runs.

Models: the 4-layer test Llama (``llama-4l``) and a deep one with a ~0.5B model's shapes
(``llama-24l``: 24 layers, hidden 896, 14 / 2 heads, MLP 4,864), random weights written
once as a Hugging Face directory that both engines load (``--models-dir`` keeps it).
For each model and dtype:
1. the GEMM peak (``benchmarks.peak``, fp32 or bf16, 1 thread and all cores);
2. the settings sweep, on a tuning row no measured row uses: vLLM over
   ``max_num_batched_tokens`` 2K/4K/8K x block size 32/64/128 (one engine each), WavePP
   over its wave budget 1K/2K/4K at P = 1 and at P = 2; each setting ``--tune-repeats``
   calls, the highest mean kept (a tie: the one listed first, each engine's default);
3. the rows (cold 4K and 16K, 90%-shared 8K, short-suffix), ``--repeats`` rounds: in
   each, a row's systems run back to back in alternating order (vLLM; WavePP P = 1 and
   P = 2 with the last layer for every token; the same with the rows-only last layer),
   every call preceded by its untimed seeds and warm-up on the row's shapes;
4. the peak again.
Per row: each system's mean tok/s (input tokens, cached included, over the timed call),
tok/s a core, FLOP/s against the peak, and WavePP over vLLM as the ratio of means with a
paired bootstrap 95% interval. vLLM runs in its own venv (``--vllm-python``, default
``$WAVEPP_VLLM_PYTHON``; ``.ci/vllm-venv`` builds one) with TCMalloc and Intel OpenMP
preloaded where found, its OpenMP threads bound to the cores; WavePP as it ships.

    python -m benchmarks.vllm_compare --models llama-24l --dtypes float32 \\
        --models-dir /tmp/wavepp-compare-models --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

from benchmarks._compare_engines import VllmEngine, run_wavepp, vllm_preloads
from benchmarks._compare_rows import MODELS, ROWS, TUNE_ROWS, Prompts, Row, prompts, row_flops
from benchmarks._compare_rows import write_checkpoint as _write
from benchmarks._compare_summary import (
    HEADLINE,
    ROWS_ONLY,
    choose_setting,
    first_token_differences,
    missing_fields,
    print_table,
    summarize,
)
from benchmarks._stats import emit
from wavepp.host import usable_cores

PROTOCOL = "vllm-compare/1 (docs/benchmarks.md, Against vLLM CPU)"
# Each engine's own default first: a tie goes to it.
VLLM_GRID = [{"max_num_batched_tokens": t, "block_size": b}
             for t in (4096, 2048, 8192) for b in (128, 32, 64)]  # fmt: skip
WAVEPP_BUDGETS = (2048, 1024, 4096)
WAVEPP_BLOCK = 16  # WavePP's default block size, fixed
# Seconds between two calls: vLLM's OpenMP threads spin on after a call (Intel OpenMP's
# block time), and a call right after one would share the cores with them.
SETTLE_S = 3.0


def smoke_row(row: Row) -> Row:
    """A row cut down to check the driver end to end (never a result): 1/16 of the
    tokens, at most four prompts."""
    return replace(row, num_tokens=max(256, row.num_tokens // 16),
                   num_prompts=min(row.num_prompts, 4))  # fmt: skip


def ensure_checkpoint(name: str, models_dir: Path) -> Path:
    """The model's directory, written once (a shape file beside it says which)."""
    path, shape = models_dir / name, asdict(MODELS[name])
    mark = path / "wavepp-compare-shape.json"
    if not (mark.exists() and json.loads(mark.read_text()) == shape):
        _write(MODELS[name], path)
        mark.write_text(json.dumps(shape))
    return path


def measure_peak(dtype: str, cores: int, tmp: Path, smoke: bool) -> dict:
    out = tmp / "peak.json"
    cmd = [sys.executable, "-m", "benchmarks.peak", "--threads", f"1,{cores}" if cores > 1
           else "1", "--dtypes", dtype, "--json", str(out),
           *(["--repeats", "2", "--warmup", "1"] if smoke else [])]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=1800,
                   cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    return json.loads(out.read_text())


def git_commit() -> str:
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+uncommitted changes" if dirty else "")


class Run:
    """One invocation: the engines' common settings and the record being built."""

    def __init__(self, args, tmp: Path) -> None:
        self.args, self.tmp, self.cores = args, tmp, args.cores
        self.preloads = vllm_preloads(args.vllm_python)
        self.calls = 0

    def vllm(self, ckpt: Path, model: str, dtype: str, setting: dict, rows) -> VllmEngine:
        max_len = max(r.num_tokens for r in rows) + 64
        return VllmEngine(self.args.vllm_python, ckpt, MODELS[model], dtype, setting, max_len,
                          f"0-{self.cores - 1}", self.args.vllm_kv_gib, self.preloads,
                          self.tmp)  # fmt: skip

    def wavepp(self, ckpt: Path, job: Prompts, system: str, dtype: str, budget: int) -> dict:
        self.calls += 1
        stages = 2 if system.startswith("wavepp_p2") else 1
        return run_wavepp(ckpt, job, stages, max(1, self.cores // stages), dtype, budget,
                          system not in ROWS_ONLY, WAVEPP_BLOCK, self.tmp,
                          f"{system}-{self.calls}")  # fmt: skip

    def sweep(self, ckpt: Path, model: str, dtype: str, tune: Row) -> tuple[dict, dict]:
        """Each engine's settings on the tuning row, by the same rule."""
        job, reps = prompts(tune, MODELS[model].vocab), self.args.tune_repeats
        vllm_trials = []
        for setting in VLLM_GRID[: self.args.vllm_settings]:
            engine = self.vllm(ckpt, model, dtype, setting, [tune])
            try:
                figures = [_settled(engine.run, job)["tok_s"] for _ in range(reps)]
            finally:
                engine.close()
            vllm_trials.append({"setting": setting, "tok_s": figures})
            log(f"  sweep vLLM {setting}: {figures}")
        wavepp_trials = {}
        for system in HEADLINE:
            trials = []
            for budget in WAVEPP_BUDGETS[: self.args.wavepp_settings]:
                figures = [_settled(self.wavepp, ckpt, job, system, dtype, budget)["tok_s"]
                           for _ in range(reps)]  # fmt: skip
                trials.append({"setting": {"budget": budget}, "tok_s": figures})
                log(f"  sweep WavePP {system} budget {budget}: {figures}")
            wavepp_trials[system] = trials
        return {"trials": vllm_trials}, wavepp_trials


def _settled(call, *args):
    time.sleep(SETTLE_S)
    return call(*args)


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_model(run: Run, model: str, dtype: str, record: dict) -> None:
    args, shape = run.args, MODELS[model]
    ckpt = ensure_checkpoint(model, Path(args.models_dir))
    rows = {name: ROWS[model][name] for name in args.rows.split(",")}
    tune = TUNE_ROWS[model]
    if args.smoke:
        rows, tune = {k: smoke_row(v) for k, v in rows.items()}, smoke_row(tune)
    key = f"{model}/{dtype}"
    record["rows"][key] = {name: asdict(row) for name, row in rows.items()}
    record["peak"].append({"model": model, "dtype": dtype, "when": "before",
                           **measure_peak(dtype, run.cores, run.tmp, args.smoke)})  # fmt: skip
    log(f"{key}: sweeping settings on the tuning row {tune}")
    vllm_sweep, wavepp_sweep = run.sweep(ckpt, model, dtype, tune)
    vllm_setting = choose_setting(vllm_sweep["trials"])
    budgets = {s: choose_setting(t)["budget"] for s, t in wavepp_sweep.items()}
    budgets.update({rows: budgets[full] for rows, full in zip(ROWS_ONLY, HEADLINE, strict=True)})
    record["vllm"]["settings"][key], record["vllm"]["sweep"][key] = vllm_setting, vllm_sweep
    record["wavepp"]["settings"][key] = {"budget": budgets, "block_size": WAVEPP_BLOCK}
    record["wavepp"]["sweep"][key] = wavepp_sweep
    log(f"{key}: vLLM {vllm_setting}, WavePP budgets {budgets}")
    systems = ["vllm", *HEADLINE, *(ROWS_ONLY if args.rows_only else ())]
    engine = run.vllm(ckpt, model, dtype, vllm_setting, list(rows.values()))
    try:
        record["versions"].update(vllm=engine.ready["vllm"], vllm_torch=engine.ready["torch"])
        record["vllm"]["attention_isa"][key] = engine.ready["attention_isa"]
        for rep in range(args.repeats):
            for i, (name, row) in enumerate(rows.items()):
                job = prompts(row, shape.vocab)
                lengths = [len(p) for p in job.measured]
                entry: dict = {"model": model, "dtype": dtype, "row": name, "repeat": rep,
                               "systems": {}}  # fmt: skip
                # back to back, alternating: this machine's speed drifts within minutes
                for system in systems if (rep + i) % 2 == 0 else systems[::-1]:
                    time.sleep(SETTLE_S)
                    before = engine.cpu_seconds() if system != "vllm" else None
                    got = (engine.run(job) if system == "vllm"
                           else run.wavepp(ckpt, job, system, dtype, budgets[system]))  # fmt: skip
                    if before is not None:  # vLLM's engine must sit idle meanwhile
                        got["vllm_idle_cpu_s"] = engine.cpu_seconds() - before
                    got["flops"] = row_flops(shape, lengths, got["cached_tokens"],
                                             system not in ROWS_ONLY)  # fmt: skip
                    entry["systems"][system] = got
                firsts = {k: v.pop("first_tokens") for k, v in entry["systems"].items()}
                gaps = entry["systems"]["vllm"].pop("top2_gaps")
                entry["first_tokens_differ"] = first_token_differences(firsts, gaps)
                record["results"].append(entry)
                log(f"{model} {dtype} {name} repeat {rep}: " + ", ".join(
                    f"{s} {g['tok_s']:,.0f} tok/s" for s, g in entry["systems"].items()))
        record["vllm"]["log"][key] = engine.log_lines()
    finally:
        engine.close()
    record["peak"].append({"model": model, "dtype": dtype, "when": "after",
                           **measure_peak(dtype, run.cores, run.tmp, args.smoke)})  # fmt: skip


def new_record(args) -> dict:
    import torch

    import wavepp

    cores = args.cores
    return {
        "benchmark": "vllm_compare", "protocol": PROTOCOL, "smoke": args.smoke,
        "git_commit": git_commit(), "cores": cores, "cpu": _cpu_model(),
        "models": {m: asdict(MODELS[m]) for m in args.models.split(",")},
        "dtypes": args.dtypes.split(","), "repeats": args.repeats, "rows": {},
        "versions": {"wavepp": wavepp.__version__,
                     "torch": torch.__version__, "vllm": None, "vllm_torch": None},
        "vllm": {"attention_backend": None, "attention_isa": {}, "threads": cores,
                 "pinning": f"VLLM_CPU_OMP_THREADS_BIND=0-{cores - 1} (one thread a core)",
                 "preload": preloaded(vllm_preloads(args.vllm_python)),
                 "kv_cache_gib": args.vllm_kv_gib, "settings": {}, "sweep": {}, "log": {}},
        "wavepp": {"attention_kernel": [], "isa": torch.backends.cpu.get_cpu_capability(),
                   "threads": {"p1": cores, "p2": max(1, cores // 2)},
                   "pinning": "none (the OS places each rank's threads)",
                   "preload": None, "settings": {}, "sweep": {}},
        "peak": [], "results": [],
    }  # fmt: skip


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def finish(record: dict) -> None:
    """What only the runs tell: WavePP's kernel as its ranks logged it, vLLM's backend
    as its log names it (vLLM CPU has one attention backend for these models)."""
    kernels = {k for r in record["results"] for s, g in r["systems"].items()
               if s != "vllm" for k in g.get("attention_kernel", [])}  # fmt: skip
    record["wavepp"]["attention_kernel"] = sorted(kernels)
    named = [line for lines in record["vllm"]["log"].values() for line in lines
             if "CPU_ATTN" in line or "attention backend" in line.lower()]  # fmt: skip
    record["vllm"]["attention_backend"] = (named[0] if named else "CPU_ATTN (vLLM CPU's backend "
                                           "for non-MLA models; its log did not name it)")


LOCAL_PATH = re.compile(r"(?:file://)?/(?:tmp|root|home|work|var/tmp)(?:/[^\s'\",)]*)?")
SYSTEM_PATH = re.compile(r"(?<![\w>.-])/(?:usr|lib|lib64|opt)(?:/[^\s'\",)]*)*/[^/\s'\",)]+")
# a labelled path (``<vllm venv>/lib/libiomp5.so``) -> the label alone
LABELLED = re.compile(r"<([a-z ]+)>(?:/[^\s'\",)/]+)+")
# where in vLLM's source a log line was written (``[cpu_worker.py:260] ``)
SOURCE_TAG = re.compile(r"\[[\w.]+\.py:\d+\] ")
MODELS_DIR = "<models dir>"


def scrub(value, names: dict[str, str]):
    """``value`` (a record) naming no file or directory outside the repository: a model
    under the run's models directory by its name alone (``llama-24l``), any other file
    under one of ``names`` (vLLM's venv) or the system's directories as the label of
    where it was (``<vllm venv>``, ``<system>``), any other path under a temporary or
    home directory as ``<local path>``, and vLLM's log lines without the source file
    that wrote them."""
    if isinstance(value, dict):
        return {k: scrub(v, names) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub(v, names) for v in value]
    if isinstance(value, str):
        for path, label in names.items():  # a whole path's prefix, not a name's
            value = re.sub(re.escape(path) + r"(?=[/\s'\",)]|$)", label, value)
        value = value.replace(MODELS_DIR + "/", "")
        value = SYSTEM_PATH.sub("<system>", LOCAL_PATH.sub("<local path>", value))
        return SOURCE_TAG.sub("", LABELLED.sub(r"<\1>", value))
    return value


def preloaded(preloads: dict[str, str | None]) -> dict[str, str | None]:
    """What ``vllm_preloads`` found, by the package that ships it rather than its file."""
    what = {"tcmalloc": "TCMalloc (Debian's libtcmalloc-minimal4)",
            "iomp": "Intel OpenMP (pip intel-openmp, in vLLM's venv)"}  # fmt: skip
    return {k: what.get(k, k) if found else None for k, found in preloads.items()}


def local_names(args) -> dict[str, str]:
    """The run's own directories and the labels a record gives them, longest first."""
    names = {str(Path(args.vllm_python).resolve().parent.parent): "<vllm venv>",
             str(Path(args.vllm_python).parent.parent): "<vllm venv>",
             str(Path(args.models_dir).resolve()): MODELS_DIR,
             str(Path(args.models_dir)): MODELS_DIR}  # fmt: skip
    return dict(sorted(names.items(), key=lambda kv: -len(kv[0])))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vllm_compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--vllm-python", default=os.environ.get("WAVEPP_VLLM_PYTHON"),
                   help="python of a venv with vllm-cpu (default: $WAVEPP_VLLM_PYTHON)")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated: "
                   + ", ".join(MODELS))  # fmt: skip
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--rows", default="cold-4k,cold-16k,shared-8k,short-suffix")
    p.add_argument("--repeats", type=int, default=5, help="rounds over the rows (>= 5)")
    p.add_argument("--tune-repeats", type=int, default=2, help="timed calls a setting")
    p.add_argument("--rows-only", action=argparse.BooleanOptionalAction, default=True,
                   help="also WavePP with its rows-only last layer (reported apart)")
    p.add_argument("--models-dir", help="keep the written models here (default: a temp dir)")
    p.add_argument("--cores", type=int, default=usable_cores(), help="cores both engines use")
    p.add_argument("--vllm-kv-gib", type=int, default=4,
                   help="VLLM_CPU_KVCACHE_SPACE (the largest row needs about 2.2 GiB: "
                   "llama-24l fp32 shared-8k; vLLM's worker held 10 GiB at 8 and was "
                   "killed for memory on this 24 GiB machine)")  # fmt: skip
    p.add_argument("--smoke", action="store_true",
                   help="check the driver end to end: rows cut to 1/16, two settings each, "
                   "1 timed call a setting; the record says smoke (never a result)")  # fmt: skip
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if not args.vllm_python:
        p.error("--vllm-python (or WAVEPP_VLLM_PYTHON) is needed: the comparison is paired")
    for name in args.models.split(","):
        if name not in MODELS:
            p.error(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    unknown = [r for r in args.rows.split(",") if r not in ROWS["llama-4l"]]
    if unknown:
        p.error(f"unknown rows {', '.join(unknown)}; known: {', '.join(ROWS['llama-4l'])}")
    if args.repeats < 5 and not args.smoke:
        p.error("the protocol takes >= 5 repeats (--smoke for a check with fewer)")
    args.vllm_settings = 2 if args.smoke else len(VLLM_GRID)
    args.wavepp_settings = 2 if args.smoke else len(WAVEPP_BUDGETS)
    if args.smoke:
        args.tune_repeats = 1
    record = new_record(args)
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        args.models_dir = args.models_dir or str(tmp / "models")
        Path(args.models_dir).mkdir(parents=True, exist_ok=True)
        run = Run(args, tmp)
        for model in args.models.split(","):
            for dtype in args.dtypes.split(","):
                run_model(run, model, dtype, record)
    finish(record)
    record["summary"] = summarize(record["results"], args.cores, record["peak"])
    missing = missing_fields(record)
    if missing:
        log(f"the record lacks {', '.join(missing)}")
    print_table(record["summary"])
    emit(scrub(record, local_names(args)), args.json)


if __name__ == "__main__":
    main()
