"""Benchmark of the torch executor on this machine (issues 12 and 13).

1. **Length sweep**: one stage holding every layer of the model prefills one prompt of
   each length, cold (every token computed, in chunks of ``--chunk`` tokens as the
   runtime's waves would) and 90% cached (the prefix written to the pool first, the 10%
   suffix timed). Hugging Face ``transformers`` runs its own forward of the same weights
   on the same tokens (cached: its KV cache of the same prefix), with the same threads.
   Tokens per second computed, and the ratio WavePP / transformers, per length.
2. **Attention rows**: the block-table attention against the old copying path (gather
   the whole prefix per chunk and layer, dense ``[n, m]`` mask) on the same executor,
   at the ``--attention-lengths`` (90% cached), same run.
3. **``--compile`` rows**: the same stage eager and with ``--compile``
   (``wavepp.model.fused``), interleaved, at the ``--compile-lengths``, cold and 90%
   cached, with the largest logit difference.
4. **Kernel rows**: WavePP's CPU attention kernel (``wavepp.model.cpu_kernel``) against
   the PyTorch path (``WAVEPP_CPU_KERNEL=0``) on the same executor, interleaved, at the
   ``--kernel-lengths``, cold and 90% cached, with the largest logit difference; and the
   kernel alone on one layer's shapes, the prompt's waves over a shuffled block table,
   in GFLOP/s: fp32 and bf16 by each path this machine has (AMX tiles, ``vdpbf16ps``,
   converted to fp32), counting 2 (D + Dv) per head and query-key pair on or below the
   diagonal.
5. **Fused-op rows**: the layers' token-wise work (RMSNorm, rotary embedding,
   ``silu(gate) * up``) as WavePP's fused CPU ops against PyTorch's kernels
   (``WAVEPP_CPU_FUSED=0``) on the same executor, interleaved, at the
   ``--fused-lengths``, cold and 90% cached, with the largest logit difference.
6. **Last-layer rows**: the stage as it runs (the model's last layer computes its
   outputs only for the row the logits read) against ``full_last_layer`` (that layer
   for every token), interleaved, at the ``--last-layer-lengths``, cold and 90% cached,
   with the largest logit difference.
``--dtype bfloat16`` runs the stage and transformers in bf16 (rows 1-6).

7. ``--pp``: the whole runtime on a cold workload with one stage and with two:
   throughput(P=2) / (2 x throughput(P=1)).

Timings interleave the systems they compare, so that machine noise hits both alike; each
figure is the median of ``--repeats`` runs. Needs ``transformers`` (the ``dev`` extra).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks._stats import emit
from wavepp.exec.base import ChunkWork
from wavepp.exec.device import default_threads
from wavepp.exec.torch_exec import TorchExecutor
from wavepp.model import attn, cpu_kernel
from wavepp.model.attention import PagedBatch, paged_attention
from wavepp.model.registry import BUILTIN, llama_config
from wavepp.model.stage import build_stage, random_weights

# The shape of the small Llama of the vLLM comparison (issue 12): hidden 256, 4 layers,
# 4 heads / 2 KV heads, vocabulary 32,000.
MODELS = {
    **BUILTIN,
    "bench-llama": llama_config(
        vocab_size=32_000, d_model=256, num_layers=4, num_heads=4, num_kv_heads=2,
        head_dim=64, d_ff=1024,
    ),
    # benchmarks.vllm_compare's deep model: a ~0.5B model's shapes
    "llama-24l": llama_config(
        vocab_size=32_000, d_model=896, num_layers=24, num_heads=14, num_kv_heads=2,
        head_dim=64, d_ff=4864,
    ),
}  # fmt: skip


def copying_attention(q, k_pool, v_pool, batch: PagedBatch, scale: float) -> torch.Tensor:
    """The executor's attention before the block-table path: per chunk, copy rows
    0..end-1 of the pool and attend under a dense [n, m] mask."""
    bs, outs = batch.block_size, []
    for (a, b), start, end, table in zip(batch.spans, batch.starts, batch.ends, batch.tables,
                                         strict=True):  # fmt: skip
        t = torch.as_tensor(table, dtype=torch.long)
        every = torch.arange(end)
        rows = t[every // bs] * bs + every % bs
        keys, values = k_pool[rows], v_pool[rows]
        positions = torch.arange(start, end)
        if start == 0:
            mask, causal = None, True
        else:
            mask, causal = torch.arange(end)[None, :] <= positions[:, None], False
        out = F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1)[None], keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None], attn_mask=mask, is_causal=causal, scale=scale,
            enable_gqa=True,
        )  # fmt: skip
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


class Sweep:
    """One model's weights in WavePP (one stage, every layer) and in transformers."""

    def __init__(self, model: str, seed: int, block: int, max_tokens: int,
                 clock=time.perf_counter, dtype: torch.dtype = torch.float32) -> None:  # fmt: skip
        import transformers

        self.clock = clock
        self._prefix: dict[int, tuple] = {}  # executor -> the prefix its pool holds
        self._compiled: TorchExecutor | None = None
        self._full: TorchExecutor | None = None
        self.copy_logits: torch.Tensor | None = None  # the copying path's, last run
        self.pytorch_logits: torch.Tensor | None = None  # PyTorch attention's, last run
        self.unfused_logits: torch.Tensor | None = None  # without the fused ops, last run

        cfg = MODELS[model]
        if set(cfg.pattern) != {"A"}:
            raise SystemExit("the transformers comparison needs an attention-only model")
        self.cfg, self.block, self.seed = cfg, block, seed
        self.weights = random_weights(cfg, seed)
        self.blocks = -(-max_tokens // block)
        self.stage = build_stage(cfg, range(cfg.num_layers), True, True, self.weights,
                                 dtype=dtype)  # fmt: skip
        self.ours = TorchExecutor(self.stage, self.blocks, block)
        hf_config = transformers.LlamaConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
            num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            rms_norm_eps=cfg.norm_eps, max_position_embeddings=max(4096, max_tokens),
            tie_word_embeddings=cfg.tie_embeddings, attn_implementation="sdpa",
        )  # fmt: skip
        self.hf = transformers.LlamaForCausalLM(hf_config).eval()
        self.hf.load_state_dict(self.weights, strict=True)
        self.hf.to(dtype)

    def tokens(self, n: int) -> np.ndarray:
        return np.random.default_rng(self.seed + n).integers(3, self.cfg.vocab_size, n)

    def _chunks(self, tokens: np.ndarray, start: int, chunk: int) -> list[ChunkWork]:
        n, bs = len(tokens), self.block
        table = tuple(range(-(-n // bs)))
        return [ChunkWork("bench", a, min(n, a + chunk), n, table[: -(-min(n, a + chunk) // bs)],
                          (), False, tokens=tokens[a : min(n, a + chunk)])
                for a in range(start, n, chunk)]  # fmt: skip

    def compiled(self) -> TorchExecutor:
        """The same stage with ``--compile`` (compiled on first use), its own pool."""
        if self._compiled is None:
            self._compiled = TorchExecutor(self.stage, self.blocks, self.block, compile=True)
        return self._compiled

    def full(self) -> TorchExecutor:
        """The same stage running its last layer for every token, its own pool."""
        if self._full is None:
            self._full = TorchExecutor(self.stage, self.blocks, self.block, full_last_layer=True)
        return self._full

    @torch.inference_mode()
    def ours_seconds(self, tokens: np.ndarray, cached: int, chunk: int,
                     executor: TorchExecutor | None = None) -> float:  # fmt: skip
        ex = executor or self.ours
        key = (len(tokens), cached, hash(tokens[:cached].tobytes()))
        if cached and self._prefix.get(id(ex)) != key:  # the prefix, untimed (kept for
            for c in self._chunks(tokens[:cached], 0, 8192):  # the next call: a suffix
                ex.forward([c], None)  # never writes it)
            self._prefix[id(ex)] = key
        work = self._chunks(tokens, cached, chunk)
        t0 = self.clock()
        for c in work:
            ex.forward([c], None)
        return self.clock() - t0

    def pytorch_seconds(self, tokens: np.ndarray, cached: int, chunk: int) -> float:
        """:meth:`ours_seconds` on the PyTorch attention path (its logits kept aside)."""
        with cpu_kernel.off():
            seconds = self.ours_seconds(tokens, cached, chunk)
        self.pytorch_logits = self.ours.last_logits["bench"].clone()
        return seconds

    def unfused_seconds(self, tokens: np.ndarray, cached: int, chunk: int) -> float:
        """:meth:`ours_seconds` with the layers' token-wise work in PyTorch's kernels
        instead of WavePP's fused ops (its logits kept aside)."""
        with cpu_kernel.fused_off():
            seconds = self.ours_seconds(tokens, cached, chunk)
        self.unfused_logits = self.ours.last_logits["bench"].clone()
        return seconds

    def copying_seconds(self, tokens: np.ndarray, cached: int, chunk: int) -> float:
        """:meth:`ours_seconds` with the old copying attention (its logits kept aside):
        the model's attention layers look ``paged_attention`` up in ``wavepp.model.attn``,
        which this swaps for the copying path while it runs."""
        attn.paged_attention = copying_attention
        try:
            seconds = self.ours_seconds(tokens, cached, chunk)
            self.copy_logits = self.ours.last_logits["bench"].clone()
        finally:
            attn.paged_attention = paged_attention
        return seconds

    @torch.inference_mode()
    def hf_seconds(self, tokens: np.ndarray, cached: int) -> float:
        ids = torch.as_tensor(tokens[None], dtype=torch.long)
        past = None
        if cached:
            prefix = self.hf(ids[:, :cached], use_cache=True, logits_to_keep=1).past_key_values
            past = copy.deepcopy(prefix)  # untimed
        t0 = self.clock()
        out = self.hf(ids[:, cached:], past_key_values=past, use_cache=past is not None,
                      logits_to_keep=1)  # fmt: skip
        seconds = self.clock() - t0
        self.hf_logits = out.logits[0, -1]
        return seconds


def _interleaved(repeats: int, new, old) -> tuple[float, float]:
    """Median seconds of two timings taken alternately (the machine's speed drifts)."""
    new_s, old_s = [], []
    for _ in range(repeats):
        old_s.append(old())
        new_s.append(new())
    return statistics.median(new_s), statistics.median(old_s)


def _speedup_row(n: int, cached: int, names: tuple[str, str], seconds: tuple[float, float],
                 diff: float) -> dict:  # fmt: skip
    """One row of an A/B: computed tokens per second of each, old time / new time."""
    (new, old), (new_t, old_t) = names, seconds
    return {"tokens": n, "cached": cached, f"{new}_tok_s": (n - cached) / new_t,
            f"{old}_tok_s": (n - cached) / old_t, "speedup": old_t / new_t,
            "max_abs_logit_diff": diff}  # fmt: skip


def _on(seconds, executor, tokens, cached, chunk) -> float:
    """``seconds`` (:meth:`Sweep.ours_seconds`) on the executor ``executor()`` gives."""
    return seconds(tokens, cached, chunk, executor())


def _ab_rows(bench: Sweep, args: argparse.Namespace, label: str, lengths: list[int],
             shares: tuple[float, ...], names: tuple[str, str], new, old, old_logits) -> list:
    """Interleaved A/B rows at each length and cached share: ``new`` and ``old`` time
    ``(tokens, cached, chunk)``; the logits compared are the executor's last and
    ``old_logits()``."""  # fmt: skip
    rows = []
    for n in lengths:
        for share in shares:
            tokens = bench.tokens(n)
            cached = int(n * share) // args.block * args.block
            times = _interleaved(args.repeats, partial(new, tokens, cached, args.chunk),
                                 partial(old, tokens, cached, args.chunk))  # fmt: skip
            diff = (bench.ours.last_logits["bench"] - old_logits()).abs().max().item()
            row = _speedup_row(n, cached, names, times, diff)
            rows.append(row)
            print(f"  {label} at {n} ({'cold' if not cached else f'{share:.0%} cached'}): "
                  f"{names[0]} {row[f'{names[0]}_tok_s']:,.0f} tok/s, {names[1]} "
                  f"{row[f'{names[1]}_tok_s']:,.0f} tok/s, x{row['speedup']:.2f} "
                  f"(logits differ by {diff:.1e})", file=sys.stderr, flush=True)  # fmt: skip
    return rows


def kernel_gflops(cfg, lengths: list[int], chunk: int, block: int, repeats: int,
                  clock=time.perf_counter) -> list[dict]:  # fmt: skip
    """The CPU attention kernel alone, one layer of ``cfg``'s shapes: each prompt length
    cold and 90% cached, its new tokens in waves of ``chunk`` over a shuffled block table;
    GFLOP/s (median of ``repeats``) in fp32 and in bf16 by every path this machine has."""
    if not cpu_kernel.available():
        return []
    heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    kinds = [("fp32", torch.float32, None)] + [
        (f"bf16_{p}", torch.bfloat16, p) for p in cpu_kernel.BF16_PATHS if cpu_kernel._has(p)
    ]
    rows = []
    for n in lengths:
        g = torch.Generator().manual_seed(n)
        blocks = -(-n // block)
        table = torch.randperm(blocks, generator=g).tolist()
        pools = [torch.randn(blocks * block, kv_heads, d, generator=g) for _ in range(2)]
        for share in (0.0, 0.9):
            cached = int(n * share) // block * block
            waves = []
            for a in range(cached, n, chunk):
                b = min(n, a + chunk)
                batch = PagedBatch([a], [b], [table], block, torch.device("cpu"))
                meta = cpu_kernel.wave_metadata(batch.starts, batch.spans, batch.tables)
                waves.append((torch.randn(b - a, heads, d, generator=g), meta))
            pairs = sum(p + 1 for p in range(cached, n))  # query-key pairs, causal
            row = {"tokens": n, "cached": cached, "heads": heads, "kv_heads": kv_heads,
                   "head_dim": d, "gflop": 2 * heads * 2 * d * pairs / 1e9}  # fmt: skip
            for label, dtype, path in kinds:
                k_pool, v_pool = (t.to(dtype) for t in pools)
                qs = [(q.to(dtype), meta) for q, meta in waves]
                seconds = []
                for _ in range(repeats):
                    t0 = clock()
                    for q, meta in qs:
                        cpu_kernel.paged_attention(q, k_pool, v_pool, *meta, block, d**-0.5,
                                                   path=path)  # fmt: skip
                    seconds.append(clock() - t0)
                row[f"{label}_gflop_s"] = row["gflop"] / statistics.median(seconds)
            rows.append(row)
            print(f"  kernel alone at {n} ({'cold' if not cached else '90% cached'}): "
                  + ", ".join(f"{label} {row[f'{label}_gflop_s']:.1f}" for label, _, _ in kinds)
                  + " GFLOP/s", file=sys.stderr, flush=True)  # fmt: skip
    return rows


def sweep(args: argparse.Namespace) -> dict:
    lengths = [int(x) for x in args.lengths.split(",") if x]
    attn_lengths = [int(x) for x in args.attention_lengths.split(",") if x]
    compile_lengths = [int(x) for x in args.compile_lengths.split(",") if x]
    kernel_lengths = [int(x) for x in args.kernel_lengths.split(",") if x]
    last_lengths = [int(x) for x in args.last_layer_lengths.split(",") if x]
    fused_lengths = [int(x) for x in args.fused_lengths.split(",") if x]
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    longest = max(lengths + attn_lengths + compile_lengths + kernel_lengths + last_lengths
                  + fused_lengths)
    bench = Sweep(args.model, args.seed, args.block, longest, clock, getattr(torch, args.dtype))
    rows = []
    for n in lengths:
        for share in (0.0, 0.9):
            tokens = bench.tokens(n)
            cached = int(n * share) // args.block * args.block
            ours_s, hf_s = [], []
            if not rows:  # warm both up once: first calls pay for allocations
                bench.ours_seconds(tokens, cached, args.chunk)
                bench.hf_seconds(tokens, cached)
            for _ in range(args.repeats):
                ours_s.append(bench.ours_seconds(tokens, cached, args.chunk))
                hf_s.append(bench.hf_seconds(tokens, cached))
            diff = (bench.ours.last_logits["bench"] - bench.hf_logits).abs().max().item()
            ours_t, hf_t = statistics.median(ours_s), statistics.median(hf_s)
            row = {
                "tokens": n, "cached": cached, "computed": n - cached,
                "wavepp_tok_s": (n - cached) / ours_t, "transformers_tok_s": (n - cached) / hf_t,
                "ratio": hf_t / ours_t, "max_abs_logit_diff": diff,
            }  # fmt: skip
            rows.append(row)
            print(f"  {n:>6} {'cold' if not cached else '90% cached':>10}: WavePP "
                  f"{row['wavepp_tok_s']:>9,.0f} tok/s, transformers "
                  f"{row['transformers_tok_s']:>9,.0f} tok/s, ratio {row['ratio']:.2f} "
                  f"(logits differ by {diff:.1e})", file=sys.stderr, flush=True)  # fmt: skip
    attention = _ab_rows(bench, args, "attention", attn_lengths, (0.9,),
                         ("block_table", "copying"), bench.ours_seconds, bench.copying_seconds,
                         lambda: bench.copy_logits)  # fmt: skip
    if compile_lengths:  # compiles here, then warms both up once
        tokens = bench.tokens(compile_lengths[0])
        bench.ours_seconds(tokens, 0, args.chunk, bench.compiled())
        bench.ours_seconds(tokens, 0, args.chunk)
    compiled = _ab_rows(
        bench, args, "--compile", compile_lengths, (0.0, 0.9), ("compiled", "eager"),
        partial(_on, bench.ours_seconds, bench.compiled), bench.ours_seconds,
        lambda: bench.compiled().last_logits["bench"],
    )
    if kernel_lengths:
        print(f"  attention kernel: {bench.ours.attention_kernel}", file=sys.stderr, flush=True)
    kernel = _ab_rows(bench, args, "kernel", kernel_lengths, (0.0, 0.9), ("kernel", "pytorch"),
                      bench.ours_seconds, bench.pytorch_seconds, lambda: bench.pytorch_logits)
    gflops = kernel_gflops(bench.cfg, kernel_lengths, args.chunk, args.block, args.repeats, clock)
    fused = _ab_rows(bench, args, "fused ops", fused_lengths, (0.0, 0.9), ("fused", "unfused"),
                     bench.ours_seconds, bench.unfused_seconds, lambda: bench.unfused_logits)
    last_layer = _ab_rows(
        bench, args, "last layer", last_lengths, (0.0, 0.9), ("rows_only", "full_last_layer"),
        bench.ours_seconds, partial(_on, bench.ours_seconds, bench.full),
        lambda: bench.full().last_logits["bench"],
    )
    return {"model": args.model, "chunk": args.chunk, "block": args.block, "clock": args.clock,
            "attention_kernel": bench.ours.attention_kernel, "sweep": rows,
            "attention": attention, "compile": compiled, "kernel": kernel,
            "kernel_gflops": gflops, "fused": fused, "last_layer": last_layer,
            "dtype": args.dtype}  # fmt: skip


def plot(record: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for cached, style in ((False, "-"), (True, "--")):
        rows = [r for r in record["sweep"] if bool(r["cached"]) == cached]
        if not rows:
            continue
        label = "90% cached" if cached else "cold"
        xs = [r["tokens"] for r in rows]
        ax.plot(xs, [r["wavepp_tok_s"] for r in rows], "o" + style, color="C0",
                label=f"WavePP stage, {label}")  # fmt: skip
        ax.plot(xs, [r["transformers_tok_s"] for r in rows], "s" + style, color="C1",
                label=f"transformers, {label}")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel(
        "computed tokens / CPU-second" if record["clock"] == "cpu" else "computed tokens / s"
    )
    ax.set_title(f"{record['model']}, one stage, {record['threads']} threads (CPU)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


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
        prog="python -m benchmarks.torch_exec",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="bench-llama", choices=sorted(MODELS))
    p.add_argument(
        "--lengths",
        default="2048,4096,8192,16384,32768",
        help="prompt lengths of the sweep, comma-separated ('' for none)",
    )
    p.add_argument(
        "--attention-lengths",
        default="2048,32768",
        help="lengths of the block-table vs copying rows ('' for none)",
    )
    p.add_argument(
        "--compile-lengths",
        default="",
        help="lengths of the --compile vs eager rows, cold and 90%% cached ('' for none; "
        "compiling takes 10-40 s)",
    )
    p.add_argument(
        "--kernel-lengths",
        default="",
        help="lengths of the WavePP CPU kernel vs PyTorch attention rows, cold and 90%% "
        "cached ('' for none)",
    )
    p.add_argument(
        "--fused-lengths",
        default="",
        help="lengths of the fused token-wise ops vs PyTorch's kernels rows (norms, "
        "rotary, silu * up), cold and 90%% cached ('' for none)",
    )
    p.add_argument(
        "--last-layer-lengths",
        default="",
        help="lengths of the rows-only last layer vs --full-last-layer rows, cold and 90%% "
        "cached ('' for none)",
    )
    p.add_argument("--chunk", type=int, default=2048, help="tokens per wave (cold and suffix)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the stage's and transformers' dtype (rows 1-6)")  # fmt: skip
    p.add_argument("--block", type=int, default=16, help="KV block size")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="0: every core of this machine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: elapsed seconds; cpu: this process's CPU seconds (robust when "
        "other work shares the cores; tok/s then means per CPU-second)",
    )
    p.add_argument("--plot", metavar="PNG", help="draw tok/s against length here")
    p.add_argument("--pp", action="store_true", help="also run the P=1 / P=2 runtime figure")
    p.add_argument("--pp-model", default="small-hybrid", help="model of the P=1 / P=2 runs")
    p.add_argument("--pp-prompt-tokens", type=int, default=2048)
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    threads = args.threads or default_threads()
    torch.set_num_threads(threads)
    record = {"benchmark": "torch_exec", "threads": threads, **sweep(args)}
    if args.plot and record["sweep"]:
        plot(record, args.plot)
    if args.pp:
        one = pipeline_throughput(1, args)
        two = pipeline_throughput(2, args)
        record.update(pp1_tok_s=one, pp2_tok_s=two, pp2_efficiency=two / (2 * one),
                      pp_model=args.pp_model, pp_prompt_tokens=args.pp_prompt_tokens)  # fmt: skip
    emit(record, args.json)


if __name__ == "__main__":
    main()
