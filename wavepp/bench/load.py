"""Load generator for the HTTP server: ``python -m wavepp.bench.load --url URL ...``.

Drives a running ``wavepp.serve`` with one of the paper's workloads, a Mooncake trace
(closed loop, or ``--open-loop`` by the trace's timestamps) or a requests file, the
prompts built exactly as ``wavepp.main`` builds them (same generators, same seed, the
server's vocabulary and block size from ``GET /v1/models``). Warm-up requests (the
seeded prefixes) run first and are not timed. ``--cancel-fraction F`` picks that share
of the measured requests (by ``--seed``) and abandons each at a random point of its
life by closing the connection, which the server turns into a cancel. ``--rate R`` sends
a workload open loop, Poisson arrivals at R requests per second (by ``--seed``);
``--deadline-s D`` gives every measured request a deadline (``deadline_s``, seconds after
the server's submission, or after its arrival at a router) and the report its SLO
attainment (a router's own figure too).

Reports throughput (prompt tokens of the requests done, cached included, over the
measured makespan), time to result p50/p99 (client side, queue included), reuse and
good-hit rate from the results, and the server's own reuse from ``/metrics``; with
``--json PATH`` one record with every request's outcome. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import anyio
import attrs
import httpx
import numpy as np

from wavepp.route.prom import fleet_figures
from wavepp.serve.prom import parse_exposition, sample
from wavepp.stats import percentile
from wavepp.workload import (
    RequestSpec,
    cold,
    conversation,
    mixed,
    read_requests_file,
    seeded,
    short_suffix,
    trace,
)

WORKLOADS = ("cold", "seeded", "mixed", "short-suffix", "conversation")


@attrs.define
class Outcome:
    """One request as the client saw it."""

    id: str  # the workload's id (the server saw prefix + id)
    num_tokens: int
    expected_reuse: int
    warmup: bool
    to_cancel: bool  # picked for a disconnect
    status: str = "unsent"  # done | cancelled | rejected | failed | disconnected | error
    http_status: int | None = None
    first_token: int | None = None
    top_logit: float | None = None
    cached_tokens: int = 0
    error: str | None = None
    sent_at: float | None = None
    answered_at: float | None = None
    cancel_after_s: float | None = None  # when it was abandoned, after sending
    server_s: float | None = None  # submission to result inside the engine (its timings)
    deadline_s: float | None = None  # its deadline, seconds after submission (None: none)
    deadline_met: bool | None = None  # the server's verdict (None: no deadline or no answer)
    simulated: bool = False  # the server's answer says the sim executor predicted it

    @property
    def latency_s(self) -> float | None:
        if self.sent_at is None or self.answered_at is None:
            return None
        return self.answered_at - self.sent_at

    @property
    def met_at_client(self) -> bool | None:
        """Done within its deadline as the client saw it (the wire and a router included)."""
        if self.deadline_s is None:
            return None
        return self.status == "done" and (self.latency_s or math.inf) <= self.deadline_s


def build_specs(args: argparse.Namespace, vocab: int, block_size: int) -> list[RequestSpec]:
    if args.trace:
        return trace(args.trace, args.requests, args.seed, block_size, args.open_loop,
                     args.time_scale, vocab)  # fmt: skip
    if args.requests_file:
        specs, rejected, _ = read_requests_file(args.requests_file, vocab)
        for bad in rejected:
            print(f"load: skipped {bad['error']}", file=sys.stderr)
        return specs[: args.requests] if args.requests else specs
    n, length = args.requests or 48, args.prompt_tokens
    if args.workload == "cold":
        return cold(n, length, args.seed, block_size, vocab)
    if args.workload == "seeded":
        return seeded(n, length, args.seed, block_size, vocab=vocab)
    if args.workload == "mixed":
        return mixed(n, length, 2 * length, args.seed, block_size, vocab=vocab)
    if args.workload == "conversation":
        return conversation(n, length, args.seed, block_size, vocab)
    return short_suffix(n, length, args.seed, block_size, args.suffix_tokens, vocab)


def with_arrivals(specs: list[RequestSpec], args: argparse.Namespace) -> list[RequestSpec]:
    """``--rate``: Poisson arrival times for the measured requests; ``--deadline-s``: their
    deadline (a requests file's own ``deadline_s`` wins)."""
    rng = np.random.default_rng([args.seed, 11])
    clock, out = 0.0, []
    for spec in specs:
        changes = {}
        if not spec.warmup and args.rate is not None:
            clock += float(rng.exponential(1.0 / args.rate))
            changes["arrival_s"] = clock
        if not spec.warmup and args.deadline_s is not None and spec.deadline_s is None:
            changes["deadline_s"] = args.deadline_s
        out.append(attrs.evolve(spec, **changes) if changes else spec)
    return out


def write_requests_file(specs: list[RequestSpec], path: str) -> None:
    """The prompts as a requests file, so ``wavepp.main --requests-file`` runs the same."""
    with open(path, "w") as f:
        for spec in specs:
            line = {"id": spec.request_id, "tokens": spec.tokens.tolist()}
            if spec.warmup:
                line["warmup"] = True
            if spec.deadline_s is not None:
                line["deadline_s"] = spec.deadline_s
            f.write(json.dumps(line) + "\n")


class Progress:
    """A line on stderr: in place on a terminal, every 10 s in a log."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.last = 0.0
        self.tty = sys.stderr.isatty()

    def due(self, final: bool = False) -> bool:
        """Whether a line would be shown now (so callers build it only then)."""
        interval = 0.5 if self.tty else 10.0
        return self.enabled and (final or time.monotonic() - self.last >= interval)

    def show(self, text: str, final: bool = False) -> None:
        if not self.due(final):
            return
        self.last = time.monotonic()
        if self.tty:
            print("\r" + text, end="\n" if final else "", file=sys.stderr, flush=True)
        else:
            print(text, file=sys.stderr, flush=True)


class LoadRun:
    def __init__(self, args: argparse.Namespace, client: httpx.AsyncClient,
                 simulated: bool) -> None:  # fmt: skip
        """``simulated``: the server's /v1/models says its executor is the sim."""
        self.args = args
        self.client = client
        self.simulated = simulated
        self.prefix = args.id_prefix if args.id_prefix is not None else os.urandom(3).hex() + "-"
        self.outcomes: list[Outcome] = []
        self.progress = Progress(args.progress)
        self.latencies: list[float] = []  # done requests of this phase (to place cancels)
        self.warm_latencies: list[float] = []
        self._median_of: tuple[list | None, int, float] = (None, 0, 0.2)  # (over, count, p50)
        self.in_flight = 0
        self.phase = "warm-up"
        self.rng = np.random.default_rng([args.seed, 7])

    def _cancel_delay(self) -> float:
        """A random point of a request's life: uniform over [0, the median time to result
        of the measured requests done so far] (the warm-up's until five are done)."""
        latencies = self.latencies if len(self.latencies) >= 5 else self.warm_latencies
        source, count, median = self._median_of
        if source is not latencies or (len(latencies) != count and len(latencies) >= 1.1 * count):
            median = percentile(latencies, 50) if latencies else 0.2
            self._median_of = (latencies, len(latencies), median)  # refreshed as it grows 10%
        return float(self.rng.uniform(0.0, max(median, 0.01)))

    async def _send(self, spec: RequestSpec, outcome: Outcome) -> None:
        body = {"tokens": spec.tokens.tolist(), "id": self.prefix + spec.request_id}
        if self.args.endpoint == "completions":
            body = {"prompt": body["tokens"], "request_id": body["id"], "max_tokens": 1,
                    "model": "wavepp"}  # fmt: skip
        if spec.deadline_s is not None:
            body["deadline_s"] = outcome.deadline_s = spec.deadline_s
        route = "/v1/prefill" if self.args.endpoint == "prefill" else "/v1/completions"
        self.in_flight += 1
        outcome.sent_at = time.time()
        try:
            if outcome.to_cancel:
                outcome.cancel_after_s = self._cancel_delay()
                with anyio.move_on_after(outcome.cancel_after_s):
                    await self._post(route, body, outcome)
                    return
                outcome.status = "disconnected"
                outcome.answered_at = time.time()
            else:
                await self._post(route, body, outcome)
        finally:
            self.in_flight -= 1
            self._show()

    async def _post(self, route: str, body: dict, outcome: Outcome) -> None:
        try:
            reply = await self.client.post(route, json=body)
        except httpx.HTTPError as error:
            outcome.status, outcome.error = "error", f"{type(error).__name__}: {error}"
            outcome.answered_at = time.time()
            return
        outcome.answered_at = time.time()
        outcome.http_status = reply.status_code
        try:
            data = reply.json()
        except ValueError:
            outcome.status, outcome.error = "error", f"HTTP {reply.status_code}: not JSON"
            return
        if "error" in data and "status" not in data and "wavepp" not in data:
            refused = {503: "unavailable"}.get(reply.status_code, "rejected")
            outcome.status = refused if 400 <= reply.status_code < 600 else "error"
            outcome.error = str(data["error"].get("message"))
            return
        result = data.get("wavepp", data)
        outcome.status = result["status"]
        outcome.first_token = result["first_token"]
        outcome.top_logit = result["top_logit"]
        outcome.cached_tokens = result["cached_tokens"]
        outcome.error = result.get("error")
        outcome.server_s = (result.get("timings") or {}).get("total_s")
        outcome.deadline_met = result.get("deadline_met")
        outcome.simulated = bool(result.get("simulated"))
        if outcome.status == "done":
            self.latencies.append(outcome.latency_s)

    def _show(self, final: bool = False) -> None:
        if not self.progress.due(final):
            return
        ended = [o for o in self.outcomes if o.answered_at is not None and not o.warmup]
        done = sum(1 for o in ended if o.status == "done")
        gone = sum(1 for o in ended if o.status in ("cancelled", "disconnected"))
        bad = len(ended) - done - gone
        total = sum(1 for o in self.outcomes if not o.warmup)
        tail = f"p50 {percentile(self.latencies, 50):.3f} s" if self.latencies else ""
        self.progress.show(
            f"load {self.phase}: {len(ended)}/{total} ended ({done} done, {gone} cancelled, "
            f"{bad} failed), {self.in_flight} in flight {tail}",
            final,
        )

    async def _closed(self, pairs: list[tuple[RequestSpec, Outcome]]) -> None:
        slots = anyio.Semaphore(self.args.concurrency)

        async def one(spec: RequestSpec, outcome: Outcome) -> None:
            try:
                await self._send(spec, outcome)
            finally:
                slots.release()

        async with anyio.create_task_group() as tg:
            for spec, outcome in pairs:
                await slots.acquire()
                tg.start_soon(one, spec, outcome)

    async def _open(self, pairs: list[tuple[RequestSpec, Outcome]]) -> None:
        start = time.monotonic()
        async with anyio.create_task_group() as tg:
            for spec, outcome in pairs:
                delay = (spec.arrival_s or 0.0) - (time.monotonic() - start)
                if delay > 0:
                    await anyio.sleep(delay)
                tg.start_soon(self._send, spec, outcome)

    async def run(self, specs: list[RequestSpec]) -> dict:
        measured = [s for s in specs if not s.warmup]
        num_cancel = round(self.args.cancel_fraction * len(measured))
        picked = set(self.rng.choice(len(measured), num_cancel, replace=False).tolist())
        pairs, index = [], 0
        for spec in specs:
            to_cancel = not spec.warmup and index in picked
            index += 0 if spec.warmup else 1
            outcome = Outcome(spec.request_id, spec.num_tokens, spec.expected_reuse,
                              spec.warmup, to_cancel)  # fmt: skip
            self.outcomes.append(outcome)
            pairs.append((spec, outcome))
        warm = [p for p in pairs if p[0].warmup]
        if warm:
            await self._closed(warm)
        before = await self.scrape()  # the server's figures count the measured phase only
        self.phase = "measured"
        self.warm_latencies, self.latencies = self.latencies, []
        start = time.time()
        rest = [p for p in pairs if not p[0].warmup]
        if self.args.open_loop or self.args.rate is not None:
            await self._open(rest)
        else:
            await self._closed(rest)
        end = time.time()
        self._show(final=True)
        errors = sorted({o.error for o in self.outcomes if o.error and o.status != "done"})
        for error in errors[:5]:
            print(f"load: {error}", file=sys.stderr)
        after = await self.scrape()
        return self.report(start, end, before, after)

    async def scrape(self) -> dict[str, float]:
        try:
            reply = await self.client.get("/metrics")
            reply.raise_for_status()
        except httpx.HTTPError as error:
            print(f"load: cannot read /metrics: {error}", file=sys.stderr)
            return {}
        return parse_exposition(reply.text)

    def report(self, start: float, end: float, before: dict, after: dict) -> dict:
        measured = [o for o in self.outcomes if not o.warmup]
        done = [o for o in measured if o.status == "done"]
        latencies = [o.latency_s for o in done]
        overheads = [o.latency_s - o.server_s for o in done if o.server_s is not None]
        tokens = sum(o.num_tokens for o in done)
        makespan = max(end - start, 1e-9)
        expecting = [o for o in done if o.expected_reuse > 0]
        good = [o for o in expecting if o.cached_tokens >= 0.8 * o.expected_reuse]
        by_status: dict[str, int] = {}
        for o in measured:
            by_status[o.status] = by_status.get(o.status, 0) + 1

        def delta(name: str, **labels: str) -> float | None:
            a, b = sample(before, name, **labels), sample(after, name, **labels)
            return None if a is None or b is None else b - a

        timed = [o for o in measured if o.deadline_s is not None]
        server_timed = [o for o in timed if o.deadline_met is not None]
        server_tokens = delta("wavepp_prompt_tokens_total")
        server_cached = delta("wavepp_cached_tokens_total")
        fleet = fleet_figures(before, after)  # against a router (python -m wavepp.route)
        if fleet is not None and server_tokens is None:
            server_tokens, server_cached = fleet["prompt_tokens"], fleet["cached_tokens"]
        return {
            # the sim executor predicted the waves (the server's /v1/models or any answer)
            "simulated": self.simulated or any(o.simulated for o in self.outcomes),
            "url": self.args.url,
            "workload": self.args.trace or self.args.requests_file or self.args.workload,
            "open_loop": self.args.open_loop or self.args.rate is not None,
            "rate": self.args.rate,
            "deadline_s": self.args.deadline_s,
            "concurrency": self.args.concurrency,
            "measured_requests": len(measured),
            "warmup_requests": len(self.outcomes) - len(measured),
            "by_status": by_status,
            "picked_to_cancel": sum(1 for o in measured if o.to_cancel),
            "makespan_s": makespan,
            "throughput_tok_s": tokens / makespan,
            "input_tokens": tokens,
            "time_to_result_p50_s": percentile(latencies, 50) if latencies else None,
            "time_to_result_p99_s": percentile(latencies, 99) if latencies else None,
            # client time to result minus the engine's (HTTP, JSON, both event loops)
            "http_overhead_p50_s": percentile(overheads, 50) if overheads else None,
            "reused_share": sum(o.cached_tokens for o in done) / tokens if tokens else 0.0,
            "good_hit_rate": len(good) / len(expecting) if expecting else None,
            # measured requests with a deadline done within it, as the client timed them
            # (unanswered ones missed it); and as the server judged those it answered
            "slo_attainment": (sum(bool(o.met_at_client) for o in timed) / len(timed)
                               if timed else None),
            "server_slo_attainment": (sum(bool(o.deadline_met) for o in server_timed)
                                      / len(server_timed) if server_timed else None),
            "server_reused_share": server_cached / server_tokens if server_tokens else None,
            # a router's figures: per replica, predicted against granted reuse, retries
            "fleet": fleet,
            "server_disconnect_cancels": delta("wavepp_disconnect_cancels_total"),
            "requests": [attrs.asdict(o) | {"latency_s": o.latency_s} for o in self.outcomes],
            "id_prefix": self.prefix,
        }


def table(record: dict) -> str:
    def fmt(value, unit="", scale=1.0, digits=3):
        return "n/a" if value is None else f"{value * scale:,.{digits}f}{unit}"

    statuses = ", ".join(f"{k} {v}" for k, v in sorted(record["by_status"].items()))
    return "\n".join([
        f"WavePP load{' — SIMULATED' if record['simulated'] else ''} — "
        f"{record['workload']} at concurrency {record['concurrency']}"
        f"{' (open loop)' if record['open_loop'] else ''} against {record['url']}",
        f"  requests            {record['measured_requests']} measured ({statuses}), "
        f"{record['warmup_requests']} warm-up",
        f"  throughput          {fmt(record['throughput_tok_s'], ' tok/s', digits=0)}"
        f"   (prompt tokens of done requests / makespan {fmt(record['makespan_s'], ' s', 1, 2)})",
        f"  time to result      p50 {fmt(record['time_to_result_p50_s'], ' s')}"
        f" / p99 {fmt(record['time_to_result_p99_s'], ' s')}"
        f"   (outside the engine: p50 {fmt(record['http_overhead_p50_s'], ' s')})",
        f"  reuse               {fmt(record['reused_share'], '%', 100, 1)} of prompt tokens "
        f"cached; good-hit {fmt(record['good_hit_rate'], '%', 100, 1)}; server says "
        f"{fmt(record['server_reused_share'], '%', 100, 1)}",
        *([f"  SLO attainment      {fmt(record['slo_attainment'], '%', 100, 1)} at the client"
           f"; server says {fmt(record['server_slo_attainment'], '%', 100, 1)}"
           + (f"; router says {fmt(record['fleet']['slo_attainment'], '%', 100, 1)}"
              if record.get("fleet") else "")]
          if record.get("slo_attainment") is not None else []),
        *([f"  fleet               {record['fleet']['replicas_up']:g} replicas up; router "
           f"predicted {fmt(record['fleet']['predicted_share'], '%', 100, 1)} cached, "
           f"{record['fleet']['retries']:g} retries"]
          if record.get("fleet") and record["fleet"].get("replicas_up") is not None else []),
    ])  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m wavepp.bench.load",
        description="Drive a WavePP server (python -m wavepp.serve) with a workload or a trace.",
    )
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--workload", choices=WORKLOADS, help="a synthetic workload (DESIGN §7)")
    source.add_argument("--trace", help="a Mooncake-format JSONL trace to replay")
    source.add_argument("--requests-file", help='JSONL of {"id": ..., "tokens": [...]}')
    p.add_argument(
        "--open-loop",
        action="store_true",
        help="trace: send at the trace's timestamps instead of closed loop",
    )
    p.add_argument(
        "--concurrency", type=int, required=True, help="closed loop: requests outstanding at once"
    )
    p.add_argument(
        "--requests",
        type=int,
        default=None,
        help="measured requests (trace: lines replayed) [workloads: 48]",
    )
    p.add_argument("--prompt-tokens", type=int, default=2048, help="prompt length L [2048]")
    p.add_argument("--suffix-tokens", type=int, default=256, help="short-suffix: new tokens")
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="open loop: real seconds per trace second [1.0]",
    )
    p.add_argument(
        "--cancel-fraction",
        type=float,
        default=0.0,
        help="share of measured requests abandoned at a random point [0]",
    )
    p.add_argument("--rate", type=float, default=None,
                   help="workload: open loop, Poisson arrivals at this many requests/s")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="a deadline for every measured request, seconds after submission")
    p.add_argument("--seed", type=int, default=0, help="workload and cancel seed [0]")
    p.add_argument(
        "--endpoint",
        choices=("prefill", "completions"),
        default="prefill",
        help="/v1/prefill or the OpenAI /v1/completions [prefill]",
    )
    p.add_argument(
        "--id-prefix",
        default=None,
        help="prefix of the ids sent (default: random, so reruns do not collide)",
    )
    p.add_argument("--timeout-s", type=float, default=600.0, help="per request [600]")
    p.add_argument("--json", help="write the record (with every request's outcome) here")
    p.add_argument("--dump-requests", help="write the prompts as a requests file here")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="progress on stderr [on]",
    )
    return p  # fmt: skip


