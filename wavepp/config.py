"""Run configuration: defaults, a TOML file (``--config``), then command-line overrides."""

from __future__ import annotations

import argparse
import importlib
import math
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from wavepp.dtypes import FLOATS
from wavepp.plan.placement import PlacementError, given, parse_counts
from wavepp.rungs import RUNGS as LADDER
from wavepp.workload import WORKLOADS

RUNGS = tuple(LADDER)


# Defaults that depend on the executor: paper-scale shapes for the simulation, sizes a
# 2-core CPU runs in about a minute for the real model. The torch budget: waves of 2,048
# tokens ran vllm_compare's rows 1.2-1.7x faster at P = 1 than waves of 512 (short-suffix
# 65K -> 110K tok/s, cold 4K 6.3K -> 9.1K), and as fast as 4,096 within the noise.
EXECUTOR_DEFAULTS = {
    "sim": {"workload": "short-suffix", "requests": 256, "prompt_tokens": 16384,
            "concurrency": 64, "budget": 8192, "min_budget": 512, "block_size": 64,
            "model": "qwen3-next-80b", "suffix_tokens": 4096},
    "torch": {"workload": "seeded", "requests": 48, "prompt_tokens": 2048, "concurrency": 8,
              "budget": 2048, "min_budget": 64, "block_size": 16, "model": "tiny-kimi",
              "suffix_tokens": 256},
}  # fmt: skip


SIM_DEVICES = ("h100", "h200", "b200", "b300", "gb300")  # wavepp.sim.profiles.DEVICES
# The sim's default wave-time spread (coefficient of variation): the run-to-run spread of
# the torch runs in the recorded validation (benchmarks.validate.run_spread over
# docs/results/validate-quick.json, rounded; a test keeps the two equal).
SIM_NOISE = 0.032


@attrs.frozen
class RunConfig:
    executor: str = "torch"
    workload: str | None = None
    trace: str | None = None
    requests_file: str | None = None
    requests: int | None = None
    prompt_tokens: int | None = None
    cold_tokens: int | None = None
    suffix_tokens: int | None = None
    concurrency: int | None = None
    open_loop: bool = False
    rung: str = "R4"
    policy: str | None = None
    planner: str | None = None
    probe: str | None = None
    eviction: str | None = None
    block_size: int | None = None
    capacity_blocks: str = attrs.field(default="0", converter=str)
    snapshot_interval: int = 16
    snapshot_capacity: int | None = None
    budget: int | None = None
    min_budget: int | None = None
    ring: int = 0
    max_batch: int = 256
    model: str | None = None
    sim_device: str = "h200"
    sim_tp: int = 1
    sim_link: str | None = None
    sim_noise: float = SIM_NOISE
    sim_burn: bool = False
    weight_format: str | None = None
    device: str = "auto"
    tp: int = 1
    dtype: str = "float32"
    threads: int = 0
    compile: bool = False
    full_last_layer: bool = False
    handoff_to: str | None = None
    handoff_timeout_s: float = 30.0
    handoff_budget_mib: int = 256
    handoff_all: bool = False
    handoff_serve: str | None = None
    handoff_advertise: str | None = None
    handoff_lease_s: float = 30.0
    handoff_secret: str | None = None
    layers_per_stage: str = "auto"
    time_scale: float = 1.0
    seed: int = 0
    json: str | None = None
    trace_out: str | None = None
    heartbeat_s: float = 2.0
    rounds_plane: str = "auto"
    data_plane: str = "auto"
    timeout_s: float = 60.0
    dead_after_s: float = 10.0
    progress: bool = True
    kv_events: str | None = None
    kv_events_replay: str | None = None
    kv_events_topic: str = ""


