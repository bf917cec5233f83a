"""The data plane over a Unix socket (``--data-plane local``): the same messages as over
Gloo, every dtype the links carry; a peer's header is refused before anything is
allocated; a peer that closes its end fails the wait at once, not after a timeout."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from wavepp.exec.planes import DataLimits, Link, PlaneError, SocketLink

LIMITS = DataLimits.for_run(budget=512, width=64, dtype=torch.bfloat16, max_descriptor_bytes=4096)


def _pair(timeout_s: float = 10.0) -> tuple[SocketLink, SocketLink, socket.socket, socket.socket]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sender = SocketLink(Link(None, 0, 1, LIMITS), a, timeout_s)
    receiver = SocketLink(Link(None, 0, 1, LIMITS), b, timeout_s)
    return sender, receiver, a, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_messages_arrive_whole_and_in_order(dtype):
    limits = DataLimits.for_run(budget=512, width=64, dtype=dtype, max_descriptor_bytes=4096)
    sender, receiver, *_ = _pair()
    sender.limits = receiver.limits = limits
    sent = [(f"wave {i}".encode() * (i + 1), torch.randn(i * 37 + 1, 64).to(dtype))
            for i in range(8)]  # fmt: skip
    sent.append((b"no tensor", None))
    thread = threading.Thread(target=lambda: [sender.send_blocking(d, t) for d, t in sent])
    thread.start()  # a tensor larger than the socket's buffer needs a reader meanwhile
    for desc, tensor in sent:
        got_desc, got = receiver.recv_blocking(4096)
        assert got_desc == desc
        if tensor is None:
            assert got is None
        else:
            assert got.dtype == dtype and torch.equal(got, tensor) and got.is_inference()
    thread.join(timeout=30)


def test_a_bad_header_is_refused_before_anything_is_allocated():
    _, receiver, a, _ = _pair()
    words = [0x57505044, 0, 100, 3, 2, 1 << 40, 64, 0, 0, 0]  # 2^40 tokens of bfloat16
    a.sendall(torch.tensor(words, dtype=torch.int64).numpy().tobytes())
    asked = []
    real = receiver._recv

    def recording(tensor, group):
        asked.append(tensor.numel() * tensor.element_size())
        real(tensor, group)

    receiver._recv = recording
    with pytest.raises(PlaneError, match="tokens"):
        receiver.recv_blocking(4096)
    assert asked == [80]  # the header only


def test_a_peer_that_closes_its_end_fails_the_wait_at_once():
    _, receiver, a, _ = _pair(timeout_s=600)
    timer = threading.Timer(0.2, a.close)
    timer.start()
    with pytest.raises(PlaneError, match="closed its link"):
        receiver.recv_blocking(4096)  # idle: no timeout on the header, yet no hang
    timer.join()


def test_a_message_cut_short_fails_within_the_timeout():
    _, receiver, a, _ = _pair(timeout_s=0.5)
    words = [0x57505044, 0, 100, 0, 0, 0, 0, 0, 0, 0]  # a 100-byte descriptor, no tensor
    a.sendall(torch.tensor(words, dtype=torch.int64).numpy().tobytes() + b"x" * 10)
    with pytest.raises(PlaneError, match="10 of 100 bytes"):
        receiver.recv_blocking(4096)
