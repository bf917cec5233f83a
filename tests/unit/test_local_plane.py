"""The rounds plane over Unix sockets: four ranks as tasks of one event loop, and peers
that break the protocol (a wrong operation, a huge or wrong length, a wrong magic, a
second rank of the same number, a closed socket, silence)."""

from __future__ import annotations

import struct

import anyio
import pytest

from wavepp.transport.base import PlaneError
from wavepp.transport.frames import BROADCAST, HELLO, MIN, REDUCE
from wavepp.transport.frames import ROUNDS_MAGIC as MAGIC
from wavepp.transport.unix import SocketRoundsPlane

HEADER = struct.Struct("<IB3xQ")


async def _planes(world: int, timeout_s: float = 10.0) -> list[SocketRoundsPlane]:
    path = SocketRoundsPlane.listen_path()
    listener = await anyio.create_unix_listener(path)
    planes: list[SocketRoundsPlane | None] = [None] * world

    async def one(rank: int) -> None:
        planes[rank] = await SocketRoundsPlane.connect(
            rank, world, path, timeout_s, listener if rank == 0 else None
        )

    async with anyio.create_task_group() as tg:
        for rank in range(world):
            tg.start_soon(one, rank)
    return planes  # type: ignore[return-value]


async def _all(planes, call) -> list:
    out = [None] * len(planes)

    async def one(i: int) -> None:
        out[i] = await call(planes[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(planes)):
            tg.start_soon(one, i)
    return out


def test_four_ranks_agree_on_every_operation():
    async def main():
        planes = await _planes(4)
        for size in (0, 1, 5_000, 300_000):
            payload = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
            got = await _all(planes, lambda p, b=payload: p.broadcast(b if p.rank == 0 else None))
            assert got == [payload] * 4
        got = await _all(planes, lambda p: p.all_min([p.rank, -p.rank, 7, 2**62 - p.rank]))
        assert got == [[0, -3, 7, 2**62 - 3]] * 4
        masks = {0: [0b1111, 1], 1: [0b0111, 1], 2: [0b1101, 0], 3: [0b0101, 1]}
        got = await _all(planes, lambda p: p.all_and(masks[p.rank]))
        assert got == [[0b0101, 0]] * 4
        assert await _all(planes, lambda p: p.all_min([])) == [[]] * 4
        got = await _all(planes, lambda p: p.gather(f"stage {p.rank}".encode()))
        assert got[0] == [b"stage 0", b"stage 1", b"stage 2", b"stage 3"]
        assert got[1:] == [None] * 3
        for plane in planes:
            await plane.aclose()

    anyio.run(main)


def test_one_rank_needs_no_socket():
    async def main():
        (plane,) = await _planes(1)
        assert await plane.broadcast(b"abc") == b"abc"
        assert await plane.all_min([3, 1]) == [3, 1]
        assert await plane.gather(b"me") == [b"me"]

    anyio.run(main)


def test_the_socket_file_is_gone_once_everyone_is_in():
    async def main():
        path = SocketRoundsPlane.listen_path()
        listener = await anyio.create_unix_listener(path)
        planes = [None, None]

        async def one(rank):
            planes[rank] = await SocketRoundsPlane.connect(
                rank, 2, path, 10.0, listener if rank == 0 else None
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, 0)
            tg.start_soon(one, 1)
        assert not await anyio.Path(path).parent.exists()

    anyio.run(main)


async def _rank0_and_raw_peer(world: int = 2):
    """Rank 0's plane and a raw socket that said hello as rank 1 (a hostile peer)."""
    path = SocketRoundsPlane.listen_path()
    listener = await anyio.create_unix_listener(path)
    box = {}

    async def zero():
        box["plane"] = await SocketRoundsPlane.connect(0, world, path, 10.0, listener)

    async with anyio.create_task_group() as tg:
        tg.start_soon(zero)
        raw = await anyio.connect_unix(path)
        await raw.send(HEADER.pack(MAGIC, HELLO, 8) + struct.pack("<q", 1))
    return box["plane"], raw


@pytest.mark.parametrize(
    "header, says",
    [
        (HEADER.pack(MAGIC, BROADCAST, 16), "sent broadcast while this rank runs"),
        (HEADER.pack(MAGIC, MIN, 16), r"sent all_reduce MIN while this rank runs all_reduce MI"),
        (HEADER.pack(MAGIC, REDUCE, 1 << 40), r"sent 1,099,511,627,776 bytes for all_reduce MI"),
        (HEADER.pack(MAGIC, REDUCE, 24), r"sent 24 bytes for all_reduce MIN \+ AND; 16"),
        (HEADER.pack(0xDEAD, REDUCE, 16), "without WavePP's magic"),
    ],
)
def test_a_bad_frame_is_refused_before_its_payload(header, says):
    async def main():
        plane, raw = await _rank0_and_raw_peer()
        await raw.send(header)  # the header alone: no payload is needed to refuse it
        with anyio.fail_after(30):  # hang guard
            with pytest.raises(PlaneError, match=says):
                await plane.all_min([5])
        await raw.aclose()

    anyio.run(main)


def test_a_huge_broadcast_announcement_is_refused():
    async def main():
        path = SocketRoundsPlane.listen_path()
        listener = await anyio.create_unix_listener(path)
        box = {}

        async def zero_side():  # a hostile "rank 0": accepts, then announces 1 TiB
            stream = await listener.accept()
            await stream.receive()  # the hello
            await stream.send(HEADER.pack(MAGIC, BROADCAST, 1 << 40))
            box["stream"] = stream

        async with anyio.create_task_group() as tg:
            tg.start_soon(zero_side)
            plane = await SocketRoundsPlane.connect(1, 2, path, 10.0)
        with anyio.fail_after(30):
            with pytest.raises(PlaneError, match="announced 1,099,511,627,776 bytes"):
                await plane.broadcast(None)
        await listener.aclose()

    anyio.run(main)


def test_a_rank_number_said_twice_or_out_of_range_is_refused():
    async def main(said):
        path = SocketRoundsPlane.listen_path()
        listener = await anyio.create_unix_listener(path)

        async def zero():
            await SocketRoundsPlane.connect(0, 3, path, 10.0, listener)

        with anyio.fail_after(30):
            with pytest.raises(ExceptionGroup) as caught:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(zero)
                    for rank in said:
                        raw = await anyio.connect_unix(path)
                        await raw.send(HEADER.pack(MAGIC, HELLO, 8) + struct.pack("<q", rank))
        (error,) = caught.value.exceptions
        assert isinstance(error, PlaneError) and "expected one of 1..2, once each" in str(error)

    anyio.run(main, [1, 1])
    anyio.run(main, [5])


def test_a_peer_that_closes_or_stays_silent_fails_the_operation():
    async def main():
        plane, raw = await _rank0_and_raw_peer()
        await raw.aclose()
        with anyio.fail_after(30):
            with pytest.raises(PlaneError, match="rank 1 is gone"):
                await plane.all_and([1])

        plane, raw = await _rank0_and_raw_peer()
        plane.timeout_s = 0.2
        with anyio.fail_after(30):
            with pytest.raises(PlaneError, match=r"no answer within 0\.2 s"):
                await plane.gather(b"report")
        await raw.aclose()

    anyio.run(main)
