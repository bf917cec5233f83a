"""Soak benchmark: ``python -m benchmarks.soak --duration-s S [--every-s N] [server options]``.

Starts the server (``python -m wavepp.serve.launch --nproc-per-node P --port 0 ...``;
options this command does not know go to it, after ``--model tiny-hybrid`` and the
others in ``SERVER_DEFAULTS``) and drives it for ``--duration-s`` seconds, closed loop at
``--concurrency``, with a reuse workload: each prompt is one of ``--documents`` shared
prefixes plus a fresh suffix. A share of the requests is cancelled
(``DELETE /v1/requests/{id}`` at a random point of their life) and another share
abandoned (the client closes the connection mid-flight, which the server turns into a
cancel). Every ``--every-s`` seconds it prints the resident memory of every rank (the
processes under the launcher that carry a ``RANK``; per rank and summed) and the size of
every table the server exports on ``/metrics`` (the gauge ``wavepp_table_size{table=...}``;
a server without it gets RSS only). At the end the launcher gets SIGTERM: the server
drains and its leak check decides the exit status, which the record keeps.
``--json FILE`` writes the time series.

A server that runs for weeks must hold per-request state for the requests it holds and
bounded windows of history: its tables follow the concurrency, not the number of
requests served, and its RSS levels off. ``tests/integration/test_soak.py`` runs a short
version and fails when they do not.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import attrs
import httpx
import numpy as np

READY = re.compile(r"listening on (http://\S+) \(pid (\d+)\)")
TABLE = re.compile(r"^wavepp_table_size\{([^}]*)\}\s+(\S+)", re.MULTILINE)
LIMIT = re.compile(r"^wavepp_table_limit\{([^}]*)\}\s+(\S+)", re.MULTILINE)
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
SERVER_DEFAULTS = ["--model", "tiny-hybrid", "--seed", "0", "--block-size", "16",
                   "--capacity-blocks", "512", "--no-progress"]  # fmt: skip
MIB = 1024 * 1024


# -- what the server holds --------------------------------------------------------------


def children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def descendants(pid: int) -> list[int]:
    out, todo = [], children(pid)
    while todo:
        child = todo.pop()
        out.append(child)
        todo.extend(children(child))
    return out


def rank_of(pid: int) -> int | None:
    """The ``RANK`` torchrun gave the process, or None for any other process."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for entry in environ:
        if entry.startswith(b"RANK="):
            with contextlib.suppress(ValueError):
                return int(entry[5:])
    return None


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def rank_rss(launcher: int) -> dict[int, int]:
    """Resident bytes of every rank under the launcher (Linux /proc), by rank."""
    out: dict[int, int] = {}
    for pid in descendants(launcher):
        rank = rank_of(pid)
        rss = rss_bytes(pid) if rank is not None else None
        if rank is not None and rss is not None:
            out[rank] = out.get(rank, 0) + rss
    return dict(sorted(out.items()))


def table_sizes(exposition: str, gauge: re.Pattern = TABLE) -> dict[str, float] | None:
    """Every ``wavepp_table_size`` sample (or ``wavepp_table_limit``: the caps of the
    tables that are windows of recent history), keyed by its labels (``table`` first), or
    None when the server exports no such gauge."""
    sizes = {}
    for labels, value in gauge.findall(exposition):
        pairs = dict(LABEL.findall(labels))
        name = pairs.pop("table", "?")
        rest = ",".join(f"{k}={v}" for k, v in sorted(pairs.items()))
        sizes[f"{name}[{rest}]" if rest else name] = float(value)
    return sizes or None


# -- the load ---------------------------------------------------------------------------


@attrs.define
class Counts:
    sent: int = 0
    done: int = 0
    cancelled: int = 0  # answered "cancelled" (a DELETE reached it in time)
    disconnected: int = 0  # abandoned by the client
    other: int = 0  # refused, failed, HTTP errors
    deletes: int = 0  # DELETEs sent
    deletes_found: int = 0  # ... that found the request queued or running (200, not 404)

    def as_dict(self) -> dict[str, int]:
        return attrs.asdict(self)


