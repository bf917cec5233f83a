"""The GPU check (issue 13): run on a CUDA machine, ``python -m benchmarks.gpu --json out.json``.

(a) **Parity on the GPU**: for each model family the project loads (Llama, and the
    families of ``wavepp.model`` whose tiny configs ``tests/helpers/families.py``
    provides when the repository's tests are present), a tiny random checkpoint written
    by ``transformers``; WavePP's executor (one stage, prefix-reusing chunks through the
    paged pool) against ``transformers``' forward on the same GPU. fp32: max |Δlogit| ≤
    1e-3; bf16: max |Δlogit| ≤ 5% of the logit range and the same argmax.
(b) **Stage throughput**: one stage of a mid-size Llama (bf16) on one prompt, cold and
    90% cached, against ``transformers``' forward; with FlashInfer (when installed) and
    with the plain-torch fallback (``attention._math_attend``: public SDPA returns no
    log-sum-exp, which merging the prefix runs needs).
(c) **A 2-rank pipeline**: ``torchrun --nproc-per-node 2`` on the GPU(s) — NCCL between
    two GPUs, or Gloo over CUDA tensors when only one exists — checked against the same
    run on CPU (first tokens equal).
(d) **Tensor parallelism inside a stage** (``--tp 2``), where the machine has two GPUs or
    more: TP2 x PP1 on two GPUs (TP2 x PP2 on four or more), the layers' all-reduces over
    NCCL, checked against the same run on CPU (first tokens equal); skipped, and said so,
    on one GPU.

Without CUDA it exits at once (status 2) and runs nothing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks._stats import emit

FP32_TOL = 1e-3
BF16_REL_TOL = 0.05


def require_cuda() -> None:
    if not torch.cuda.is_available():
        print("benchmarks.gpu: no CUDA device is visible to torch "
              f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
              "this check needs a GPU and ran nothing", file=sys.stderr)  # fmt: skip
        sys.exit(2)


def _llama_checkpoint(path: Path, seed: int):
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5,
        max_position_embeddings=4096, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                std = 1.0 if "embed_tokens" in name else p.shape[-1] ** -0.5
                p.normal_(0.0, std)
    model.save_pretrained(path)
    return model


def checkpoints(tmp: Path, seed: int, families: bool) -> dict[str, tuple[object, Path]]:
    """family -> (transformers model, checkpoint directory)."""
    out = {"llama": (_llama_checkpoint(tmp / "llama", seed), tmp / "llama")}
    if not families:
        return out
    try:  # the families' tiny configs live with the parity tests
        from tests.helpers.families import MODELS, make_checkpoint
    except ImportError:
        print("  (tests/helpers/families.py not importable: Llama only)", file=sys.stderr)
        return out
    for family in MODELS:
        out[family] = make_checkpoint(family, tmp / family, seed)
    return out


@torch.inference_mode()
def parity(tmp: Path, seed: int, dtype: torch.dtype, device: str = "cuda",
           families: bool = True) -> list[dict]:  # fmt: skip
    from wavepp.exec.base import ChunkWork
    from wavepp.exec.torch_exec import TorchExecutor
    from wavepp.model import build_stage
    from wavepp.model.checkpoint import load_checkpoint

    device = torch.device(device)
    rows = []
    for family, (hf, path) in checkpoints(tmp, seed, families).items():
        cfg, weights = load_checkpoint(str(path))
        stage = build_stage(cfg, range(cfg.num_layers), True, True, weights, device, dtype)
        bs, n = 16, 200
        ex = TorchExecutor(stage, capacity=-(-n // bs) * 2, block_size=bs)
        tokens = np.random.default_rng(seed).integers(3, cfg.vocab_size, n)
        table = tuple(range(-(-n // bs)))
        cut = 128  # two chunks: the second reads the first's blocks from the pool
        ex.forward([ChunkWork("p", 0, cut, n, table[: cut // bs], (cut // bs,), False,
                              snapshot_slots=(0,), tokens=tokens[:cut])], None)  # fmt: skip
        ex.forward([ChunkWork("p", cut, n, n, table, (), False, tokens=tokens[cut:])], None)
        ours = ex.last_logits["p"].float()
        hf_gpu = hf.to(device=device, dtype=dtype)
        ids = torch.as_tensor(tokens, dtype=torch.long, device=device)[None]
        want = hf_gpu(ids).logits[0, -1].float()
        diff = float((ours - want).abs().max())
        span = float(want.max() - want.min())
        ok = diff <= FP32_TOL if dtype == torch.float32 else (
            diff <= BF16_REL_TOL * span and int(ours.argmax()) == int(want.argmax()))  # fmt: skip
        rows.append({"family": family, "dtype": str(dtype), "max_abs_diff": diff,
                     "logit_range": span, "ok": ok})  # fmt: skip
        print(f"  parity {family} {dtype}: |Δ| {diff:.2e} (range {span:.1f}) "
              f"{'ok' if ok else 'FAILED'}", file=sys.stderr, flush=True)  # fmt: skip
        hf.to("cpu", torch.float32)
    return rows


@torch.inference_mode()
def throughput(tokens_n: int, chunk: int, repeats: int, seed: int) -> list[dict]:
    import transformers

    from wavepp.exec.base import ChunkWork
    from wavepp.exec.torch_exec import TorchExecutor
    from wavepp.model import attention
    from wavepp.model.registry import llama_config
    from wavepp.model.stage import build_stage, random_weights

    device, dtype = torch.device("cuda"), torch.bfloat16
    cfg = llama_config(vocab_size=32_000, d_model=2048, num_layers=8, num_heads=16,
                       num_kv_heads=4, head_dim=128, d_ff=5632)  # fmt: skip
    weights = random_weights(cfg, seed)
    bs = 16
    ex = TorchExecutor(build_stage(cfg, range(8), True, True, weights, device, dtype),
                       -(-tokens_n // bs), bs)  # fmt: skip
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        max_position_embeddings=tokens_n, attn_implementation="sdpa",
    ))  # fmt: skip
    hf.load_state_dict(weights)
    hf = hf.to(device=device, dtype=dtype).eval()
    tokens = np.random.default_rng(seed).integers(3, cfg.vocab_size, tokens_n)
    table = tuple(range(-(-tokens_n // bs)))

    def ours(cached: int) -> float:
        def work(a, b):
            return ChunkWork("t", a, b, tokens_n, table[: -(-b // bs)], (), False,
                             tokens=tokens[a:b])  # fmt: skip

        for a in range(0, cached, chunk):
            ex.forward([work(a, min(cached, a + chunk))], None)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for a in range(cached, tokens_n, chunk):
            ex.forward([work(a, min(tokens_n, a + chunk))], None)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def theirs(cached: int) -> float:
        ids = torch.as_tensor(tokens, device=device)[None]
        past = hf(ids[:, :cached], use_cache=True).past_key_values if cached else None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hf(ids[:, cached:], past_key_values=past, use_cache=past is not None, logits_to_keep=1)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    rows = []
    kernels = [("flashinfer", None)] if attention._flashinfer() is not None else []
    kernels.append(("torch-fallback", [None]))
    for cached in (0, int(tokens_n * 0.9) // bs * bs):
        hf_s = min(theirs(cached) for _ in range(repeats))
        for name, override in kernels:
            saved = list(attention._FLASHINFER)
            if override is not None:
                attention._FLASHINFER[:] = override
            try:
                ours_s = min(ours(cached) for _ in range(repeats))
            finally:
                attention._FLASHINFER[:] = saved
            computed = tokens_n - cached
            rows.append({"tokens": tokens_n, "cached": cached, "kernel": name,
                         "wavepp_tok_s": computed / ours_s, "ratio": hf_s / ours_s,
                         "transformers_tok_s": computed / hf_s})  # fmt: skip
            print(f"  stage {tokens_n} cached {cached} {name}: ratio {hf_s / ours_s:.2f}",
                  file=sys.stderr, flush=True)  # fmt: skip
    return rows


def _run(tmp: Path, device: str, ranks: int, *options: str) -> dict:
    out = tmp / f"run-{device}-{ranks}-{len(list(tmp.iterdir()))}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={ranks}", "-m", "wavepp.main", "--model", "tiny-hybrid",
           "--workload", "seeded", "--requests", "8", "--prompt-tokens", "1024",
           "--device", device, "--no-progress", "--json", str(out), *options]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise RuntimeError(f"{ranks}-rank run {' '.join(options)} on {device} failed: "
                           f"{proc.stderr[-3000:]}")  # fmt: skip
    return json.loads(out.read_text())


def pipeline(tmp: Path) -> dict:
    """Two ranks on the GPU(s) against the same run on CPU: the same first tokens."""
    gpu, cpu = _run(tmp, "cuda", 2), _run(tmp, "cpu", 2)
    firsts = {d: {r["id"]: r["first_token"] for r in rec["requests"]}
              for d, rec in (("cuda", gpu), ("cpu", cpu))}  # fmt: skip
    return {"gpus": torch.cuda.device_count(),
            "tensor_backend": "nccl" if torch.cuda.device_count() >= 2 else "gloo",
            "cuda_tok_s": gpu["throughput_tok_s"], "cpu_tok_s": cpu["throughput_tok_s"],
            "first_tokens_equal": firsts["cuda"] == firsts["cpu"]}  # fmt: skip


def tensor_parallel(tmp: Path) -> dict:
    """``--tp 2`` on two GPUs (four ranks, TP2 x PP2, on four or more) against the same
    run on CPU: the same first tokens."""
    gpus = torch.cuda.device_count()
    if gpus < 2:
        return {"gpus": gpus, "skipped": "tensor parallelism needs two GPUs or more"}
    ranks = 4 if gpus >= 4 else 2
    gpu, cpu = _run(tmp, "cuda", ranks, "--tp", "2"), _run(tmp, "cpu", ranks, "--tp", "2")
    firsts = [{r["id"]: r["first_token"] for r in rec["requests"]} for rec in (gpu, cpu)]
    return {"gpus": gpus, "ranks": ranks, "tp": 2, "cuda_tok_s": gpu["throughput_tok_s"],
            "cpu_tok_s": cpu["throughput_tok_s"], "first_tokens_equal": firsts[0] == firsts[1]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--tokens", type=int, default=16384, help="prompt of the throughput part")
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip", default="",
                   help="comma-separated parts to skip: parity,stage,pp,tp")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    require_cuda()
    skip = set(args.skip.split(","))
    try:
        import flashinfer

        fi_version = getattr(flashinfer, "__version__", "installed")
    except ImportError:
        fi_version = None
    record: dict = {"benchmark": "gpu", "device": torch.cuda.get_device_name(),
                    "gpus": torch.cuda.device_count(), "torch": torch.__version__,
                    "flashinfer": fi_version}  # fmt: skip
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        if "parity" not in skip:
            record["parity"] = parity(tmp, args.seed, torch.float32) + parity(
                tmp, args.seed, torch.bfloat16
            )
        if "stage" not in skip:
            record["stage"] = throughput(args.tokens, args.chunk, args.repeats, args.seed)
        if "pp" not in skip:
            record["pipeline"] = pipeline(tmp)
        if "tp" not in skip:
            record["tensor_parallel"] = tensor_parallel(tmp)
    emit(record, args.json)
    failed = [r["family"] for r in record.get("parity", []) if not r["ok"]]
    runs = (record.get("pipeline", {}), record.get("tensor_parallel", {}))
    if failed or not all(run.get("first_tokens_equal", True) for run in runs):
        sys.exit(1)


if __name__ == "__main__":
    main()
