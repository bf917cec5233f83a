"""Measure the torch executor on this machine and write a device profile for the sim.

    python -m wavepp.sim.calibrate --model tiny-kimi --threads 1 --out profile.json
    python -m wavepp.main --executor sim --model tiny-kimi --sim-device measured:profile.json

Each part of the model — every mixer kind and MLP kind, the last layer as the last stage
runs it, the embedding and the head — is timed as ``--layers-per-stage auto`` times it
(``wavepp.exec.layer_costs.measure``: a stage of its own, the median of ``--repeats``
waves after a warm-up) on a grid of waves (chunks x new tokens after a cached prefix),
and fitted to ``wave_s + chunk_s·C + token_s·T + pair_s·Σ t·(p + t/2)`` by non-negative
least squares (the head to its rows, it and the embedding with no chunk term; ``pair_s``
only for attention mixers, the parts whose work grows with the prefix). The whole model
as one stage is timed on the same waves: the parts' summed times exceed it by the
executor's per-wave cost once per part beyond the first, which gives that cost
(``wave_overhead_s``, charged once per stage); the spread of its repeated waves is the
profile's ``noise``. The rate at which one thread hashes ``--sim-burn``'s blocks now
(``machine.burn_blocks_s``) turns a wave's seconds into that much work. The link:
activations of a few sizes sent between two local processes over the ``local`` data
plane (``SocketLink``) and answered, round trips fitted to ``2·latency + bytes /
bandwidth``. The file
(``wavepp.sim.measured``, schema ``wavepp.sim.measured/1``) holds the machine's facts,
the fits and every raw point.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import socket
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from wavepp.dtypes import FLOATS
from wavepp.exec.device import pick_dtype, set_threads
from wavepp.exec.layer_costs import measure, wave_times
from wavepp.exec.torch_exec import TorchExecutor
from wavepp.host import usable_cores
from wavepp.model import BUILTIN, build_stage, random_weights
from wavepp.plan.placement import WaveShape
from wavepp.sim.executor import attention_pairs, burn_rate
from wavepp.sim.measured import MeasuredProfile, PartCost
from wavepp.sim.profiles import LinkProfile
from wavepp.transport.frames import DataLimits
from wavepp.transport.unix import SocketLink

# (chunks, new tokens, cached prefix): the torch defaults' waves of up to 2,048 tokens,
# one to sixteen chunks, prefixes up to 4,096 (seeded, short-suffix, conversation).
GRID = ((1, 128, 0), (1, 512, 0), (1, 2048, 0), (1, 256, 1792), (1, 1024, 1024),
        (2, 256, 4096), (4, 512, 0), (4, 128, 1920), (8, 256, 0), (16, 64, 1984))  # fmt: skip


def nnls(rows: list[list[float]], values: list[float]) -> list[float]:
    """Least squares with every coefficient ≥ 0: drop the most negative coefficient and
    refit until none is negative (enough for three columns)."""
    x, y = np.array(rows, dtype=float), np.array(values, dtype=float)
    free = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        if free:
            fit, *_ = np.linalg.lstsq(x[:, free], y, rcond=None)
            coef[free] = fit
        if not free or coef.min() >= 0:
            return [float(v) for v in np.maximum(coef, 0.0)]
        free.remove(int(np.argmin(coef)))


ATTENTION = ("gqa", "mla", "gattn", "mmattn")  # mixers whose work grows with the prefix


def fit_part(points: list[tuple[float, float, float, float]], prefix: bool = True,
             per_chunk: bool = True) -> tuple[float, float, float, float]:  # fmt: skip
    """(wave_s, token_s, pair_s, chunk_s) of (tokens, pairs, chunks, seconds) points;
    ``prefix`` False: a part whose work does not grow with the cached prefix (pair_s 0,
    not fitted to noise); ``per_chunk`` False: one with no cost per chunk (chunk_s 0)."""
    columns = [lambda t, p, c: 1.0, lambda t, p, c: t]
    columns += [lambda t, p, c: p] if prefix else []
    columns += [lambda t, p, c: c] if per_chunk else []
    fit = iter(nnls([[f(t, p, c) for f in columns] for t, p, c, _ in points],
                    [s for *_, s in points]))  # fmt: skip
    wave, token = next(fit), next(fit)
    pair = next(fit) if prefix else 0.0
    chunk = next(fit) if per_chunk else 0.0
    return wave, token, pair, chunk


def grows_with_prefix(key: str) -> bool:
    """Attention mixers read the prefix for every new token; MLPs, recurrent mixers, the
    embedding and the head do not, nor the last layer, whose attention runs for the
    logits' rows only."""
    return key.startswith("mixer:") and key.split(":", 1)[1] in ATTENTION