class Soak:
    """The closed-loop client: ``concurrency`` workers, each sending one prompt at a
    time and, by the dice, cancelling or abandoning it."""

    def __init__(self, args: argparse.Namespace, client: httpx.AsyncClient, launcher: int) -> None:
        self.args = args
        self.client = client
        self.launcher = launcher
        self.counts = Counts()
        self.samples: list[dict] = []
        self.rng = np.random.default_rng(args.seed)
        self.latencies: list[float] = []  # recent completions, to place cancels in a life
        self.documents: list[list[int]] = []
        self.vocab = 0
        self.started = 0.0

    async def run(self) -> None:
        info = (await self.client.get("/v1/models")).json()["data"][0].get("wavepp", {})
        self.vocab = int(info.get("vocab_size") or 32_000)
        self.documents = [
            self.rng.integers(0, self.vocab, self.args.prefix_tokens).tolist()
            for _ in range(self.args.documents)
        ]
        self.started = time.monotonic()
        end = self.started + self.args.duration_s
        async with anyio.create_task_group() as tg:
            for worker in range(self.args.concurrency):
                tg.start_soon(self._worker, worker, end)
            tg.start_soon(self._sampler, end)

    def _prompt(self) -> list[int]:
        document = self.documents[int(self.rng.integers(len(self.documents)))]
        return document + self.rng.integers(0, self.vocab, self.args.suffix_tokens).tolist()

    def _life_point(self) -> float:
        """A random point of a request's life: uniform over [0, the recent median]."""
        recent = self.latencies[-200:]
        median = float(np.median(recent)) if recent else 0.2
        return float(self.rng.uniform(0.0, max(median, 0.01)))

    async def _worker(self, worker: int, end: float) -> None:
        number = 0
        while time.monotonic() < end:
            request_id = f"soak-{worker}-{number}"
            number += 1
            dice = self.rng.random()
            body = {"tokens": self._prompt(), "id": request_id}
            self.counts.sent += 1
            if dice < self.args.cancel_fraction:
                await self._cancelled(body)
            elif dice < self.args.cancel_fraction + self.args.disconnect_fraction:
                with anyio.move_on_after(self._life_point()):
                    await self._post(body)
                    continue
                self.counts.disconnected += 1
            else:
                await self._post(body)

    async def _cancelled(self, body: dict) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._post, body)
            await anyio.sleep(self._life_point())
            self.counts.deletes += 1
            with contextlib.suppress(httpx.HTTPError):
                reply = await self.client.delete(f"/v1/requests/{body['id']}")
                self.counts.deletes_found += int(reply.status_code == 200)  # 404: already over

    async def _post(self, body: dict) -> None:
        start = time.monotonic()
        try:
            reply = await self.client.post("/v1/prefill", json=body)
            status = reply.json().get("status") if reply.status_code < 500 else None
        except (httpx.HTTPError, ValueError):
            status = None
        if status == "done":
            self.counts.done += 1
            self.latencies = [*self.latencies[-199:], time.monotonic() - start]
        elif status == "cancelled":
            self.counts.cancelled += 1
        else:
            self.counts.other += 1

    async def _sampler(self, end: float) -> None:
        while True:
            await self.sample()
            if time.monotonic() >= end:
                return
            await anyio.sleep(min(self.args.every_s, max(end - time.monotonic(), 0.0)))

    async def sample(self) -> dict:
        rss = rank_rss(self.launcher)
        try:
            exposition = (await self.client.get("/metrics")).text
            tables, limits = table_sizes(exposition), table_sizes(exposition, LIMIT)
        except httpx.HTTPError:
            tables = limits = None
        row = {
            "t_s": round(time.monotonic() - self.started, 2),
            "requests": self.counts.as_dict(),
            "rss_bytes": {str(rank): value for rank, value in rss.items()},
            "rss_total_bytes": sum(rss.values()),
            "tables": tables,
            "table_limits": limits or {},
        }
        self.samples.append(row)
        print(render(row), flush=True)
        return row


def render(row: dict) -> str:
    c = row["requests"]
    ranks = ", ".join(f"rank {r} {b / MIB:.1f}" for r, b in row["rss_bytes"].items())
    tables = row["tables"]
    shown = (
        " ".join(f"{name}={value:g}" for name, value in tables.items())
        if tables is not None
        else "unavailable (the server exports no wavepp_table_size gauge)"
    )
    return (
        f"t {row['t_s']:7.1f} s  requests {c['sent']} (done {c['done']}, cancelled "
        f"{c['cancelled']} of {c['deletes']} DELETEs, disconnected {c['disconnected']}, "
        f"other {c['other']})  "
        f"RSS MiB {row['rss_total_bytes'] / MIB:.1f} [{ranks}]  tables: {shown}"
    )


