"""The host's round trips, against which an admission round is judged (issue 60).

:func:`measure` times, on rank 0, over ``n`` iterations after a warm-up:

- ``pingpong_raw``: 24 bytes there and back between two processes over a blocking Unix
  socket pair, no event loop: the kernel's floor;
- ``pingpong_loop``: the same between two processes that each wait in an anyio event
  loop (``wait_readable`` on a non-blocking socket, as the ranks' planes wait): *the
  host's round trip* between two ranks;
- ``plane_min_2``: ``all_min`` of one int on a two-rank ``SocketRoundsPlane`` (one frame
  each way, with the plane's own framing, checks and timeouts);
- ``bcast_min`` / ``bcast_min_idle``: a round's skeleton on ``world`` ranks, a broadcast of
  200 bytes and an ``all_min`` of one int, back to back, and after rank 0 sleeps 2 ms (the
  peers asleep in their event loops when it opens, as between a run's rounds); with each
  rank's CPU per iteration (its event loop's thread, user + system);
- with ``gloo``: Gloo's ``all_reduce`` MIN of one int64 over ``world`` ranks and a
  blocking ``send`` / ``recv`` ping-pong between ranks 0 and 1.

Only the planes' public operations are used, so the same code times an older checkout
(``PYTHONPATH`` pointing at it).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

from benchmarks._stats import percentile


def _summary(ns: list[int]) -> dict[str, float]:
    us = [x / 1e3 for x in ns]
    return {"p50_us": round(percentile(us, 50), 1), "p90_us": round(percentile(us, 90), 1),
            "p99_us": round(percentile(us, 99), 1), "n": len(us)}  # fmt: skip


def raw_pingpong(n: int) -> dict[str, float]:
    """A blocking socket pair between this process and a forked child."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    msg, buf = b"\0" * 24, bytearray(24)
    pid = os.fork()
    if pid == 0:  # the child answers every message
        a.close()
        for _ in range(n + 200):
            b.recv_into(buf, 24, socket.MSG_WAITALL)
            b.sendall(msg)
        os._exit(0)
    b.close()
    times = []
    for _ in range(n + 200):
        t = time.perf_counter_ns()
        a.sendall(msg)
        a.recv_into(buf, 24, socket.MSG_WAITALL)
        times.append(time.perf_counter_ns() - t)
    os.waitpid(pid, 0)
    a.close()
    return _summary(times[200:])


async def _loop_pingpong(sock: socket.socket, first: bool, n: int) -> list[int]:
    sock.setblocking(False)
    msg, buf, times = b"\0" * 24, bytearray(24), []

    async def read() -> None:
        got = 0
        while got < 24:
            try:
                k = sock.recv_into(memoryview(buf)[got:])
            except BlockingIOError:
                await anyio.wait_readable(sock)
                continue
            if not k:
                raise EOFError
            got += k

    for _ in range(n + 200):
        t = time.perf_counter_ns()
        if first:
            sock.send(msg)
            await read()
        else:
            await read()
            sock.send(msg)
        times.append(time.perf_counter_ns() - t)
    return times[200:]


def loop_pingpong(n: int) -> dict[str, float]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        a.close()
        anyio.run(_loop_pingpong, b, False, n)
        os._exit(0)
    b.close()
    times = anyio.run(_loop_pingpong, a, True, n)
    os.waitpid(pid, 0)
    a.close()
    return _summary(times)


