"""Run by test_data_plane under torchrun (2 ranks): waves sent concurrently from several
tasks arrive whole — each descriptor with its own tensor — and in order per sender, over
the data plane given (``gloo`` or ``local``); the process groups made on the way."""

from __future__ import annotations

import datetime
import json
import sys

import anyio
import torch
import torch.distributed as dist

from wavepp.transport.frames import DataLimits
from wavepp.transport.planes import build_planes

SENDERS, WAVES, WIDTH, BUDGET = 4, 25, 96, 300


def wave(sender: int, i: int) -> tuple[bytes, torch.Tensor]:
    tokens = (sender * 37 + i * 11) % BUDGET + 1
    desc = json.dumps({"sender": sender, "i": i, "tokens": tokens, "pad": "x" * (i * 13)})
    return desc.encode(), torch.full((tokens, WIDTH), float(sender * 1000 + i))


def counting_groups() -> list[list[int]]:
    """The ranks of every process group made from here on."""
    made, real = [], dist.new_group

    def new_group(ranks=None, *args, **kwargs):
        made.append(list(ranks or []))
        return real(ranks, *args, **kwargs)

    dist.new_group = new_group
    return made


async def main(out_path: str, kind: str) -> None:
    groups = counting_groups()
    limits = DataLimits.for_run(BUDGET, WIDTH, torch.float32, 1 << 16)
    planes = await build_planes(30, "gloo", kind, limits=limits)
    assert planes.data_kind == kind, (planes.data_kind, kind)
    inbound, outbound = planes.inbound, planes.outbound
    if dist.get_rank() == 0:

        async def send_all(sender: int) -> None:
            for i in range(WAVES):
                await outbound.send(*wave(sender, i))

        async with anyio.create_task_group() as tg:
            for sender in range(SENDERS):
                tg.start_soon(send_all, sender)
        return
    seen: dict[int, list[int]] = {s: [] for s in range(SENDERS)}
    mismatches, plain = [], []
    for _ in range(SENDERS * WAVES):
        raw, tensor = await inbound.recv(1 << 20)
        desc = json.loads(raw)
        want = float(desc["sender"] * 1000 + desc["i"])
        whole = tensor.shape == (desc["tokens"], WIDTH) and bool((tensor == want).all())
        if not tensor.is_inference():  # a compiled stage would recompile for it
            plain.append(desc["i"])
        if not whole:
            mismatches.append(desc["i"])
        seen[desc["sender"]].append(desc["i"])
    with open(out_path, "w") as f:
        json.dump({"mismatches": mismatches, "plain": plain, "order": seen, "groups": groups}, f)


if __name__ == "__main__":
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    anyio.run(main, sys.argv[1], sys.argv[2])
    dist.barrier()
    dist.destroy_process_group()