HELP: dict[str, str] = {
    "executor": "what runs a wave: 'sim' (cost model, labelled simulated) or 'torch' (real model)",
    "workload": "request mix: " + ", ".join(WORKLOADS) + " (docs/design.md §7)",
    "trace": "Mooncake-format JSONL for --workload trace (timestamp, input_length, hash_ids)",
    "requests_file": 'JSONL of {"id": ..., "tokens": [...]} to run instead of a workload',
    "requests": "measured requests (for trace: how many lines of the trace to replay)",
    "prompt_tokens": "prompt length L in tokens (mixed: the warm L1)",
    "cold_tokens": "mixed workload: length L2 of the cold requests (default: 2 x L)",
    "suffix_tokens": "short-suffix workload: tokens each request adds to a cached prompt",
    "concurrency": "closed loop: requests outstanding at once (c)",
    "open_loop": "trace workload: release requests at their timestamps instead of closed loop",
    "rung": "runtime configuration of the ablation ladder: " + ", ".join(RUNGS)
    + " (docs/design.md §8)",
    "planner": "override the policy's planner: 'static', 'mpu', 'cost', or 'pkg.mod:fn'",
    "probe": "override the policy's hint probe: 'gallop' (the default logarithmic probe, a "
    "walk down the tree with bisections), 'linear' or pkg.mod:fn (the signature of "
    "wavepp.state.probe)",
    "policy": "a wavepp Policy (every admission, caching and planning decision) as "
    "pkg.mod:NAME; default: the built-in one (docs/policies.md)",
    "eviction": "override the policy's victim order: 'lru' or pkg.mod:NAME naming a "
    "wavepp.state.Eviction",
    "snapshot_capacity": "recurrent-state snapshot slots per stage (default: as many as KV "
    "blocks)",
    "block_size": "tokens per cached block",
    "capacity_blocks": "KV pool per stage in blocks: one value for every stage, or one per "
    "stage ('4096,6144,6144,3072'); 0: sim, each stage's device memory x 0.9 minus its "
    "weights, over its bytes per block (workload-sized where the weights do not fit); "
    "torch, enough for 1.5 x concurrency prompts",
    "snapshot_interval": "blocks between recurrent-state snapshots on stages with L layers",
    "budget": "M: most tokens in one wave",
    "min_budget": "smallest wave budget MPU may halve to",
    "ring": "waves in flight (0: 2 x stages)",
    "max_batch": "most requests offered to one admission round",
    "model": "sim: profile llama3-70b, qwen3-next-80b, kimi-linear-48b, kimi-k3-class, "
    "glm5-class or minimax-m2-class; torch: tiny-kimi (default: KDA + MLA + MoE), "
    "tiny-hybrid, tiny-llama, small-hybrid, small-llama, or a checkpoint directory "
    "(Hugging Face Llama, Kimi Linear, Qwen3-Next, MiniMax-M2; or WavePP's layout)",
    "sim_device": "device profile of the sim executor: h100, h200, b200, b300, gb300, or "
    "measured:FILE (a profile python -m wavepp.sim.calibrate measured on a machine: the "
    "sim then predicts that machine's torch executor for the model it was measured with)",
    "sim_noise": "sim: spread of each wave's time about the cost model's (coefficient of "
    "variation of a lognormal factor, seeded by --seed and the rank; 0: none)",
    "sim_burn": "sim with --sim-device measured:FILE: spend each wave as work on one thread "
    "(hashing, at the rate the profile measured) instead of sleeping it and stretching every "
    "wave by the ranks x threads over the profile's cores, so ranks sharing this machine's "
    "cores, their own host work and a machine slower than at calibration slow the waves as "
    "they slow torch waves",
    "sim_tp": "sim: devices per stage, tensor parallel with experts spread over them (each "
    "does 1/T of every layer and holds 1/T of the weights and of the KV its heads split; "
    "two all-reduces per layer over the node's link); modelled, still one rank per stage",
    "sim_link": "sim: the link every stage's activations cross to the next stage: nvlink4, "
    "nvlink5, pcie5, ib-ndr, ib-xdr or roce-400 (default: the device's node link between "
    "stages in one node, its network between nodes; docs/design.md §6)",
    "weight_format": "sim: weight format bf16, fp8 or nvfp4 (bytes streamed per parameter, "
    "matrix rate); default: the model profile's (nvfp4 for the paper's models)",
    "device": "torch executor: 'cuda' (this rank's GPU by LOCAL_RANK), 'cpu', or 'auto' "
    "(cuda when present)",
    "tp": "torch executor: ranks per stage, tensor parallel (attention and linear-attention "
    "heads, MLP widths and the pools split over them, MoE experts spread; MLA's latent cache "
    "whole on each); the world is stages x tp ranks, a stage's ranks adjacent "
    "(docs/design.md §6)",
    "dtype": "torch executor: dtype of weights, checkpoint loading, activations and the KV "
             "pool (recurrent states and their snapshots stay float32)",
    "threads": "CPU threads per rank (0: the cores divided by the ranks on this node)",
    "compile": "torch executor: run Llama-shaped layers' norms, projections, rotary embedding "
    "and MLP through torch.compile (Inductor; needs a C++ compiler on CPU); compiled at "
    "start-up, in about 10-40 s on two cores, cached across runs; other layer kinds stay eager",
    "full_last_layer": "torch executor: run the model's last layer (attention, MLP) for every "
    "token, as a plain forward does; by default it runs for each finished prompt's last token "
    "only, the one row the logits read, and writes its cache for every token",
    "handoff_to": "torch executor: where a request asking for the run's default handoff "
    "(handoff: true) sends its cache: unix:/path or tcp://host:port (docs/handoff.md)",
    "handoff_timeout_s": "a stage's band of a handed-off cache must be acknowledged this many "
    "seconds after the request's last chunk there; then its blocks are released and the "
    "handoff fails (reason timeout)",
    "handoff_budget_mib": "bytes of bands on their way at once, per stage; a band over it "
    "waits its turn (its blocks stay in the pool)",
    "handoff_all": "every measured request of the workload (or requests file) hands its cache "
    "to the default target, as if each asked for handoff: true",
    "handoff_serve": "torch executor: where each stage (a --tp stage's first rank) serves its "
    "bands to decoders that pull them (handoff target pull:, vLLM's P/D protocol; "
    "docs/handoff.md): unix:/dir/NAME (stage s listens on NAME-stage{s}.sock), "
    "tcp://HOST:PORT (stage s on PORT+s; 0: any free port), or auto (a Unix socket in a "
    "private directory per stage); python -m wavepp.serve: auto unless given; offline runs: "
    "none unless given",
    "handoff_advertise": "the host decoders connect to for a --handoff-serve tcp://0.0.0.0:PORT "
    "(or [::]) band server (each node its own)",
    "handoff_lease_s": "a band held for pulling waits this many seconds from the request's last "
    "chunk on its stage for the decoder; then its blocks are released (reason expired); a "
    "pull under way has --handoff-timeout-s from its start instead",
    "handoff_secret": "a file holding the shared secret (16 to 4096 bytes; a trailing newline "
    "dropped) with which the stages sign their bands (HMAC-SHA256, docs/handoff.md) and the "
    "band servers check pulls (and the KV events are signed, --kv-events); default: the "
    "environment variable WAVEPP_HANDOFF_SECRET's value, else none (unsigned)",
    "layers_per_stage": "layers each stage holds: 'auto' (placed so that the stages' busy "
    "times, measured at start-up on the run's typical wave, are equal; a boundary may fall "
    "between a layer's mixer and its MLP, or inside an attention mixer that the two stages "
    "then share by rows), 'even', or counts such as '13,11,12,12', '1.5,2.5' (a half: a "
    "layer's mixer or its MLP) or '1.3,2.7' (stage 0 runs 60%% of layer 1's attention); the "
    "last stage holds the whole last layer",
    "time_scale": "sim: real seconds slept per simulated second (figures are in simulated time)",
    "seed": "seed of the workload and of the random weights",
    "json": "write the run's JSON record here",
    "trace_out": "write a Chrome-trace timeline (Perfetto): waves and bubbles per stage, rounds",
    "heartbeat_s": "rank 0 heartbeat on the rounds plane when idle, seconds",
    "rounds_plane": "transport of the admission rounds: 'local' (Unix sockets around rank 0, "
    "every rank on one host), 'gloo' (a Gloo group, any hosts), or 'auto' (local where "
    "torchrun put every rank on this host, else gloo)",
    "data_plane": "transport of the waves between stages: 'local' (a Unix socket per link, "
    "every rank on one host), 'gloo' (Gloo pair groups, any hosts), or 'auto' (local where "
    "torchrun put every rank on this host and activations are not on NCCL, else gloo)",
    "timeout_s": "timeout of every process group, seconds",
    "dead_after_s": "a rank whose watchdog heartbeat stalls this long is named dead or hung "
    "and the run exits non-zero",
    "progress": "show a progress bar on rank 0 (--no-progress to hide)",
    "kv_events": "publish the pipeline's reusable cache as vLLM KV events (ZMQ PUB, bound on "
    "rank 0): tcp://HOST:PORT, HOST an address or * (docs/fleet.md)",
    "kv_events_replay": "the KV events' replay socket (ZMQ ROUTER): tcp://HOST:PORT "
    "(default: --kv-events' port + 1; port 0 there: any free port)",
    "kv_events_topic": "the topic frame of every KV-event message",
}


