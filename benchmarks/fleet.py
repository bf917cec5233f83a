"""``python -m benchmarks.fleet``: fleets of pipelines behind the router, per routing policy
(issues 33 and 58). Every figure is SIMULATED except with ``--executor torch``.

For each fleet size N (``--replicas``) it starts N replicas — each ``python -m
wavepp.serve.launch --nproc-per-node P`` on this host, one ``torchrun`` job a pipeline, with
KV events — and, per policy, ``python -m wavepp.route`` over them.

- **Conversation traces** (``chat``, ``docs``, ``agent``: ``wavepp.workload.sessions`` by
  ``--seeds``; ``mooncake``: the trace in ``data/mooncake``) are replayed by
  ``benchmarks._replay`` at ``--loads`` (fractions of N × ``--pipeline-tok-s``, one
  pipeline's nominal cold throughput; a load compresses the trace's clock), a turn never
  before its previous turn's answer, the router explaining each choice (``--explain``). A
  replica's pool is the trace's working set / N; the comparison is one big pipeline of the
  same total size: P × N stages, N × the pool per stage. Per run: throughput, reused share
  against one unbounded cache's, completion p50/p99, and why reuse was lost
  (``wavepp.route.explain``).
- **``conversation``** (``wavepp.bench.load``'s workload, 1/N of its working set per
  replica) as Poisson arrivals at ``--loads``, or closed loop (``--closed-loop C``: C
  requests in flight a replica); deadlines ``--slo-conversation-s``; the ceiling is one
  P-stage pipeline with N × the pool (one pipeline's compute: a ceiling on reuse only).

Each run's prompts are the same requests with token ids shifted per run: no run reuses
another's cache. Writes a JSON record (``--json``); ``--plots DIR``: SLO plots.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import anyio
import attrs
import httpx
import numpy as np

from benchmarks._replay import goal_table, measure, session_line, session_table, why_table
from wavepp.bench import load as load_bench
from wavepp.state import block_hashes
from wavepp.workload import RequestSpec
from wavepp.workload.sessions import SHAPES, replay_order, session_trace, write_trace

POLICIES = ("round-robin", "least-load", "prefix", "cost", "text-tree")
SESSION_WORKLOADS = ("chat", "docs", "agent", "mooncake")  # replayed by benchmarks._replay
PREFIX_BEFORE = "wavepp.route.policies:prefix_before"  # prefix before issue 58


def _sim_argv(setup: Setup) -> list[str]:  # what a replica runs: chosen once, by name
    return ["--executor", "sim", "--model", setup.model, "--time-scale", str(setup.time_scale)]


def _torch_argv(setup: Setup) -> list[str]:
    return ["--executor", "torch", "--model", setup.model, "--device", "cpu", "--threads", "1",
            "--block-size", str(BLOCK_SIZE["torch"])]  # fmt: skip


EXECUTORS = {"sim": _sim_argv, "torch": _torch_argv}
BLOCK_SIZE = {"sim": 64, "torch": 16}  # the servers' default block sizes
VOCAB = {"sim": 32_000, "torch": 512}  # token ids below this (tiny models' vocabularies)
MOONCAKE_LINES = 400  # the Mooncake trace's lines replayed unless --requests says
TORCH_MAX_INPUT = 3072  # a torch run's conversations end before their prompt passes this
TRACE = Path(__file__).resolve().parents[1] / "data" / "mooncake" / "synthetic_trace.jsonl"
START_TIMEOUT_S = 180.0
ROOT = Path(__file__).resolve().parents[1]


@attrs.frozen
class Setup:
    """One bench configuration (what ``--quick`` and the full run differ in)."""

    replicas: tuple[int, ...]
    stages: int
    policies: tuple[str, ...]
    workloads: tuple[str, ...]
    loads: tuple[float, ...]  # offered load as a fraction of N × pipeline_tok_s
    requests: int  # measured requests per run
    time_scale: float  # real seconds per simulated second
    pipeline_tok_s: float  # one pipeline's cold prefill throughput, simulated tok/s
    slo_s: dict  # workload -> deadline, simulated seconds after submission
    model: str
    conversation_tokens: int  # the conversation workload's --prompt-tokens
    seed: int
    closed_loop: int | None = None  # requests in flight per replica instead of rates
    seeds: tuple[int, ...] = ()  # the session workloads' trace seeds (each its own runs)
    trace_lines: int | None = None  # a conversation trace's first lines (None: all; 400 of
    #                                 the Mooncake trace)
    executor: str = "sim"  # what the replicas run: sim, or torch (a small real model)
    route_options: tuple[str, ...] = ()  # more options for every router


def _free_ports(count: int) -> list[int]:
    """``count`` distinct free ports on 127.0.0.1, all held while they are chosen, below
    the kernel's ephemeral range: a port is free between its choice here and its child's
    bind, and a port the kernel hands out meanwhile (a Gloo or torchrun connection, a
    client's socket) comes from that range, never from these (one Mooncake run lost a
    replica to "Address already in use" with ports the kernel had picked)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default lower end
    rng = random.Random()
    held: list[socket.socket] = []
    try:
        for _ in range(50 * count):
            if len(held) == count:
                break
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", rng.randrange(10000, max(low, 10001))))
            except OSError:
                s.close()
                continue
            held.append(s)
        if len(held) < count:
            raise RuntimeError(f"no {count} free ports below {low} on 127.0.0.1")
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def _log(text: str) -> None:
    print(f"[benchmarks.fleet] {text}", file=sys.stderr, flush=True)