async def _plane_rank(rank: int, world: int, where: str, n: int) -> dict:
    import resource

    from wavepp.transport.unix import SocketRoundsPlane

    path, ready = where.split(",")
    listener = None
    if rank == 0:
        listener = await anyio.create_unix_listener(path)
        Path(ready).touch()
    plane = await SocketRoundsPlane.connect(rank, world, path, 60.0, listener)
    out: dict = {}
    for _ in range(200):  # warm up
        await plane.all_min([rank])
    payload = b"x" * 200
    steps = [("bcast_min", 0.0, n), ("bcast_min_idle", 0.002, n // 4)]
    if world == 2:
        steps = [("plane_min_2", None, n)]
    for key, gap, count in steps:
        ru0, times = resource.getrusage(resource.RUSAGE_THREAD), []
        for _ in range(count):
            if gap and rank == 0:
                await anyio.sleep(gap)
            t = time.perf_counter_ns()
            if gap is not None:
                await plane.broadcast(payload if rank == 0 else None)
            await plane.all_min([rank])
            times.append(time.perf_counter_ns() - t)
        ru1 = resource.getrusage(resource.RUSAGE_THREAD)
        cpu = (ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime) / count * 1e6
        out[key] = _summary(times)
        every = await plane.gather(f"{cpu:.1f}".encode())
        if every is not None:
            out[key]["cpu_us_by_rank"] = [float(b) for b in every]
    await plane.aclose()
    return out


def _gloo_rank(rank: int, world: int, init: str, n: int) -> dict:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    t1 = torch.zeros(1, dtype=torch.int64)
    out: dict = {}
    for _ in range(100):
        dist.all_reduce(t1, op=dist.ReduceOp.MIN)
    times = []
    for _ in range(n):
        t = time.perf_counter_ns()
        dist.all_reduce(t1, op=dist.ReduceOp.MIN)
        times.append(time.perf_counter_ns() - t)
    out["gloo_all_reduce_min"] = _summary(times)
    times = []
    for _ in range(n):
        t = time.perf_counter_ns()
        if rank == 0:
            dist.send(t1, 1)
            dist.recv(t1, 1)
        elif rank == 1:
            dist.recv(t1, 0)
            dist.send(t1, 0)
        times.append(time.perf_counter_ns() - t)
    if rank == 0:
        out["gloo_pingpong"] = _summary(times)
    dist.barrier()
    dist.destroy_process_group()
    return out


def worker(argv: list[str]) -> None:
    """One rank of :func:`measure` (``python -m benchmarks._rtt kind rank world where n out``)."""
    kind, rank, world, where, n, out = argv[0], *map(int, argv[1:3]), argv[3], int(argv[4]), argv[5]
    if kind == "plane":
        got = anyio.run(_plane_rank, rank, world, where, n)
    else:
        got = _gloo_rank(rank, world, where, n)
    if rank == 0:
        Path(out).write_text(json.dumps(got))


def _spawn(kind: str, world: int, where: str, n: int, out: Path, wait_for: str | None) -> dict:
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks._rtt", kind, "0", str(world),
                               where, str(n), str(out)])]  # fmt: skip
    if wait_for is not None:
        deadline = time.monotonic() + 60
        while not os.path.exists(wait_for) and time.monotonic() < deadline:
            time.sleep(0.01)
    for r in range(1, world):
        procs.append(subprocess.Popen([sys.executable, "-m", "benchmarks._rtt", kind, str(r),
                                       str(world), where, str(n), str(out)]))  # fmt: skip
    for p in procs:
        if p.wait(timeout=600) != 0:
            raise SystemExit(f"a {kind} rank failed ({p.returncode})")
    return json.loads(out.read_text())


def measure(world: int, n: int = 4000, gloo: bool = True) -> dict:
    """Every figure above, µs p50 / p90 / p99 over ``n`` iterations after a warm-up."""
    from wavepp.transport.unix import SocketRoundsPlane

    out: dict = {"pingpong_raw": raw_pingpong(n), "pingpong_loop": loop_pingpong(n)}
    with tempfile.TemporaryDirectory(prefix="wavepp-rtt-") as tmp:
        for ranks in (2, world):  # the plane removes its socket's directory once all are in
            path, ready = SocketRoundsPlane.listen_path(), os.path.join(tmp, f"ready-{ranks}")
            out.update(_spawn("plane", ranks, f"{path},{ready}", n, Path(tmp) / "plane.json",
                              ready))  # fmt: skip
        if gloo:
            init = f"file://{tmp}/gloo.store"
            out.update(_spawn("gloo", world, init, n // 4, Path(tmp) / "gloo.json", None))
    return out


if __name__ == "__main__":
    worker(sys.argv[1:])
