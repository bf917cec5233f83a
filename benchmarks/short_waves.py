"""Where a short-chunk wave's time goes on one stage: the paper's short-suffix regime.

One stage holding every layer of the model runs waves of ``S`` chunks of ``N`` new tokens,
each chunk after a cached prefix of ``C`` tokens (the chunks share four prefixes, written
to the pool first, as the short-suffix workload's requests share theirs). Per shape: the
wave's seconds (median of ``--repeats``), new tokens per second, and the profile of one
wave (``torch.profiler``) grouped into the attention kernel, matrix products, rotary and
norms, and the rest, each as a share of the profiled time, plus the costliest ops.

    python -m benchmarks.short_waves --shapes 16x128x2048,64x128x2048,16x512x32768 \\
        --json out.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks._stats import emit
from benchmarks.torch_exec import MODELS
from wavepp.exec.base import ChunkWork
from wavepp.exec.device import default_threads
from wavepp.exec.torch_exec import TorchExecutor
from wavepp.model import cpu_kernel
from wavepp.model.stage import build_stage, random_weights

PREFIXES = 4  # distinct cached prefixes the chunks share
# op name -> group of the profile
GROUPS = (
    ("attention kernel", ("wavepp::paged_attention", "aten::_scaled_dot_product",
                          "aten::scaled_dot_product")),
    ("matrix products", ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear")),
    ("rotary, norms, activations", ("aten::mul", "aten::add", "aten::silu", "aten::pow",
                                    "aten::mean", "aten::rsqrt", "aten::neg", "aten::cat",
                                    "aten::sum", "aten::div")),
    ("cache writes, gathers", ("aten::index_copy_", "aten::index_select", "aten::index",
                               "aten::embedding")),
)  # fmt: skip


def _group(name: str) -> str:
    for group, prefixes in GROUPS:
        if any(name.startswith(p) for p in prefixes):
            return group
    return "other"


def shape_of(text: str) -> tuple[int, int, int]:
    try:
        chunks, tokens, prefix = (int(x) for x in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not CHUNKSxTOKENSxPREFIX") from None
    if min(chunks, tokens) < 1 or prefix < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: chunks and tokens ≥ 1, prefix ≥ 0")
    return chunks, tokens, prefix


def run_shape(stage, shape: tuple[int, int, int], block: int, repeats: int, top: int) -> dict:
    chunks, tokens, prefix = shape
    per_prefix = -(-prefix // block)
    per_chunk = -(-(prefix + tokens) // block) - prefix // block
    capacity = PREFIXES * per_prefix + chunks * per_chunk
    executor = TorchExecutor(stage, capacity, block)
    rng = np.random.default_rng(0)
    vocab = stage.cfg.vocab_size
    tables = []
    for p in range(PREFIXES):  # write the prefixes (untimed), as seeded requests would
        table = list(range(p * per_prefix, (p + 1) * per_prefix))
        tables.append(table)
        ids = rng.integers(0, vocab, prefix)
        for a in range(0, prefix, 2048):
            end = min(prefix, a + 2048)
            executor.forward([ChunkWork(f"prefix-{p}", a, end, prefix + 1, tuple(table), (),
                                        False, tokens=ids[a:end])], None)  # fmt: skip
        executor.cancel(f"prefix-{p}")
    free = PREFIXES * per_prefix
    wave = []
    for s in range(chunks):
        own = list(range(free + s * per_chunk, free + (s + 1) * per_chunk))
        table = tables[s % PREFIXES][: prefix // block] + own
        wave.append(ChunkWork(f"c{s}", prefix, prefix + tokens, prefix + tokens, tuple(table),
                              (), False, tokens=rng.integers(0, vocab, tokens)))  # fmt: skip
    executor.forward(wave, None)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        executor.forward(wave, None)
        times.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        executor.forward(wave, None)
    ops = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()]
    total = sum(t for _, t in ops) or 1.0
    groups: dict[str, float] = {}
    for name, t in ops:
        groups[_group(name)] = groups.get(_group(name), 0.0) + t / total
    seconds = statistics.median(times)
    return {
        "chunks": chunks, "tokens": tokens, "prefix": prefix, "seconds": seconds,
        "new_tok_s": chunks * tokens / seconds,
        "shares": dict(sorted(groups.items(), key=lambda kv: -kv[1])),
        "top_ops": [{"op": name, "share": t / total}
                    for name, t in sorted(ops, key=lambda o: -o[1])[:top]],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.short_waves", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default="bench-llama", choices=sorted(MODELS))
    p.add_argument("--shapes", default="16x128x2048,64x128x2048,16x512x2048,16x256x32768",
                   help="comma-separated CHUNKSxTOKENSxPREFIX")  # fmt: skip
    p.add_argument("--block", type=int, default=16, help="KV block size")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="weights, activations and KV pool")  # fmt: skip
    p.add_argument("--threads", type=int, default=0, help="0: every core of this machine")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--top", type=int, default=8, help="costliest ops listed per shape")
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    shapes = [shape_of(s) for s in a.shapes.split(",")]
    threads = a.threads or default_threads()
    torch.set_num_threads(threads)
    cfg = MODELS[a.model]
    stage = build_stage(cfg, range(cfg.num_layers), True, True, random_weights(cfg, 0),
                        dtype=getattr(torch, a.dtype))  # fmt: skip
    rows = []
    for shape in shapes:
        row = run_shape(stage, shape, a.block, a.repeats, a.top)
        rows.append(row)
        shares = ", ".join(f"{k} {v:.0%}" for k, v in row["shares"].items())
        print(f"{row['chunks']} x {row['tokens']} after {row['prefix']:,}: "
              f"{row['seconds'] * 1e3:,.1f} ms, {row['new_tok_s']:,.0f} new tok/s; {shares}",
              file=sys.stderr, flush=True)  # fmt: skip
    emit({"benchmark": "short_waves", "model": a.model, "dtype": a.dtype, "threads": threads,
          "block": a.block, "attention": cpu_kernel.describe(torch.device("cpu"),
                                                             getattr(torch, a.dtype)),
          "rows": rows}, a.json)  # fmt: skip


if __name__ == "__main__":
    main()