class Processes:
    """Child processes started here, stopped with SIGTERM (then SIGKILL) in reverse order."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.children: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "w")  # noqa: SIM115 — closed with the child
        child = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)  # fmt: skip
        self.children.append((name, child))
        return child

    def stop(self, child: subprocess.Popen, grace_s: float = 30.0) -> None:
        if child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signal.SIGTERM)
            try:
                child.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
                child.wait(10)
        self.children = [(n, c) for n, c in self.children if c is not child]

    def stop_all(self) -> None:
        for _, child in reversed(list(self.children)):
            self.stop(child)

    def tail(self, name: str, lines: int = 15) -> str:
        path = self.logs / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _wait_healthy(url: str, child: subprocess.Popen, name: str, procs: Processes) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise SystemExit(f"benchmarks.fleet: {name} exited {child.returncode}:\n"
                             f"{procs.tail(name)}")  # fmt: skip
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        time.sleep(0.5)
    raise SystemExit(f"benchmarks.fleet: {name} not healthy after {START_TIMEOUT_S:g} s:\n"
                     f"{procs.tail(name)}")  # fmt: skip


@contextlib.contextmanager
def replicas(procs: Processes, setup: Setup, count: int, capacity_blocks: int | None,
             label: str, stages: int | None = None) -> Iterator[list[str]]:  # fmt: skip
    """``count`` pipelines of ``stages`` (default ``setup.stages``) stages; their URLs."""
    urls, started = [], []
    ports = _free_ports(3 * count)  # each replica's HTTP, events and replay ports, distinct
    for i in range(count):
        port, pub, replay = ports[3 * i : 3 * i + 3]
        argv = [sys.executable, "-m", "wavepp.serve.launch",
                f"--nproc-per-node={stages or setup.stages}", "--port", str(port),
                *EXECUTORS[setup.executor](setup), "--no-progress", "--log-level", "warning"]
        if capacity_blocks is not None:
            argv += ["--capacity-blocks", str(capacity_blocks)]
        argv += ["--kv-events", f"tcp://127.0.0.1:{pub}",
                 "--kv-events-replay", f"tcp://127.0.0.1:{replay}"]
        name = f"{label}-replica{i}"
        started.append((name, procs.start(name, argv)))
        urls.append(f"http://127.0.0.1:{port}")
    try:
        for (name, child), url in zip(started, urls, strict=True):
            _wait_healthy(url, child, name, procs)
        yield urls
    finally:
        for _, child in started:
            procs.stop(child)


@contextlib.contextmanager
def router(procs: Processes, urls: Sequence[str], policy: str, label: str,
           options: Sequence[str] = ()) -> Iterator[str]:  # fmt: skip
    port = _free_ports(1)[0]
    argv = [sys.executable, "-m", "wavepp.route", "--port", str(port), "--policy",
            PREFIX_BEFORE if policy == "prefix-before" else policy, *options]  # fmt: skip
    for url in urls:
        argv += ["--replica", url]
    name = f"{label}-router-{policy}"
    child = procs.start(name, argv)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, child, name, procs)
        yield url
    finally:
        procs.stop(child)


# -- the workloads ---------------------------------------------------------------------------


def _shifted(specs: list[RequestSpec], run: int, vocab: int) -> list[RequestSpec]:
    """The same requests with fresh token ids: no run reuses an earlier run's cache."""
    offset = (run * 7919) % vocab
    return [attrs.evolve(s, tokens=((s.tokens.astype(np.int64) + offset) % vocab)
                         .astype(np.int32)) for s in specs]  # fmt: skip