CHOICES: dict[str, tuple[str, ...]] = {
    "executor": ("sim", "torch"), "workload": (*WORKLOADS, "file"), "rung": RUNGS,
    "device": ("auto", "cpu", "cuda"), "rounds_plane": ("auto", "local", "gloo"),
    "data_plane": ("auto", "local", "gloo"),
    "sim_link": ("nvlink4", "nvlink5", "pcie5", "ib-ndr", "ib-xdr", "roce-400"),
    "weight_format": ("bf16", "fp8", "nvfp4"),
    "dtype": FLOATS,
}  # fmt: skip
"""Options that take one of a few names (checked for every source, like the types)."""

_AT_LEAST_1 = (lambda v: v >= 1, "≥ 1")
_AT_LEAST_0 = (lambda v: v >= 0, "≥ 0")
_POSITIVE = (lambda v: v > 0, "positive")
LIMITS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "requests": _AT_LEAST_1, "prompt_tokens": _AT_LEAST_1, "cold_tokens": _AT_LEAST_1,
    "suffix_tokens": _AT_LEAST_1, "concurrency": _AT_LEAST_1, "block_size": _AT_LEAST_1,
    "snapshot_interval": _AT_LEAST_1, "snapshot_capacity": _AT_LEAST_1, "budget": _AT_LEAST_1,
    "min_budget": _AT_LEAST_1, "ring": _AT_LEAST_0, "max_batch": _AT_LEAST_1,
    "sim_device": (lambda v: v in SIM_DEVICES or (v.startswith("measured:") and len(v) > 9),
                   "one of " + ", ".join(SIM_DEVICES) + ", or measured:FILE"),
    "sim_noise": (lambda v: 0 <= v <= 1, "between 0 and 1"),
    "threads": _AT_LEAST_0, "sim_tp": _AT_LEAST_1, "tp": _AT_LEAST_1, "time_scale": _POSITIVE,
    "seed": _AT_LEAST_0,
    "heartbeat_s": _POSITIVE, "timeout_s": _POSITIVE, "dead_after_s": _POSITIVE,
    "handoff_timeout_s": _POSITIVE,
    "handoff_budget_mib": _AT_LEAST_1, "handoff_lease_s": _POSITIVE,
    "kv_events": (lambda v: v is None or _zmq_tcp(v), "tcp://HOST:PORT (PORT 0..65535)"),
    "kv_events_replay": (lambda v: v is None or _zmq_tcp(v), "tcp://HOST:PORT (PORT 0..65535)"),
    "kv_events_topic": (lambda v: len(v) <= 256, "at most 256 characters"),
}  # fmt: skip
"""Per-option bounds beyond the type (an option not listed takes any value of its type)."""

