"""Benchmark of the torch executor on this machine's CPU (issue: real executor).

1. ``kernel_ratio``: one stage holding every layer of ``small-llama`` prefills one prompt
   through the paged KV pool; Hugging Face ``transformers`` runs its own forward of the
   same weights on the same prompt. Ratio of throughputs (WavePP / transformers), each
   the median of several runs, one thread each, in the same process.
2. ``pp2_efficiency``: the whole runtime (torchrun, Gloo, admission, waves) on a cold
   workload with one stage (P=1) and with two (P=2, one core each):
   throughput(P=2) / (2 x throughput(P=1)) — 1.0 would be a perfect two-stage pipeline.

Needs ``transformers`` (the ``dev`` extra) for the first figure.
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

import numpy as np
import torch

from wavepp.bench._stats import emit
from wavepp.exec.base import ChunkWork
from wavepp.exec.model import BUILTIN, build_stage, random_weights
from wavepp.exec.torch_exec import TorchExecutor


def kernel_ratio(model: str, prompt_tokens: int, repeats: int, seed: int) -> dict:
    import transformers

    torch.set_num_threads(1)
    cfg = BUILTIN[model]
    if set(cfg.pattern) != {"A"}:
        raise SystemExit("the transformers comparison needs an attention-only model")
    weights = random_weights(cfg, seed)
    block = 64
    blocks = -(-prompt_tokens // block)
    ours = TorchExecutor(
        build_stage(cfg, range(cfg.num_layers), True, True, weights), blocks, block
    )
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, prompt_tokens, dtype=np.int32)
    chunk = ChunkWork("bench", 0, prompt_tokens, prompt_tokens, tuple(range(blocks)), (), False,
                      tokens=tokens)  # fmt: skip
    hf_config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        rms_norm_eps=cfg.norm_eps, max_position_embeddings=max(4096, prompt_tokens),
        tie_word_embeddings=cfg.tie_embeddings, attn_implementation="sdpa",
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    hf.load_state_dict(weights, strict=True)
    ids = torch.as_tensor(tokens[None], dtype=torch.long)

    def time_ours() -> float:
        t0 = time.perf_counter()
        ours.forward([chunk], None)
        return time.perf_counter() - t0

    @torch.inference_mode()
    def time_hf() -> float:
        t0 = time.perf_counter()
        hf(ids, use_cache=False, logits_to_keep=1)
        return time.perf_counter() - t0

    ours_s, hf_s = [], []
    time_ours(), time_hf()  # warm-up
    for _ in range(repeats):  # interleaved, so that machine noise hits both alike
        ours_s.append(time_ours())
        hf_s.append(time_hf())
    with torch.inference_mode():
        expected = hf(ids, use_cache=False, logits_to_keep=1).logits[0, -1]
    diff = (ours.last_logits["bench"] - expected).abs().max().item()
    return {
        "kernel_model": model,
        "kernel_prompt_tokens": prompt_tokens,
        "wavepp_stage_tok_s": prompt_tokens / statistics.median(ours_s),
        "transformers_tok_s": prompt_tokens / statistics.median(hf_s),
        "kernel_ratio": statistics.median(hf_s) / statistics.median(ours_s),
        "kernel_max_abs_diff": diff,
    }


def pipeline_throughput(stages: int, args: argparse.Namespace) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={stages}", "-m", "wavepp.main", "--executor", "torch",
               "--model", args.pp_model, "--workload", "cold", "--requests", str(args.requests),
               "--prompt-tokens", str(args.pp_prompt_tokens), "--concurrency",
               str(args.concurrency), "--budget", str(args.budget), "--block-size", "64",
               "--no-progress", "--json", str(out)]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, timeout=1200)
        return json.loads(out.read_text())["throughput_tok_s"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m wavepp.bench.torch_exec",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="small-llama", help="kernel comparison model")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--pp-model", default="small-hybrid", help="model of the P=1 / P=2 runs")
    p.add_argument("--pp-prompt-tokens", type=int, default=2048)
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-pp", action="store_true", help="only the kernel comparison")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    record = {"benchmark": "torch_exec", "threads_per_rank": 1,
              **kernel_ratio(args.model, args.prompt_tokens, args.repeats, args.seed)}  # fmt: skip
    if not args.skip_pp:
        one = pipeline_throughput(1, args)
        two = pipeline_throughput(2, args)
        record.update(pp1_tok_s=one, pp2_tok_s=two, pp2_efficiency=two / (2 * one),
                      pp_model=args.pp_model, pp_prompt_tokens=args.pp_prompt_tokens)  # fmt: skip
    emit(record, args.json)


if __name__ == "__main__":
    main()