LINK_ROWS = (16, 256, 2048, 8192)  # activation rows per message of the link measurement


def _echo(sock: socket.socket, count: int) -> None:
    """The far end of the link measurement: receive each message, answer with an empty one."""
    import anyio

    async def run() -> None:  # a link is one direction, src -> dst
        inbound, back = (SocketLink(0, 1, sock, 60.0, DataLimits(1 << 31)),
                         SocketLink(1, 0, sock, 60.0))  # fmt: skip
        for _ in range(count):
            await inbound.recv()
            await back.send(b"ok", None)

    anyio.run(run)


def measure_link(row_bytes: int, dtype: torch.dtype, repeats: int) -> dict:
    """The data plane between two local processes (``SocketLink`` over a Unix socket, as
    the runtime's ``local`` plane): round trips of activations of each of ``LINK_ROWS``
    rows answered by an empty message, fitted to ``2·latency + bytes / bandwidth``."""
    import anyio

    width = row_bytes // torch.empty((), dtype=dtype).element_size()
    here, there = socket.socketpair()
    count = len(LINK_ROWS) * (repeats + 1)
    peer = multiprocessing.get_context("spawn").Process(target=_echo, args=(there, count))
    peer.start()
    there.close()
    points = []

    async def run() -> None:
        out, back = SocketLink(0, 1, here, 60.0), SocketLink(1, 0, here, 60.0)
        for rows in LINK_ROWS:
            x = torch.randn(rows, width).to(dtype)
            times = []
            for k in range(repeats + 1):  # the first is a warm-up
                started = time.perf_counter()
                await out.send(b"x", x)
                await back.recv()
                if k:
                    times.append(time.perf_counter() - started)
            points.append((rows * row_bytes, statistics.median(times)))

    try:
        anyio.run(run)
    finally:
        peer.join(timeout=30)
        here.close()
    base, per_byte = nnls([[1.0, b] for b, _ in points], [t for _, t in points])
    if per_byte <= 0:
        raise RuntimeError(f"the link's round trips do not grow with their bytes: {points}")
    return {"bytes_s": 1 / per_byte, "latency_s": base / 2,
            "points": [{"bytes": b, "round_trip_s": t} for b, t in points]}  # fmt: skip


def part_priors(cfg, weights, dtype, block_size: int) -> dict[str, tuple[float, float]]:
    """Each layer part's (a, c) in the torch executor's own prior (its prior_cost on a
    stage holding that part alone)."""
    out: dict[str, tuple[float, float]] = {}
    last = cfg.num_layers - 1

    def prior(modules) -> tuple[float, float]:
        a, c, _, _ = TorchExecutor(modules, 4, block_size, snapshot_capacity=1).prior_cost()
        return a, c

    for i in range(last):
        for part, kind in ((0, f"mixer:{cfg.mixers[i]}"), (1, f"mlp:{cfg.mlps[i]}")):
            if kind not in out:
                units = range(2 * i + part, 2 * i + part + 1)
                out[kind] = prior(build_stage(cfg, range(0), False, False, weights, "cpu",
                                              dtype, units))  # fmt: skip
    out["last_layer"] = prior(build_stage(cfg, range(last, last + 1), False, True, weights,
                                          "cpu", dtype))  # fmt: skip
    return out


