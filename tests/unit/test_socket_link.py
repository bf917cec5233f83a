"""The data plane over a Unix socket (``--data-plane local``): the same messages as over
Gloo, every dtype the links carry, awaited in the event loop; a peer's header is refused
before anything is allocated; a peer that closes its end fails the wait at once, not
after a timeout; a message cut short fails within the timeout."""

from __future__ import annotations

import inspect
import socket

import anyio
import pytest
import torch

from wavepp.transport.base import Link, PlaneError
from wavepp.transport.frames import DataLimits
from wavepp.transport.gloo import GlooLink
from wavepp.transport.planes import _path_from_rank0
from wavepp.transport.unix import SocketLink

LIMITS = DataLimits.for_run(budget=512, width=64, dtype=torch.bfloat16, max_descriptor_bytes=4096)


def _pair(timeout_s: float = 10.0, limits: DataLimits = LIMITS):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sender = SocketLink(0, 1, a, timeout_s, limits)
    receiver = SocketLink(0, 1, b, timeout_s, limits)
    return sender, receiver, a


def _header(*words: int) -> bytes:
    return torch.tensor(words, dtype=torch.int64).numpy().tobytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_messages_arrive_whole_and_in_order_from_concurrent_senders(dtype):
    limits = DataLimits.for_run(budget=512, width=64, dtype=dtype, max_descriptor_bytes=4096)
    sender, receiver, _ = _pair(limits=limits)
    waves = {s: [(f"{s}:{i}".encode() * (i + 1), torch.randn(i * 61 + 1, 64).to(dtype))
                 for i in range(6)] for s in range(3)}  # fmt: skip
    waves[0].append((b"0:no tensor", None))
    got: list[tuple[bytes, torch.Tensor | None]] = []

    async def main() -> None:
        async def send_all(s: int) -> None:
            for desc, tensor in waves[s]:  # larger than the socket's buffer: writes wait
                await sender.send(desc, tensor)

        async def receive_all() -> None:
            for _ in range(sum(map(len, waves.values()))):
                got.append(await receiver.recv(4096))

        async with anyio.create_task_group() as tg:
            tg.start_soon(receive_all)
            for s in waves:
                tg.start_soon(send_all, s)

    anyio.run(main)
    by_sender: dict[int, list] = {s: [] for s in waves}
    for desc, tensor in got:
        by_sender[int(desc.split(b":")[0])].append((desc, tensor))
    for s, sent in waves.items():
        assert [d for d, _ in by_sender[s]] == [d for d, _ in sent]  # in order per sender
        for (_, tensor), (_, want) in zip(by_sender[s], sent, strict=True):
            if want is None:
                assert tensor is None
            else:  # whole, and an inference tensor like the sender's executor output
                assert tensor.dtype == dtype and torch.equal(tensor, want)
                assert tensor.is_inference()


def test_a_bad_header_is_refused_before_anything_is_allocated():
    _, receiver, a = _pair()
    a.sendall(_header(0x57505044, 0, 100, 3, 2, 1 << 40, 64, 0, 0, 0))  # 2^40 bf16 tokens
    asked = []
    real = receiver._read_into

    async def recording(view):
        asked.append(len(view))
        await real(view)

    receiver._read_into = recording
    with pytest.raises(PlaneError, match="rows, this link takes at most"):
        anyio.run(receiver.recv, 4096)
    assert asked == [80]  # the header only


def test_a_peer_that_closes_its_end_fails_the_wait_at_once():
    _, receiver, a = _pair(timeout_s=600)

    async def main() -> None:
        async def close_soon() -> None:
            await anyio.sleep(0.2)
            a.close()

        async with anyio.create_task_group() as tg:
            tg.start_soon(close_soon)
            with anyio.fail_after(60):  # a hang guard: the idle wait has no timeout
                await receiver.recv(4096)

    with pytest.raises(ExceptionGroup) as caught:
        anyio.run(main)
    assert caught.group_contains(PlaneError, match="closed its link")


def test_a_message_cut_short_fails_within_the_timeout():
    _, receiver, a = _pair(timeout_s=0.5)
    a.sendall(_header(0x57505044, 0, 100, 0, 0, 0, 0, 0, 0, 0) + b"x" * 10)  # 10 of 100
    with pytest.raises(PlaneError, match="stopped short"):
        anyio.run(receiver.recv, 4096)


@pytest.mark.parametrize("cls", [SocketLink, GlooLink])
def test_both_links_do_what_the_link_protocol_says_with_the_same_signatures(cls):
    """The runtime holds either link as a ``Link``: each has every member, with the
    protocol's parameters, and neither is a subclass of the other."""
    for name in ("send", "recv", "set_limits"):
        want = inspect.signature(getattr(Link, name))
        assert inspect.signature(getattr(cls, name)) == want, (cls, name)
        assert inspect.iscoroutinefunction(getattr(cls, name)) == (name != "set_limits")
    assert cls.kind in ("local", "gloo")
    assert not issubclass(SocketLink, GlooLink) and not issubclass(GlooLink, SocketLink)


def test_new_limits_bound_what_a_link_accepts():
    sender, receiver, _ = _pair()
    receiver.set_limits(DataLimits.for_run(budget=8, width=64, dtype=torch.bfloat16,
                                           max_descriptor_bytes=4096))  # fmt: skip

    async def main() -> None:
        await sender.send(b"wave", torch.zeros(9, 64, dtype=torch.bfloat16))
        await receiver.recv(4096)

    with pytest.raises(PlaneError, match="9 rows, this link takes at most 8"):
        anyio.run(main)


class _Rank0Says:
    """A stand-in for the Gloo plane: its broadcast delivers rank 0's bytes."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    async def broadcast(self, payload: bytes) -> bytes:
        return self.raw


@pytest.mark.parametrize(("raw", "error"), [
    (b"relative/dir", "unusable"), (b"/" + b"x" * 90, "unusable"), (b"/tmp/\xff", "UTF-8"),
])  # fmt: skip
def test_a_bad_socket_path_from_rank_0_is_refused(raw, error):
    with pytest.raises(PlaneError, match=error):
        anyio.run(_path_from_rank0, _Rank0Says(raw), "", "data-plane socket directory", 90)


def test_a_good_socket_path_or_none_passes():
    for raw in (b"", b"/tmp/wavepp-data-x"):
        got = anyio.run(_path_from_rank0, _Rank0Says(raw), "", "directory", 90)
        assert got == raw.decode()
