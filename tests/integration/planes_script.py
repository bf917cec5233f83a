"""Run by test_planes under torchrun (2 ranks): the two planes never wait on each other,
a compute thread keeps its speed while admission rounds run on the event loop, and a
rounds broadcast delivers payloads of every size."""

from __future__ import annotations

import datetime
import hashlib
import json
import sys
import time

import anyio
import torch
import torch.distributed as dist

from wavepp.rounds.admission import Offer, RoundMode, StageBook, run_round
from wavepp.state import block_hashes, cancel, empty_cache
from wavepp.transport.planes import build_planes


async def main(out_path: str) -> None:
    rank = dist.get_rank()
    planes = await build_planes(30, "gloo", "gloo")
    plane, inbound, outbound = planes.rounds, planes.inbound, planes.outbound
    result: dict = {}

    # A: a data-plane receive is pending on rank 1 while 20 rounds run.
    async with anyio.create_task_group() as tg:
        if rank == 1:

            async def receive() -> None:
                await inbound.recv(1 << 20)
                result["data_at"] = time.monotonic()

            tg.start_soon(receive)
        t0 = time.monotonic()
        for i in range(20):
            await plane.all_min([rank, i])
        result["rounds_at"] = time.monotonic()
        result["rounds_s"] = result["rounds_at"] - t0
        if rank == 0:
            await anyio.sleep(0.5)
            await outbound.send(b"wave", torch.zeros(4))

    # B: a rounds broadcast is pending on rank 1 while 10 waves cross the data plane.
    async with anyio.create_task_group() as tg:
        if rank == 1:

            async def follow() -> None:
                await plane.broadcast(None)
                result["broadcast_at"] = time.monotonic()

            tg.start_soon(follow)
            for _ in range(10):
                await inbound.recv(1 << 20)
            result["waves_at"] = time.monotonic()
        else:
            for _ in range(10):
                await outbound.send(b"wave", torch.zeros(1024))
            await anyio.sleep(0.5)
            await plane.broadcast(b"round")

    # C: a forward-like compute thread while admission rounds keep the loop busy.
    def compute() -> float:
        a = torch.randn(384, 384)
        t = time.perf_counter()
        for _ in range(200):
            a = torch.tanh(a @ a)
        return time.perf_counter() - t

    alone = await anyio.to_thread.run_sync(compute)
    book = StageBook(empty_cache(4096))
    offers = [
        Offer(f"r{i}", 64 * 40, block_hashes(list(range(i, i + 64 * 40)), 64), 39)
        for i in range(16)
    ]
    busy = {"rounds": 0}

    async def admission() -> None:
        while True:
            await run_round(plane, book, offers, RoundMode(block_size=64))
            for o in offers:
                book.cache = cancel(book.cache, o.request_id)
            busy["rounds"] += 1
            # Both ranks must agree to stop, or their collectives would mismatch.
            if (await plane.all_min([0 if busy.get("stop") else 1]))[0] == 0:
                return

    async with anyio.create_task_group() as tg:
        tg.start_soon(admission)
        together = await anyio.to_thread.run_sync(compute)
        busy["stop"] = True
    result.update(
        compute_alone_s=alone, compute_with_rounds_s=together, rounds_during=busy["rounds"]
    )
    # D: broadcasts of every size: within the inline room (one collective), past it
    # (a second for the rest; the room grows), and past the room's ceiling.
    payloads = [b"", b"x", bytes(range(256)) * 20, b"y" * (300 << 10), b"tail"]
    got = []
    for payload in payloads:
        data = await plane.broadcast(payload if rank == 0 else None)
        got.append([len(data), hashlib.sha256(data).hexdigest()])
    result.update(broadcasts=got, inline=plane.inline)
    gathered = await plane.gather(json.dumps(result).encode())
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump([json.loads(g) for g in gathered], f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    anyio.run(main, sys.argv[1])
    dist.destroy_process_group()