def calibrate(model: str, threads: int, dtype_name: str, block_size: int, repeats: int,
              seed: int, log=print, grid=GRID, link: bool = True) -> dict:  # fmt: skip
    """The profile's JSON form: fits, machine facts and raw points, measured on ``grid``'s
    (chunks, new tokens, cached prefix) waves; ``link``: also the data plane between two
    local processes."""
    threads = set_threads(threads)
    cfg = BUILTIN[model]
    dtype = pick_dtype(dtype_name)
    weights = random_weights(cfg, seed)
    device = torch.device("cpu")
    whole = build_stage(cfg, range(cfg.num_layers), True, True, weights, device, dtype)
    raw: dict[str, list[tuple[float, float, float, float]]] = defaultdict(list)
    points, residuals, spreads = [], [], []
    timed_parts = 2 * (cfg.num_layers - 1) + 1  # parts timed as stages: each pays the wave cost
    for chunks, tokens, prefix in grid:
        started = time.perf_counter()
        shape = WaveShape(chunks, tokens, prefix)
        costs = measure(cfg, weights, shape, device, dtype, block_size, repeats=repeats)
        total = chunks * tokens
        pairs = chunks * attention_pairs(prefix, tokens)
        times = wave_times(whole, shape, block_size, True, repeats)
        whole_s = statistics.median(times)
        spreads.append(statistics.pstdev(times) / whole_s)
        parts_s = (sum(costs.mixers) + sum(costs.mlps) + costs.last_layer + costs.embed
                   + costs.head)  # fmt: skip
        residuals.append((parts_s - whole_s) / (timed_parts - 1))
        seen = {}
        for i in range(cfg.num_layers - 1):
            seen[f"mixer:{cfg.mixers[i]}"] = costs.mixers[i]
            seen[f"mlp:{cfg.mlps[i]}"] = costs.mlps[i]
        seen["last_layer"] = costs.last_layer
        for key, seconds in seen.items():
            raw[key].append((total, pairs, chunks, seconds))
        raw["embed"].append((total, 0.0, chunks, costs.embed))
        raw["head"].append((chunks, 0.0, chunks, costs.head))
        points.append({"chunks": chunks, "tokens": tokens, "prefix": prefix,
                       "parts_s": seen | {"embed": costs.embed, "head": costs.head},
                       "whole_s": times})  # fmt: skip
        log(f"  {shape.describe()}: whole model {whole_s * 1e3:.2f} ms, parts "
            f"{parts_s * 1e3:.2f} ms ({time.perf_counter() - started:.1f} s)")
    overhead = max(0.0, statistics.median(residuals))
    priors = part_priors(cfg, weights, dtype, block_size)
    parts = {}
    for key, pts in raw.items():
        staged = key not in ("embed", "head")  # timed as a stage: its wave cost comes off
        pts = [(t, p, n, max(0.0, s - overhead) if staged else s) for t, p, n, s in pts]
        a, c = priors.get(key, (0.0, 0.0))
        wave, token, pair, chunk = fit_part(pts, grows_with_prefix(key), per_chunk=staged)
        parts[key] = PartCost(wave, token, pair, prior_a=a, prior_c=c, chunk_s=chunk)
    link_fit = None
    if link:
        link_fit = measure_link(cfg.d_model * torch.empty((), dtype=dtype).element_size(),
                                dtype, repeats)  # fmt: skip
        log(f"  link: {link_fit['bytes_s'] / 1e9:.2f} GB/s, {link_fit['latency_s'] * 1e6:.0f} "
            "us a message")
    profile = MeasuredProfile(
        model=model, d_model=cfg.d_model, vocab=cfg.vocab_size, mixers=cfg.mixers, mlps=cfg.mlps,
        act_bytes=torch.empty((), dtype=dtype).element_size(), parts=parts,
        wave_overhead_s=overhead, noise=statistics.median(spreads),
        machine={"cpu": _cpu_model(), "cores": usable_cores(), "threads": threads,
                 "torch": torch.__version__, "python": platform.python_version(),
                 "dtype": dtype_name, "block_size": block_size, "repeats": repeats,
                 "seed": seed, "burn_blocks_s": burn_rate(),
                 "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
        link=None if link_fit is None else LinkProfile("measured", link_fit["bytes_s"],
                                                       link_fit["latency_s"]),
    )  # fmt: skip
    record = profile.to_json(points)
    if link_fit is not None:
        record["link_points"] = link_fit["points"]
    return record


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m wavepp.sim.calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-kimi", choices=sorted(BUILTIN))
    p.add_argument("--out", default=None, help="profile file [default: calibration-MODEL.json]")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads, as each rank of the runs it predicts uses (0: the cores)")
    p.add_argument("--dtype", default="float32", choices=FLOATS)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=7, help="timed waves per point (median)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--no-link", action="store_true",
                   help="skip the data plane's measurement (the sim then charges no transfer)")
    a = p.parse_args(argv)
    if a.repeats < 1 or a.block_size < 1 or a.threads < 0:
        p.error("--repeats and --block-size must be ≥ 1, --threads ≥ 0")
    out = Path(a.out or f"calibration-{a.model}.json")
    started = time.perf_counter()
    print(f"calibrating {a.model} on the torch executor ({len(GRID)} waves)", file=sys.stderr)
    record = calibrate(a.model, a.threads, a.dtype, a.block_size, a.repeats, a.seed,
                       log=lambda line: print(line, file=sys.stderr),
                       link=not a.no_link)  # fmt: skip
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"per-wave overhead {record['wave_overhead_s'] * 1e3:.3f} ms, wave-time spread "
          f"{record['noise']:.1%}; parts:")
    for key, fit in record["parts"].items():
        print(f"  {key:14s} {fit['wave_s'] * 1e3:8.3f} ms + {fit['chunk_s'] * 1e3:6.3f} ms/chunk"
              f" + {fit['token_s'] * 1e6:8.3f} us/token + {fit['pair_s'] * 1e9:8.4f} ns/pair")
    print(f"wrote {out} in {time.perf_counter() - started:.0f} s; use it with "
          f"--executor sim --model {a.model} --sim-device measured:{out}")


if __name__ == "__main__":
    main()