# -- the server -------------------------------------------------------------------------


def start_server(args: argparse.Namespace, server_args: list[str], log: Path) -> tuple:
    cmd = [sys.executable, "-m", "wavepp.serve.launch",
           "--nproc-per-node", str(args.nproc_per_node), "--host", "127.0.0.1", "--port", "0",
           "--concurrency", str(args.concurrency), *SERVER_DEFAULTS, *server_args]  # fmt: skip
    err = log.open("w")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + args.start_timeout_s
    while time.monotonic() < deadline:
        match = READY.search(log.read_text())
        if match:
            return proc, match.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"benchmarks.soak: the server did not start:\n{log.read_text()[-3000:]}")


def stop_server(proc: subprocess.Popen, timeout_s: float) -> int:
    """SIGTERM to the launcher, as a supervisor would: the server drains, the leak check
    runs on every stage, and the exit status says whether it held."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


async def drive(args: argparse.Namespace, url: str, launcher: int) -> tuple[Soak, bool]:
    """The soak, and whether the server says its waves are simulated (``--executor sim``)."""
    limits = httpx.Limits(max_connections=2 * args.concurrency + 4,
                          max_keepalive_connections=2 * args.concurrency + 4)  # fmt: skip
    timeout = httpx.Timeout(args.request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        models = await client.get("/v1/models")
        simulated = bool(models.json()["data"][0]["wavepp"].get("simulated"))
        soak = Soak(args, client, launcher)
        await soak.run()
        return soak, simulated


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--duration-s", type=float, default=600, help="seconds of load [600]")
    p.add_argument("--every-s", type=float, default=10, help="seconds between samples [10]")
    p.add_argument("--nproc-per-node", type=int, default=2, help="pipeline stages P [2]")
    p.add_argument(
        "--concurrency",
        type=int,
        default=8,
        help="requests the client keeps outstanding (and the server's c) [8]",
    )
    p.add_argument("--documents", type=int, default=16, help="shared prefixes [16]")
    p.add_argument("--prefix-tokens", type=int, default=256, help="tokens a prefix [256]")
    p.add_argument("--suffix-tokens", type=int, default=32, help="fresh tokens a prompt [32]")
    p.add_argument(
        "--cancel-fraction",
        type=float,
        default=0.1,
        help="share of requests cancelled by DELETE [0.1]",
    )
    p.add_argument(
        "--disconnect-fraction",
        type=float,
        default=0.1,
        help="share of requests abandoned mid-flight [0.1]",
    )
    p.add_argument("--seed", type=int, default=0, help="the workload's and the dice's seed [0]")
    p.add_argument("--json", help="write the time series here")
    p.add_argument("--log", default="soak-server.log", help="the server's stderr [%(default)s]")
    p.add_argument(
        "--start-timeout-s",
        type=float,
        default=300,
        help="longest wait for the server's ready line [300]",
    )
    p.add_argument("--request-timeout-s", type=float, default=120,
                   help="longest wait for one answer [120]")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    args, server_args = parser().parse_known_args(argv)
    if args.cancel_fraction + args.disconnect_fraction > 1 or args.duration_s <= 0:
        raise SystemExit("benchmarks.soak: fractions must sum to ≤ 1, --duration-s be > 0")
    proc, url = start_server(args, server_args, Path(args.log))
    print(f"soak: server at {url}, launcher pid {proc.pid}; {args.duration_s:g} s of load at "
          f"c = {args.concurrency}, a sample every {args.every_s:g} s", flush=True)  # fmt: skip
    try:
        soak, simulated = anyio.run(drive, args, url, proc.pid)
    finally:
        code = stop_server(proc, timeout_s=120)
    print(f"soak: server exit status {code} (0: drained and the leak check held)"
          + ("; its waves were SIMULATED (--executor sim)" if simulated else ""))
    if args.json:
        record = {
            "simulated": simulated,
            "config": {k: v for k, v in vars(args).items() if k not in ("json", "log")},
            "server_args": [*SERVER_DEFAULTS, *server_args],
            "server_exit": code,
            "samples": soak.samples,
        }
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