def _zmq_tcp(text: str) -> bool:
    """Whether ``text`` is a ZMQ TCP endpoint WavePP binds: tcp://HOST:PORT."""
    head, _, port = text.rpartition(":")
    return (text.startswith("tcp://") and len(head) > len("tcp://") and port.isdigit()
            and int(port) <= 65535)  # fmt: skip


def kv_events_replay(c: RunConfig) -> str | None:
    """The replay endpoint: ``--kv-events-replay``, else the events' port + 1 (0 stays 0)."""
    if c.kv_events_replay or not c.kv_events:
        return c.kv_events_replay
    head, _, port = c.kv_events.rpartition(":")
    return f"{head}:{int(port) + 1 if int(port) else 0}"


_KINDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _kind(name: str) -> tuple[str, bool]:
    """(base type name, whether None is allowed) of a RunConfig field, from its annotation."""
    text = str(attrs.fields_dict(RunConfig)[name].type).replace(" ", "")
    optional = text.endswith("|None")
    base = text.removesuffix("|None")
    return ("str" if name == "capacity_blocks" else base), optional


class OptionError(ValueError):
    """A run option's value is refused; the message names the option (and its source)."""


def check_option(name: str, value: Any, source: str | None = None) -> Any:
    """The value of option ``name`` if it has the field's type, choices and bounds, else
    :class:`OptionError` naming the option and ``source`` (a TOML file, "RunConfig", or
    None for the command line, whose text is converted first). The one check every source
    of options goes through: the command line, ``--config`` files and the Python API."""
    base, optional = _kind(name)
    where = f" (in {source})" if source else ""
    given = value

    def refuse(what: str) -> OptionError:
        return OptionError(f"{flag(name)} must be {what}, got {given!r}{where}")

    if value is None and optional:
        return None
    if source is None and isinstance(value, str) and base in ("int", "float"):
        try:  # the command line's text
            value = int(value) if base == "int" else float(value)
        except ValueError:
            raise refuse(_KINDS[base]) from None
    if name == "capacity_blocks" and isinstance(value, int) and not isinstance(value, bool):
        value = str(value)  # TOML's capacity_blocks = 2048
    if base == "bool":
        ok = isinstance(value, bool)
    elif base == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif base == "float":
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
        ok = ok and math.isfinite(value)
    else:
        ok = isinstance(value, str)
    if not ok:
        raise refuse(_KINDS.get(base, base))
    if name in CHOICES and value not in CHOICES[name]:
        raise refuse("one of " + ", ".join(CHOICES[name]))
    if name in LIMITS and not LIMITS[name][0](value):
        raise refuse(LIMITS[name][1])
    try:
        if name == "capacity_blocks":
            capacity_list(value)
        elif name == "layers_per_stage":
            layer_counts(value)
    except OptionError as error:
        raise OptionError(f"{error}{where}") from None
    return value