def validate(args: argparse.Namespace) -> None:
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise SystemExit(f"wavepp.bench.load: {message}")

    need(args.concurrency >= 1, f"--concurrency must be ≥ 1, got {args.concurrency}")
    need(args.requests is None or args.requests >= 1, "--requests must be ≥ 1")
    need(args.prompt_tokens >= 1, "--prompt-tokens must be ≥ 1")
    need(0.0 <= args.cancel_fraction <= 1.0, "--cancel-fraction must be in [0, 1]")
    need(args.time_scale > 0, "--time-scale must be positive")
    need(not args.open_loop or args.trace, "--open-loop replays a --trace")
    need(args.rate is None or (args.rate > 0 and not args.trace),
         "--rate must be positive, for a workload or requests file (a trace has timestamps)")
    need(args.deadline_s is None or 0 < args.deadline_s <= 1e6,
         "--deadline-s must be in (0, 1e6] seconds")
    need(args.url.startswith(("http://", "https://")), f"--url {args.url!r} is not http(s)")


async def server_info(client: httpx.AsyncClient) -> dict:
    try:
        reply = await client.get("/v1/models")
        reply.raise_for_status()
        return reply.json()["data"][0].get("wavepp", {})
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as error:
        raise SystemExit(f"wavepp.bench.load: no /v1/models from the server: {error}") from None


async def amain(args: argparse.Namespace) -> dict:
    limits = httpx.Limits(max_connections=args.concurrency + 4,
                          max_keepalive_connections=args.concurrency + 4)  # fmt: skip
    timeout = httpx.Timeout(args.timeout_s, connect=30.0)
    async with httpx.AsyncClient(base_url=args.url, limits=limits, timeout=timeout) as client:
        info = await server_info(client)
        vocab = int(info.get("vocab_size") or 32_000)
        block_size = int(info.get("block_size") or 64)
        specs = with_arrivals(build_specs(args, vocab, block_size), args)
        if not specs:
            raise SystemExit("wavepp.bench.load: no requests to send")
        if args.dump_requests:
            write_requests_file(specs, args.dump_requests)
        return await LoadRun(args, client, bool(info.get("simulated"))).run(specs)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    validate(args)
    record = anyio.run(amain, args)
    print(table(record))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
