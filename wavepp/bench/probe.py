"""Benchmark of the state core at long-prompt scale (issue: foundation).

Builds one stage cache holding 90% of each of 64 concurrent 200K-token prompts (block
64: 3,125 blocks a prompt, 2,812 cached), with the pool full so that admission has to
evict, then measures on that one value:

- ``probe_p50_us`` / ``probe_p99_us``: the hint probe (gallop + bisect);
- ``linear_p50_us``: the block-by-block walk on the same cache in the same run;
- ``hash_ns_per_token``: chained block hashing of a 200K-token prompt;
- ``admit_ms_200k``: lease + escrow + materialize of one 200K-token request.

Every reducer is pure, so each repetition starts from the same cache value.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from wavepp.bench._stats import emit, percentile
from wavepp.state import (
    audit,
    block_hashes,
    empty_cache,
    escrow,
    lease,
    materialize,
    probe,
    probe_linear,
    publish,
    release,
)


def _build(args: argparse.Namespace):
    rng = np.random.default_rng(args.seed)
    num_blocks = args.prompt_tokens // args.block_size
    cached = int(num_blocks * args.hit)
    prompts = [
        rng.integers(0, 32_000, size=args.prompt_tokens, dtype=np.int32)
        for _ in range(args.requests)
    ]
    hashes = [block_hashes(p, args.block_size) for p in prompts]
    need = num_blocks - cached
    history = 2 * need  # stale blocks that admission will have to evict
    cache = empty_cache(args.requests * cached + history)
    filler = block_hashes(rng.integers(0, 32_000, history * args.block_size), args.block_size)
    for rid, chain, end in [("history", filler, history)] + [
        (f"seed{i}", h, cached) for i, h in enumerate(hashes)
    ]:
        cache, _ = lease(cache, rid, chain, 0)
        cache, ok = escrow(cache, rid, end)
        assert ok
        cache, _ = materialize(cache, rid)
        cache = publish(cache, rid, chain, end)
        cache = release(cache, rid)
    audit(cache)
    return prompts, hashes, cache, cached, num_blocks


def run(args: argparse.Namespace) -> dict:
    prompts, hashes, cache, cached, num_blocks = _build(args)
    ns = time.perf_counter_ns

    probe_us, linear_us = [], []
    for _ in range(args.repeats):
        for chain in hashes:
            t0 = ns()
            point = probe(cache, chain)
            probe_us.append((ns() - t0) / 1e3)
            assert point == cached
    for chain in hashes[: max(1, args.requests // 4)]:
        t0 = ns()
        point = probe_linear(cache, chain)
        linear_us.append((ns() - t0) / 1e3)
        assert point == cached

    hash_ns = []
    for prompt in prompts[:8]:
        t0 = ns()
        block_hashes(prompt, args.block_size)
        hash_ns.append((ns() - t0) / len(prompt))

    admit_ms = []
    for i in range(args.admits):
        chain = hashes[i % len(hashes)]
        t0 = ns()
        after, point = lease(cache, "probe-bench", chain, cached)
        after, ok = escrow(after, "probe-bench", num_blocks - point)
        after, done = materialize(after, "probe-bench")
        admit_ms.append((ns() - t0) / 1e6)
        assert ok and point == cached and len(done.slots) == num_blocks - cached
        assert len(done.evicted) == num_blocks - cached  # the pool was full: it evicted
    audit(after)

    return {
        "benchmark": "probe",
        "config": {
            "prompt_tokens": args.prompt_tokens,
            "block_size": args.block_size,
            "blocks_per_prompt": num_blocks,
            "cached_blocks_per_prompt": cached,
            "requests": args.requests,
            "pool_blocks": cache.capacity,
            "repeats": args.repeats,
            "seed": args.seed,
        },
        "probe_p50_us": round(percentile(probe_us, 50), 3),
        "probe_p99_us": round(percentile(probe_us, 99), 3),
        "linear_p50_us": round(percentile(linear_us, 50), 3),
        "linear_over_probe": round(percentile(linear_us, 50) / percentile(probe_us, 50), 1),
        "hash_ns_per_token": round(percentile(hash_ns, 50), 3),
        "admit_ms_200k": round(percentile(admit_ms, 50), 3),
        "admit_ms_200k_p99": round(percentile(admit_ms, 99), 3),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m wavepp.bench.probe",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--prompt-tokens", type=int, default=200_000, help="tokens a prompt")
    parser.add_argument("--block-size", type=int, default=64, help="tokens a block")
    parser.add_argument("--hit", type=float, default=0.9, help="cached share of each prompt")
    parser.add_argument("--requests", type=int, default=64, help="concurrent prompts cached")
    parser.add_argument("--repeats", type=int, default=20, help="probes of each prompt")
    parser.add_argument("--admits", type=int, default=20, help="timed admissions")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write the figures here")
    args = parser.parse_args(argv)
    emit(run(args), args.json)


if __name__ == "__main__":
    main()