def parser() -> argparse.ArgumentParser:
    """Every option is parsed as text (or a flag) and checked by :func:`check_option`."""
    p = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node P -m wavepp.main",
        description="WavePP: pipeline-parallel prefill with asynchronous admission. One rank "
        "per pipeline stage (--tp T: T ranks a stage); rank 0 owns the requests and prints "
        "the report.",
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument("--config", metavar="TOML", help="read options from a TOML file first")
    for field in attrs.fields(RunConfig):
        default = field.default
        if default is None and field.name in EXECUTOR_DEFAULTS["sim"]:
            default = " / ".join(f"{k}: {v[field.name]}" for k, v in EXECUTOR_DEFAULTS.items())
        text = f"{HELP[field.name]} [default: {default}]"
        if _kind(field.name)[0] == "bool":
            p.add_argument(flag(field.name), action=argparse.BooleanOptionalAction, help=text)
            continue
        names = [c for c in CHOICES.get(field.name, ()) if c != "file"]
        metavar = "{" + ",".join(names) + "}" if names else None
        p.add_argument(flag(field.name), metavar=metavar, help=text)
    return p


def load(argv: list[str] | None = None, others: frozenset[str] = frozenset()) -> RunConfig:
    """Defaults, then the ``--config`` file, then the command line; every value checked.
    ``others``: keys of the file that a caller reads itself (the server's own options)."""
    args = vars(parser().parse_args(argv))
    values: dict[str, Any] = {}
    try:
        if "config" in args:
            path = Path(args.pop("config"))
            try:
                data = tomllib.loads(path.read_text(encoding="utf-8-sig"))
            except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
                raise OptionError(f"--config {path}: {error}") from None
            known = {f.name for f in attrs.fields(RunConfig)}
            for key, value in data.items():
                name = key.replace("-", "_")
                if name in others:
                    continue
                if name not in known:
                    raise OptionError(f"{path}: unknown option {key!r}")
                values[name] = check_option(name, value, str(path))
        values.update({name: check_option(name, value) for name, value in args.items()})
    except OptionError as error:
        raise SystemExit(f"wavepp: {error}") from None
    executor = values.get("executor", attrs.fields(RunConfig).executor.default)
    for key, value in EXECUTOR_DEFAULTS.get(executor, {}).items():
        if values.get(key) is None:
            values[key] = value
    if values.get("requests_file"):
        values["workload"] = "file"
    config = RunConfig(**values)
    validate(config)
    return config


