"""This machine's sustained matrix-multiply rate: the peak the prefill rows are judged by.

For each dtype (fp32, bf16) and thread count, square-ish GEMMs of the shapes a prefill
wave runs (``[tokens, d_model] @ [d_model, n]``: the deep model's projections at a 2,048-
token wave, and one large square) are timed with the same torch and the same settings the
executor uses (``torch.set_num_threads``); each shape runs ``--warmup`` untimed calls, then
``--repeats`` timed ones, and the figure is the best sustained rate over the shapes (the
median of each shape's repeats, the largest median over shapes), in FLOP/s and per core.
Nothing here is a verdict: the prefill rows divide their own FLOP/s by these figures.

    python -m benchmarks.peak --threads 1,2 --json peak.json
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from benchmarks._stats import emit
from wavepp.host import cpu_times, steal_share

# (m, k, n): a 2,048-token wave through the deep model's projections (hidden 896, 14 query
# heads of 64, 2 KV heads, MLP 4,864) and one large square product
SHAPES = {
    "qkv": (2048, 896, 1152),
    "o": (2048, 896, 896),
    "gate_up": (2048, 896, 9728),
    "down": (2048, 4864, 896),
    "square": (2048, 2048, 2048),
}


def gemm_rate(m: int, k: int, n: int, dtype: torch.dtype, warmup: int, repeats: int) -> float:
    """The median FLOP/s of ``[m, k] @ [k, n]`` in ``dtype`` (2 m k n FLOPs a call)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, k, generator=gen).to(dtype)  # a weight as nn.Linear holds it
    for _ in range(warmup):
        torch.nn.functional.linear(a, b)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.nn.functional.linear(a, b)
        times.append(time.perf_counter() - start)
    return 2 * m * k * n / float(np.median(times))


def measure(threads: list[int], dtypes: list[str], warmup: int, repeats: int) -> dict:
    rows = []
    for count in threads:
        torch.set_num_threads(count)
        for name in dtypes:
            dtype = getattr(torch, name)
            before = cpu_times()
            rates = {shape: gemm_rate(*dims, dtype, warmup, repeats)
                     for shape, dims in SHAPES.items()}  # fmt: skip
            best = max(rates, key=rates.get)
            rows.append({
                "dtype": name, "threads": count, "best_shape": best,
                "flops": rates[best], "flops_per_core": rates[best] / count,
                "by_shape": rates, "cpu_steal_share": steal_share(before, cpu_times()),
            })  # fmt: skip
    return {
        "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cores": os.cpu_count(), "rows": rows,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", help="also write the record here")
    args = p.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",") if t]
    dtypes = [d for d in args.dtypes.split(",") if d]
    if not threads or min(threads) < 1 or args.repeats < 1 or args.warmup < 0:
        p.error("--threads needs counts >= 1, --repeats >= 1, --warmup >= 0")
    for name in dtypes:
        if name not in ("float32", "bfloat16"):
            p.error(f"--dtypes: {name!r} is not float32 or bfloat16")
    record = measure(threads, dtypes, args.warmup, args.repeats)
    for row in record["rows"]:
        print(f"{row['dtype']:>9} {row['threads']} threads: {row['flops'] / 1e9:7.1f} GFLOP/s "
              f"({row['flops_per_core'] / 1e9:.1f} a core, {row['best_shape']})")
    emit(record, args.json)


if __name__ == "__main__":
    main()