def base_specs(workload: str, setup: Setup, block_size: int, vocab: int) -> list[RequestSpec]:
    """The measured requests of one workload, closed-loop (arrivals are set per rate)."""
    args = load_bench.parser().parse_args(_load_argv(workload, setup, "http://x", None, None))
    return [s for s in load_bench.build_specs(args, vocab, block_size) if not s.warmup]


def _load_argv(workload: str, setup: Setup, url: str, rate: float | None,
               trace_scale: float | None, concurrency: int = 1024) -> list[str]:  # fmt: skip
    argv = ["--url", url, "--concurrency", str(concurrency), "--requests", str(setup.requests),
            "--seed", str(setup.seed), "--no-progress", "--timeout-s", "600"]  # fmt: skip
    argv += ["--workload", workload, "--prompt-tokens", str(setup.conversation_tokens)]
    return argv + (["--rate", repr(rate)] if rate is not None else [])


def working_set_blocks(specs: Sequence[RequestSpec], block_size: int) -> int:
    """Distinct full blocks over the requests: what a cache holding all of them needs."""
    seen: set[int] = set()
    for spec in specs:
        seen.update(block_hashes(spec.tokens, block_size))
    return len(seen)


async def one_run(url: str, workload: str, setup: Setup, load: float | None, fleet: int,
                  run: int) -> dict:  # fmt: skip
    """Replay ``workload`` at ``load`` × the fleet's nominal capacity against ``url``; with
    ``load`` None, closed loop with ``setup.closed_loop`` × ``fleet`` requests in flight
    (the fleet's saturated throughput)."""
    limits = httpx.Limits(max_connections=2048, max_keepalive_connections=256)
    timeout = httpx.Timeout(600.0, connect=30.0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        info = await load_bench.server_info(client)
        vocab, block_size = int(info.get("vocab_size") or 32_000), int(info["block_size"])
        specs = base_specs(workload, setup, block_size, vocab)
        mean_tokens = sum(s.num_tokens for s in specs) / len(specs)
        offered_tok_s = rate = None
        if load is None:
            argv = _load_argv(workload, setup, url, None, None,
                              concurrency=setup.closed_loop * fleet)  # fmt: skip
        else:
            offered_tok_s = load * fleet * setup.pipeline_tok_s  # simulated
            rate = offered_tok_s / mean_tokens  # requests per simulated second
            argv = _load_argv(workload, setup, url, rate / setup.time_scale, None)
        argv += ["--deadline-s", repr(setup.slo_s[workload] * setup.time_scale)]
        args = load_bench.parser().parse_args(argv)
        load_bench.validate(args)
        built = load_bench.with_arrivals(load_bench.build_specs(args, vocab, block_size), args)
        runner = load_bench.LoadRun(args, client, simulated=True)  # sim pipelines
        runner.prefix = f"f{run}-"
        record = await runner.run(_shifted(built, run, vocab))
    return summarize_run(record, setup, workload, load, offered_tok_s, rate)


def summarize_run(record: dict, setup: Setup, workload: str, load: float | None,
                  offered_tok_s: float | None, rate: float | None) -> dict:  # fmt: skip
    """Simulated-second figures of one load run."""
    scale = setup.time_scale
    done = [r for r in record["requests"] if not r["warmup"] and r["status"] == "done"]

    def sim(value):
        return None if value is None else value / scale

    return {
        "simulated": True,
        "workload": workload,
        "load": load,
        "offered_tok_s": offered_tok_s,
        "offered_req_s": rate,
        "closed_loop": None if load is not None else setup.closed_loop,
        "slo_s": setup.slo_s[workload],
        "measured_requests": record["measured_requests"],
        "done": len(done),
        "by_status": record["by_status"],
        "throughput_tok_s": record["throughput_tok_s"] * scale,
        "good_hit_rate": record["good_hit_rate"],
        "reused_share": record["reused_share"],
        "completion_p50_s": sim(record["time_to_result_p50_s"]),
        "completion_p99_s": sim(record["time_to_result_p99_s"]),
        "slo_attainment": record["slo_attainment"],
        "server_slo_attainment": record["server_slo_attainment"],
        "makespan_s": record["makespan_s"] / scale,
    }


# -- the bench -------------------------------------------------------------------------------


def run_bench(setup: Setup, logs: Path) -> dict:
    procs = Processes(logs)
    rows: list[dict] = []
    pools: dict = {}
    run = 0
    try:
        for workload in setup.workloads:
            if workload in SESSION_WORKLOADS:
                for seed in setup.seeds or (setup.seed,):
                    for n in setup.replicas:
                        run = run_sessions(procs, setup, workload, seed, n, rows, pools, run)
                continue
            for n in setup.replicas:
                capacity = _capacity(workload, setup, n)
                pools[f"{workload}/N={n}"] = {"replica": capacity, "ceiling": capacity * n}
                label = f"{workload}-n{n}"
                with replicas(procs, setup, n, capacity, label) as urls:
                    for policy in [p for p in setup.policies if p != "big"]:
                        with router(procs, urls, policy, label) as url:
                            for load in _loads(setup):
                                run += 1
                                row = anyio.run(one_run, url, workload, setup, load, n, run)
                                rows.append({"replicas": n, "policy": policy, **row})
                                _log(_line(rows[-1]))
                with replicas(procs, setup, 1, capacity * n, f"{label}-ceiling") as (url,):
                    for load in _loads(setup):
                        run += 1
                        row = anyio.run(one_run, url, workload, setup, load, n, run)
                        rows.append({"replicas": n, "policy": "ceiling", **row})
                        _log(_line(rows[-1]))
    finally:
        procs.stop_all()
    return {"simulated": setup.executor == "sim", "setup": attrs.asdict(setup),
            "kv_events": True, "pools_blocks": pools, "rows": rows}  # fmt: skip


# -- conversation traces, replayed with the router's explanations ---------------------------


def session_requests(workload: str, seed: int, setup: Setup, folder: Path):
    """(token lists, arrival trace seconds, the turn each follows) of a session workload."""
    path = TRACE if workload == "mooncake" else folder / f"{workload}-s{seed}.jsonl"
    if workload != "mooncake":  # on torch (a small model on CPU), short conversations
        cap = {"max_input": TORCH_MAX_INPUT} if setup.executor == "torch" else {}
        write_trace(session_trace(attrs.evolve(SHAPES[workload], **cap), seed), path)
    lines = setup.trace_lines or (MOONCAKE_LINES if workload == "mooncake" else None)
    specs, after = replay_order(path, lines, seed, BLOCK_SIZE[setup.executor],
                                VOCAB[setup.executor])  # fmt: skip
    return specs, [s.arrival_s for s in specs], after


def run_sessions(procs: Processes, setup: Setup, workload: str, seed: int, n: int,
                 rows: list[dict], pools: dict, run: int) -> int:  # fmt: skip
    """One trace at one fleet size: every policy, then one big pipeline (N x P stages,
    N x the pool per stage: the fleet's devices and KV memory in one pipeline)."""
    specs, arrivals, after = session_requests(workload, seed, setup, procs.logs)
    block, vocab = BLOCK_SIZE[setup.executor], VOCAB[setup.executor]
    longest = max(s.num_tokens for s in specs) // block + 1
    capacity = max(-(-working_set_blocks(specs, block) // n), 4 * longest)
    label = f"{workload}-s{seed}-n{n}"
    pools[label] = {"replica": capacity, "big": capacity * n, "big_stages": n * setup.stages}
    head = SHAPES[workload].head_tokens if workload in SHAPES else 0

    def one(url: str, policy: str) -> None:
        nonlocal run
        for load in setup.loads:
            run += 1
            offered = load * n * setup.pipeline_tok_s
            row = measure(url, [s.tokens for s in _shifted(specs, run, vocab)], arrivals, after,
                          offered, setup.time_scale, block, f"f{run}-", policy == "prefix", head)
            rows.append({"workload": workload, "seed": seed, "replicas": n, "policy": policy,
                         "load": load, "offered_tok_s": offered, **row})  # fmt: skip
            _log(session_line(rows[-1]))
            with open(procs.logs / "rows.jsonl", "a") as f:  # each run kept should one fail
                f.write(json.dumps(rows[-1]) + "\n")

    with replicas(procs, setup, n, capacity, label) as urls:
        for policy in [p for p in setup.policies if p != "big"]:
            with router(procs, urls, policy, label, ["--explain", *setup.route_options]) as url:
                one(url, policy)
    if "big" in setup.policies:  # one pipeline of the fleet's size, not routed
        with replicas(procs, setup, 1, capacity * n, f"{label}-big", n * setup.stages) as (u,):
            one(u, "big")
    return run


def _loads(setup: Setup) -> tuple[float | None, ...]:
    return (None,) if setup.closed_loop else setup.loads


def _capacity(workload: str, setup: Setup, n: int) -> int:
    """A replica's pool: 1/N of the workload's working set (at least four of its longest
    prompts), so a replica holds only its share and routing decides the reuse."""
    specs = base_specs(workload, setup, 64, 32_000)
    longest = max(len(block_hashes(s.tokens, 64)) + 1 for s in specs)
    return max(-(-working_set_blocks(specs, 64) // n), 4 * longest)


def _line(row: dict) -> str:
    def pct(v):
        return "  n/a" if v is None else f"{100 * v:5.1f}%"

    return (f"{row['workload']:<12} N={row['replicas']} {row['policy']:<11} {_offered(row)}: "
            f"{row['throughput_tok_s']:>9,.0f} tok/s, "
            f"good-hit {pct(row['good_hit_rate'])}, reused {pct(row['reused_share'])}, "
            f"p50/p99 {row['completion_p50_s'] or 0:.2f}/{row['completion_p99_s'] or 0:.2f} s, "
            f"SLO {pct(row['slo_attainment'])}")  # fmt: skip


def _offered(row: dict) -> str:
    if row["load"] is None:
        return f"closed loop, {row['closed_loop']} in flight a replica"
    return f"load {row['load']:.2f} ({row['offered_tok_s']:,.0f} tok/s)"


def table(record: dict) -> str:
    lines = ["WavePP fleet — SIMULATED (sim executor, "
             f"{record['setup']['model']}, P = {record['setup']['stages']}, time scale "
             f"{record['setup']['time_scale']:g}; KV events "
             f"{'on' if record['kv_events'] else 'OFF'})",
             "workload     N  policy      load  offered tok/s  tok/s      good-hit  reused  "
             "p50 s  p99 s  SLO"]  # fmt: skip

    def pct(v):
        return "  n/a " if v is None else f"{100 * v:5.1f}%"

    for r in record["rows"]:
        load = "closed" if r["load"] is None else f"{r['load']:4.2f}"
        offered = "(saturated)" if r["offered_tok_s"] is None else f"{r['offered_tok_s']:,.0f}"
        lines.append(f"{r['workload']:<12} {r['replicas']}  {r['policy']:<11} {load:>6}  "
                     f"{offered:>13}  {r['throughput_tok_s']:>9,.0f}  "
                     f"{pct(r['good_hit_rate'])}    {pct(r['reused_share'])} "
                     f"{r['completion_p50_s'] or 0:6.2f} {r['completion_p99_s'] or 0:6.2f}  "
                     f"{pct(r['slo_attainment'])}")  # fmt: skip
    return "\n".join(lines)


def plot(record: dict, out: Path) -> list[Path]:
    """SLO attainment against offered load, one line per policy (and the ceiling), one
    figure per workload and fleet size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    rows = record["rows"]
    for workload in sorted({r["workload"] for r in rows}):
        for n in sorted({r["replicas"] for r in rows}):
            sub = [r for r in rows if r["workload"] == workload and r["replicas"] == n
                   and r["offered_tok_s"] is not None]  # closed-loop runs have no offered load
            if not sub:
                continue
            fig, ax = plt.subplots(figsize=(6, 4))
            for policy in [*POLICIES, "ceiling"]:
                pts = sorted((r["offered_tok_s"], r["slo_attainment"]) for r in sub
                             if r["policy"] == policy and r["slo_attainment"] is not None)
                if pts:
                    ax.plot([x / 1e3 for x, _ in pts], [100 * y for _, y in pts], marker="o",
                            linestyle="--" if policy == "ceiling" else "-",
                            label="one pipeline, N× pool" if policy == "ceiling" else policy)
            ax.set_xlabel("offered load (thousand prompt tokens / simulated s)")
            ax.set_ylabel(f"SLO attainment, % (deadline {sub[0]['slo_s']:g} s)")
            ax.set_ylim(-3, 103)
            events = "" if record.get("kv_events") else " (KV events off)"
            ax.set_title(f"{workload}, N = {n} × P = {record['setup']['stages']}{events} "
                         "— SIMULATED", fontsize=10)  # fmt: skip
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            path = out / f"fleet_slo_{workload}_n{n}.png"
            fig.tight_layout()
            fig.savefig(path, dpi=120)
            plt.close(fig)
            written.append(path)
    return written


def setup_from(args: argparse.Namespace) -> Setup:
    quick = args.quick
    return Setup(
        replicas=tuple(args.replicas or ((2,) if quick else (2, 4))),
        stages=args.stages,
        policies=tuple(args.policies or (*POLICIES, "big")),
        workloads=tuple(args.workloads or SESSION_WORKLOADS),
        loads=tuple(args.loads or ((0.5, 1.5, 3.0) if quick else (0.5, 1.0, 1.5, 2.0, 3.0))),
        requests=args.requests or (60 if quick else 100),
        time_scale=args.time_scale,
        pipeline_tok_s=args.pipeline_tok_s,
        slo_s={"conversation": args.slo_conversation_s},
        model=args.model or ("tiny-llama" if args.executor == "torch" else "qwen3-next-80b"),
        conversation_tokens=args.conversation_tokens,
        seed=args.seed,
        closed_loop=args.closed_loop,
        seeds=tuple(args.seeds or ()),
        trace_lines=args.requests,
        executor=args.executor,
        route_options=tuple(args.route_option),
    )  # fmt: skip


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.fleet",
        description="SIMULATED fleets (N replicas x P stages) behind the router, per routing "
        "policy, at rising offered load: throughput, good-hit, reuse, completion, SLO "
        "attainment; one pipeline with N times the pool as the ceiling.",
    )
    p.add_argument("--quick", action="store_true",
                   help="N = 2, loads 0.5,1.5,3, 60 requests a run (a few minutes)")
    p.add_argument("--replicas", type=lambda s: [int(x) for x in s.split(",")],
                   help="fleet sizes [2,4; quick: 2]")
    p.add_argument("--stages", type=int, default=2, help="P, stages per pipeline [2]")
    p.add_argument("--policies", type=lambda s: s.split(","),
                   help=f"and prefix-before, big (one N x P pipeline) [{','.join(POLICIES)},big]")
    p.add_argument("--workloads", type=lambda s: s.split(","),
                   help=f"conversation traces {', '.join(SESSION_WORKLOADS)} (replayed, the "
                   "router explaining each choice), conversation (wavepp.bench.load) "
                   f"[{','.join(SESSION_WORKLOADS)}]")
    p.add_argument("--loads", type=_floats,
                   help="offered load, fractions of N x --pipeline-tok-s "
                   "[0.5,1,1.5,2,3; quick: 0.5,1.5,3]")
    p.add_argument("--requests", type=int, help="measured requests a run [100; quick: 60]; "
                   f"a conversation trace's first lines [all; mooncake {MOONCAKE_LINES}]")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="real seconds per simulated second [1.0]")
    p.add_argument("--pipeline-tok-s", type=float, default=90_000.0,
                   help="one pipeline's cold prefill throughput, simulated tok/s [90000: "
                   "qwen3-next-80b on H200, P = 2, measured with wavepp.main]")
    p.add_argument("--slo-conversation-s", type=float, default=0.3,
                   help="conversation deadline, simulated s [0.3]")
    p.add_argument("--model", default=None,
                   help="sim: a profile [qwen3-next-80b]; torch: a tiny model [tiny-llama]")
    p.add_argument("--executor", choices=sorted(EXECUTORS), default="sim",
                   help="what replicas run: sim, or torch (CPU; session workloads only) [sim]")
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], help="trace seeds")
    p.add_argument("--route-option", action="append", default=[], metavar="OPT",
                   help="an option for every router, e.g. --route-option=--sent-memory-s=0")
    p.add_argument("--conversation-tokens", type=int, default=8192,
                   help="the conversation workload's prompt scale (--prompt-tokens) [8192]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--closed-loop", type=int, default=None, metavar="C",
                   help="conversation: closed loop, C in flight a replica (N x C: ceiling)")
    p.add_argument("--json", help="write the record here")
    p.add_argument("--report", metavar="JSON", help="print a record's tables, run nothing")
    p.add_argument("--plots", help="write the plots into this folder")
    p.add_argument("--logs", default=None, help="children's logs folder [a temporary one]")
    return p  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.report:  # a record's conversation-trace tables
        return print(session_table(rec := json.loads(Path(args.report).read_text())),
                     why_table(rec), goal_table(rec), sep="\n\n")  # fmt: skip
    setup = setup_from(args)
    if args.stages < 1 or args.time_scale <= 0 or not setup.loads or min(setup.loads) <= 0:
        raise SystemExit("benchmarks.fleet: --stages ≥ 1, --time-scale > 0 and positive --loads")
    if args.closed_loop is not None and args.closed_loop < 1:
        raise SystemExit("benchmarks.fleet: --closed-loop C needs C ≥ 1")
    unknown = set(setup.policies) - {*POLICIES, "prefix-before", "big"}
    if unknown:
        raise SystemExit(f"benchmarks.fleet: unknown policies {sorted(unknown)}; "
                         f"one of {', '.join(POLICIES)}, prefix-before, big")  # fmt: skip
    legacy = set(setup.workloads) - set(SESSION_WORKLOADS)
    if setup.executor == "torch" and legacy:
        raise SystemExit(f"benchmarks.fleet: --executor torch runs {', '.join(SESSION_WORKLOADS)}"
                         f" only, not {', '.join(sorted(legacy))}")  # fmt: skip
    logs = Path(args.logs) if args.logs else Path(os.environ.get("TMPDIR", "/tmp")) / (
        f"wavepp-bench-fleet-{os.getpid()}")
    logs.mkdir(parents=True, exist_ok=True)
    _log(f"{'SIMULATED' if setup.executor == 'sim' else 'torch'}; children's logs in {logs}")
    started = time.time()
    # SIGTERM ends the bench as ^C does: the children are stopped on the way out
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    record = run_bench(setup, logs)
    record["wall_s"] = time.time() - started
    record["command"] = "python -m benchmarks.fleet " + " ".join(argv or sys.argv[1:])
    legacy_rows = [r for r in record["rows"] if "seed" not in r]
    print(session_table(record) if len(legacy_rows) < len(record["rows"]) else "")
    print(table({**record, "rows": legacy_rows}) if legacy_rows else "")
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    if args.plots:
        for path in plot(record, Path(args.plots)):
            _log(f"wrote {path}")


if __name__ == "__main__":
    main()