def handoff_secret(c: RunConfig) -> bytes | None:
    """The run's shared secret (``--handoff-secret`` FILE, else $WAVEPP_HANDOFF_SECRET),
    or None; ValueError (one line) for one that cannot be read or is too short."""
    from wavepp.handoff.auth import load_secret

    return load_secret(c.handoff_secret)


def validate(c: RunConfig) -> None:
    """Every option's type, choices and bounds (a RunConfig built in Python included), then
    the checks across options. Raises SystemExit with one line naming the option."""
    try:
        for field in attrs.fields(RunConfig):
            check_option(field.name, getattr(c, field.name), "RunConfig")
        capacity_list(c.capacity_blocks)
        layer_counts(c.layers_per_stage)
    except OptionError as error:
        raise SystemExit(f"wavepp: {error}") from None

    def need(ok: bool, message: str) -> None:
        if not ok:
            raise SystemExit(f"wavepp: {message}")

    need(
        c.budget >= c.min_budget >= 1,
        f"need --budget ≥ --min-budget ≥ 1, got {c.budget}, {c.min_budget}",
    )
    need(c.workload != "trace" or c.trace, "--workload trace needs --trace PATH")
    need(not c.compile or c.executor == "torch", "--compile applies to --executor torch only")
    need((c.sim_tp == 1 and c.sim_link is None) or c.executor == "sim",
         "--sim-tp and --sim-link apply to --executor sim only")
    need(not c.sim_device.startswith("measured:") or (c.sim_tp == 1 and c.sim_link is None),
         "--sim-device measured:FILE models this machine's ranks: no --sim-tp or --sim-link")
    need(not c.sim_burn or (c.executor == "sim" and c.sim_device.startswith("measured:")),
         "--sim-burn applies to --executor sim with --sim-device measured:FILE only")
    need(c.tp == 1 or c.executor == "torch",
         "--tp applies to --executor torch (the sim models tensor parallelism with --sim-tp)")
    need(not c.full_last_layer or c.executor == "torch",
         "--full-last-layer applies to --executor torch only")
    need(not c.handoff_all or bool(c.handoff_to),
         "--handoff-all needs a default target: --handoff-to ADDRESS")
    need(not c.kv_events_replay or bool(c.kv_events), "--kv-events-replay needs --kv-events")
    need(not c.kv_events or kv_events_replay(c) != c.kv_events or c.kv_events.endswith(":0"),
         "--kv-events and --kv-events-replay must differ")
    need(not c.handoff_to or c.executor == "torch", "--handoff-to applies to --executor torch only")
    need(not (c.handoff_serve or c.handoff_advertise) or c.executor == "torch",
         "--handoff-serve / --handoff-advertise apply to --executor torch only")
    if c.handoff_serve:
        from wavepp.handoff.pull import advertised, band_server_address

        try:
            if c.handoff_serve != "auto":
                advertised(band_server_address(c.handoff_serve, 0), c.handoff_advertise)
        except ValueError as error:
            raise SystemExit(f"wavepp: --handoff-serve: {error}") from None
    try:
        handoff_secret(c)
    except ValueError as error:
        raise SystemExit(f"wavepp: --handoff-secret: {error}") from None
    if c.handoff_to:
        from wavepp.handoff.wire import parse_address

        try:
            parse_address(c.handoff_to)
        except ValueError as error:
            raise SystemExit(f"wavepp: --handoff-to: {error}") from None


