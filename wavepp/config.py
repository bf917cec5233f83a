"""Run configuration: defaults, a TOML file (``--config``), then command-line overrides."""

from __future__ import annotations

import argparse
import importlib
import tomllib
from pathlib import Path
from typing import Any

import attrs

from wavepp.workload import WORKLOADS

RUNGS = ("R1", "R2", "R3", "R4", "R5", "oracle")
RUNG_PLANNER = {"R1": "static", "R2": "static", "R3": "static", "R4": "mpu", "R5": "cost",
                "oracle": "mpu"}  # fmt: skip


@attrs.frozen
class RunConfig:
    executor: str = "sim"
    workload: str = "short-suffix"
    trace: str | None = None
    requests: int = 256
    prompt_tokens: int = 16384
    cold_tokens: int | None = None
    suffix_tokens: int = 4096
    concurrency: int = 64
    open_loop: bool = False
    rung: str = "R4"
    planner: str | None = None
    probe: str | None = None
    block_size: int = 64
    capacity_blocks: int = 0
    snapshot_interval: int = 16
    budget: int = 8192
    min_budget: int = 512
    ring: int = 0
    max_batch: int = 256
    model: str = "qwen3-next-80b"
    device: str = "h200"
    layers_per_stage: str | None = None
    time_scale: float = 1.0
    seed: int = 0
    json: str | None = None
    heartbeat_s: float = 2.0
    timeout_s: float = 120.0
    progress: bool = True


HELP: dict[str, str] = {
    "executor": "what runs a wave: 'sim' (cost model, labelled simulated) or 'torch' (real model)",
    "workload": "request mix: " + ", ".join(WORKLOADS) + " (DESIGN §7)",
    "trace": "Mooncake-format JSONL for --workload trace (timestamp, input_length, hash_ids)",
    "requests": "measured requests (for trace: how many lines of the trace to replay)",
    "prompt_tokens": "prompt length L in tokens (mixed: the warm L1)",
    "cold_tokens": "mixed workload: length L2 of the cold requests (default: 2 x L)",
    "suffix_tokens": "short-suffix workload: tokens each request adds to a cached prompt",
    "concurrency": "closed loop: requests outstanding at once (c)",
    "open_loop": "trace workload: release requests at their timestamps instead of closed loop",
    "rung": "runtime configuration of the ablation ladder: " + ", ".join(RUNGS) + " (DESIGN §8)",
    "planner": "override the rung's planner: 'static', 'mpu', or a dotted path 'pkg.mod:fn'",
    "probe": "override the hint probe with a dotted path 'pkg.mod:fn' (signature of state.probe)",
    "block_size": "tokens per cached block",
    "capacity_blocks": "KV pool per stage in blocks (0: enough for 1.5 x concurrency prompts)",
    "snapshot_interval": "blocks between recurrent-state snapshots on stages with L layers",
    "budget": "M: most tokens in one wave",
    "min_budget": "smallest wave budget MPU may halve to",
    "ring": "waves in flight (0: 2 x stages)",
    "max_batch": "most requests offered to one admission round",
    "model": "model profile (sim) — llama3-70b or qwen3-next-80b",
    "device": "device profile (sim) — h100, h200 or b200",
    "layers_per_stage": "uneven split, e.g. '13,11,12,12' (default: even)",
    "time_scale": "sim: real seconds slept per simulated second (figures are in simulated time)",
    "seed": "seed of the workload (and of torch weights)",
    "json": "write the run's JSON record here",
    "heartbeat_s": "rank 0 heartbeat on the rounds plane when idle, seconds",
    "timeout_s": "timeout of every process group, seconds",
    "progress": "show a progress bar on rank 0 (--no-progress to hide)",
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node P -m wavepp.main",
        description="WavePP: pipeline-parallel prefill with asynchronous admission. One rank "
        "per pipeline stage; rank 0 owns the requests and prints the report.",
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument("--config", metavar="TOML", help="read options from a TOML file first")
    for field in attrs.fields(RunConfig):
        flag = "--" + field.name.replace("_", "-")
        text = f"{HELP[field.name]} [default: {field.default}]"
        if field.type in ("bool", bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, help=text)
            continue
        kind = {"int": int, "float": float}.get(str(field.type), str)
        if str(field.type).startswith("int |"):
            kind = int
        choices = {"executor": ("sim", "torch"), "workload": WORKLOADS, "rung": RUNGS}
        p.add_argument(flag, type=kind, choices=choices.get(field.name), help=text)
    return p


def load(argv: list[str] | None = None) -> RunConfig:
    args = vars(parser().parse_args(argv))
    values: dict[str, Any] = {}
    if "config" in args:
        path = Path(args.pop("config"))
        data = tomllib.loads(path.read_text())
        known = {f.name for f in attrs.fields(RunConfig)}
        for key, value in data.items():
            name = key.replace("-", "_")
            if name not in known:
                raise SystemExit(f"{path}: unknown option {key!r}")
            values[name] = value
    values.update(args)
    config = RunConfig(**values)
    validate(config)
    return config


def validate(c: RunConfig) -> None:
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise SystemExit(f"wavepp: {message}")

    need(c.requests >= 1, f"--requests must be ≥ 1, got {c.requests}")
    need(c.prompt_tokens >= 1, f"--prompt-tokens must be ≥ 1, got {c.prompt_tokens}")
    need(c.concurrency >= 1, f"--concurrency must be ≥ 1, got {c.concurrency}")
    need(c.block_size >= 1, f"--block-size must be ≥ 1, got {c.block_size}")
    need(
        c.budget >= c.min_budget >= 1,
        f"need --budget ≥ --min-budget ≥ 1, got {c.budget}, {c.min_budget}",
    )
    need(c.workload != "trace" or c.trace, "--workload trace needs --trace PATH")
    need(c.time_scale > 0, f"--time-scale must be positive, got {c.time_scale}")


def resolve(dotted: str) -> Any:
    """``pkg.mod:name`` (or ``pkg.mod.name``) to the object it names."""
    module, _, name = dotted.partition(":") if ":" in dotted else dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise SystemExit(f"wavepp: cannot load {dotted!r}: {error}") from None
