"""Benchmark of the state core at long-prompt scale (issue: foundation).

Builds one stage cache holding 90% of each of 64 concurrent 200K-token prompts (block
64: 3,125 blocks a prompt, 2,812 cached), with the pool full so that admission has to
evict, then measures on that one value:

- ``probe_p50_us`` / ``probe_p99_us``: the hint probe (tree walk with bisections);
- ``linear_p50_us``: the block-by-block walk on the same cache in the same run;
- ``hash_ns_per_token``: chained block hashing of a 200K-token prompt;
- ``admit_ms_200k``: lease + escrow + materialize of one 200K-token request.

``--hybrid`` measures a recurrent stage instead (issue 14): 64 prompts of 200K and of
1M tokens branch off one shared document at arbitrary blocks; each has a snapshot at
its junction (where it leaves the document) and, in the *dense* case, one every
``--snapshot-interval`` blocks, 90% of it cached. In the *sparse* case only the
junctions remain (interval snapshots evicted), so the snapshot floor lies far below the
attention hit. Per case: the whole hybrid probe (tree walk, then the floor
search), the floor search alone, and the floor's linear scan back from the hit, all on
the same cache value in the same run.

Every reducer is pure, so each repetition starts from the same cache value.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks._stats import emit, percentile
from wavepp.state import (
    attention_hit,
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
    reserve_snapshots,
    snapshot_floor,
    snapshot_floor_linear,
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


def _build_hybrid(args: argparse.Namespace, prompt_tokens: int, dense: bool):
    """64 prompts branching off one document, 90% cached, junction snapshots (and, if
    ``dense``, one every interval) on a recurrent stage."""
    rng = np.random.default_rng(args.seed)
    n = prompt_tokens // args.block_size
    cached = int(n * args.hit)
    doc = rng.integers(0, 32_000, size=prompt_tokens, dtype=np.int32)
    chains, junctions = [], []
    for _ in range(args.requests):
        junction = int(rng.integers(n // 4, n // 2))  # any block, rarely an interval point
        own = rng.integers(0, 32_000, size=prompt_tokens - junction * args.block_size)
        chains.append(block_hashes(np.concatenate([doc[: junction * args.block_size], own]),
                                   args.block_size))  # fmt: skip
        junctions.append(junction)
    capacity = n + args.requests * cached
    cache = empty_cache(capacity, has_recurrent=True)
    step = args.snapshot_interval
    for i, (chain, junction) in enumerate(zip(chains, junctions, strict=True)):
        rid = f"seed{i}"
        held = attention_hit(cache, chain, cached)
        point = snapshot_floor(cache, chain, held)
        cache, point = lease(cache, rid, chain, point)
        cache, ok = escrow(cache, rid, cached - point)
        assert ok
        cache, _ = materialize(cache, rid)
        points = {junction} | ({k for k in range(step, cached + 1, step)} if dense else set())
        cache, _ = reserve_snapshots(cache, rid, chain, [k for k in points if point < k <= cached])
        cache = publish(cache, rid, chain, cached)
        cache = release(cache, rid)
    audit(cache)
    return chains, cache, cached


def run_hybrid(args: argparse.Namespace) -> dict:
    ns = time.perf_counter_ns
    out: dict = {"benchmark": "probe-hybrid", "config": {
        "block_size": args.block_size, "requests": args.requests, "hit": args.hit,
        "snapshot_interval": args.snapshot_interval, "repeats": args.repeats,
        "seed": args.seed}}  # fmt: skip
    for tokens in args.hybrid_tokens:
        for dense in (True, False):
            chains, cache, cached = _build_hybrid(args, tokens, dense)
            probe_us, floor_us, linear_us = [], [], []
            for _ in range(args.repeats):
                for chain in chains:
                    t0 = ns()
                    point = probe(cache, chain)
                    probe_us.append((ns() - t0) / 1e3)
                    t0 = ns()
                    floor = snapshot_floor(cache, chain, cached)
                    floor_us.append((ns() - t0) / 1e3)
                    assert point == floor
            for chain in chains:
                t0 = ns()
                floor = snapshot_floor_linear(cache, chain, cached)
                linear_us.append((ns() - t0) / 1e3)
                assert floor == snapshot_floor(cache, chain, cached)
            gap = [cached - snapshot_floor(cache, c, cached) for c in chains]
            name = f"{tokens // 1000}k_{'dense' if dense else 'sparse'}"
            out[name] = {
                "prompt_tokens": tokens,
                "snapshots": len(cache.snapshots),
                "blocks_hit_to_floor_p50": int(np.median(gap)),
                "probe_p50_us": round(percentile(probe_us, 50), 3),
                "probe_p99_us": round(percentile(probe_us, 99), 3),
                "floor_search_p50_us": round(percentile(floor_us, 50), 3),
                "floor_search_p99_us": round(percentile(floor_us, 99), 3),
                "floor_linear_p50_us": round(percentile(linear_us, 50), 3),
                "floor_linear_p99_us": round(percentile(linear_us, 99), 3),
            }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.probe",
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
    parser.add_argument(
        "--hybrid",
        action="store_true",
        help="measure a recurrent stage's probe and snapshot floor instead",
    )
    parser.add_argument(
        "--hybrid-tokens",
        type=int,
        nargs="+",
        default=[200_000, 1_000_000],
        help="--hybrid: prompt lengths to build",
    )
    parser.add_argument(
        "--snapshot-interval",
        type=int,
        default=16,
        help="--hybrid: blocks between snapshots in the dense case",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the figures here")
    args = parser.parse_args(argv)
    emit(run_hybrid(args) if args.hybrid else run(args), args.json)


if __name__ == "__main__":
    main()