def capacity_list(text: str) -> list[int]:
    """``--capacity-blocks`` as block counts (``[0]``: size the pools automatically)."""
    try:
        values = [int(part.strip()) for part in text.split(",")]
    except ValueError:
        raise OptionError(f"--capacity-blocks {text!r} is not a block count or a "
                          "comma-separated list of them") from None  # fmt: skip
    if values != [0] and min(values) < 1:
        raise OptionError(f"--capacity-blocks: every stage needs a pool of ≥ 1 block, got "
                          f"{text!r} (0 alone: sized automatically)")  # fmt: skip
    return values


def layer_counts(text: str) -> list[float] | None:
    """``--layers-per-stage`` as layer counts (None: 'auto' or 'even')."""
    if text in ("auto", "even"):
        return None
    try:
        return parse_counts(text)
    except PlacementError as error:
        raise OptionError(str(error)) from None


def check_for_world(c: RunConfig, world: int, num_layers: int | None = None) -> None:
    """The checks that need the number of stages (and the model's layer count, when known):
    run before the ranks start (the launcher, or each rank before its process groups)."""
    try:
        counts = layer_counts(c.layers_per_stage)
        pools = capacity_list(c.capacity_blocks)
    except OptionError as error:
        raise SystemExit(f"wavepp: {error}") from None
    if counts is not None and len(counts) != world:
        raise SystemExit(f"wavepp: --layers-per-stage {c.layers_per_stage} gives {len(counts)} "
                         f"counts for {world} stages (ranks / --tp); give one per stage")
    if counts is not None and num_layers is not None:
        try:
            given(counts, num_layers)
        except PlacementError as error:
            raise SystemExit(f"wavepp: {error}") from None
    if num_layers is not None and counts is None and num_layers < world:
        raise SystemExit(f"wavepp: the model has {num_layers} layers, fewer than the {world} "
                         "stages")  # fmt: skip
    if len(pools) not in (1, world):
        raise SystemExit(f"wavepp: --capacity-blocks gives {len(pools)} pools for {world} "
                         "stages; give one value, or one per stage")  # fmt: skip


def stage_capacities(c: RunConfig, world: int) -> list[int] | None:
    """``--capacity-blocks`` per stage, or None to size the pools from the workload."""
    check_for_world(c, world)
    values = capacity_list(c.capacity_blocks)
    if values == [0]:
        return None
    return values * world if len(values) == 1 else values


def resolve(dotted: str) -> Any:
    """``pkg.mod:name`` (or ``pkg.mod.name``) to the object it names."""
    module, _, name = dotted.partition(":") if ":" in dotted else dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise SystemExit(f"wavepp: cannot load {dotted!r}: {error}") from None
