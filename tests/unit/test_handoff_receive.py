"""The handoff receiver over real sockets: bands assembled into a Handoff, each refusal
acked with its reason, broken senders costing only their band, bounded memory."""

from __future__ import annotations

import gc
import json
import os
import socket
import struct
import tempfile
import time

import anyio
import msgspec
import pytest
import torch

from wavepp.handoff import _io
from wavepp.handoff.assembly import HandoffError
from wavepp.handoff.client import build_band, send_band
from wavepp.handoff.lending import RESERVATION_S
from wavepp.handoff.receive import Receiver
from wavepp.handoff.wire import (
    ACK_PREFIX_BYTES,
    DONE_MAGIC,
    FLAG_RESERVE,
    FLAG_RESERVED,
    FLAG_SEGMENT,
    RESERVE_MAGIC,
    SEGMENT_BYTES,
    SEGMENT_MAGIC,
    Ack,
    Address,
    ack_length,
    band_bytes,
    decode_ack,
    encode_band_prefix,
    expected_tensors,
    fingerprint_from_hf_config,
    parse_segment,
    payload_layout,
)

KIMI = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
    "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 300,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "kv_lora_rank": 32, "qk_rope_head_dim": 8, "linear_num_heads": 2, "linear_head_dim": 8,
    "linear_conv_kernel_dim": 4,
}  # fmt: skip
T = 11


def tensors_for(layers, stage, seed=0, t=T, config=KIMI):
    gen = torch.Generator().manual_seed(seed)
    out = {}
    if stage == 0:
        out[(-1, "tokens")] = torch.randint(0, 300, (t,), generator=gen, dtype=torch.int32)
    for layer in layers:
        for name, (dtype, shape) in expected_tensors(config, "float32", layer, t).items():
            out[(layer, name)] = torch.randn(shape, generator=gen).to(getattr(torch, dtype))
    return out


def bands(rid="r1", split=((0, 1), (2, 3)), seed=0):
    fp = fingerprint_from_hf_config(KIMI, "float32")
    result = []
    for stage, layers in enumerate(split):
        last = stage == len(split) - 1
        result.append(build_band(rid, stage, len(split), fp, tensors_for(layers, stage, seed),
                                 T, 17 if last else -1, 2.5 if last else 0.0))  # fmt: skip
    return result


def run_with(receiver: Receiver, client, address: Address | None = None):
    """Serve on a fresh Unix socket, run ``client(address)``, stop; its result."""
    result = {}

    async def main(path):
        with anyio.fail_after(60):  # a hang guard
            async with anyio.create_task_group() as tg:
                bound = await tg.start(receiver.serve, address or Address("unix", path=path))
                result["value"] = await client(bound)
                tg.cancel_scope.cancel()

    with tempfile.TemporaryDirectory() as tmp:
        anyio.run(main, f"{tmp}/r.sock")
    return result["value"]


def test_a_bfloat16_band_arrives_with_its_bytes_and_dtypes():
    """Latents in bfloat16 (no numpy dtype: viewed through torch), states in float32,
    token ids in int32, in one band."""
    receiver = Receiver(KIMI, "bfloat16")
    fp = fingerprint_from_hf_config(KIMI, "bfloat16")
    gen = torch.Generator().manual_seed(3)
    sent = {(-1, "tokens"): torch.randint(0, 300, (T,), generator=gen, dtype=torch.int32)}
    for layer in range(4):
        for name, (dtype, shape) in expected_tensors(KIMI, "bfloat16", layer, T).items():
            sent[(layer, name)] = torch.randn(shape, generator=gen).to(getattr(torch, dtype))
    header, payload = build_band("bf", 0, 1, fp, sent, T, 5, 1.0)

    async def client(address):
        ack = await send_band(address, header, payload)
        return ack, await receiver.wait("bf", 10)

    ack, handoff = run_with(receiver, client)
    assert ack.ok, ack
    assert torch.equal(handoff.tokens, sent[(-1, "tokens")].long())
    for (layer, name), tensor in sent.items():
        if layer >= 0:
            got = handoff.layers[layer][name]
            assert got.dtype == tensor.dtype and torch.equal(got, tensor), (layer, name)
    assert handoff.layers[1]["latent"].dtype == torch.bfloat16


def test_two_bands_make_one_handoff_and_tcp_works():
    receiver = Receiver(KIMI, "float32")
    (h0, p0), (h1, p1) = bands()

    async def client(address):
        acks = [await send_band(address, h1, p1), await send_band(address, h0, p0)]
        return acks, await receiver.wait("r1", 10)

    acks, handoff = run_with(receiver, client)
    assert acks == [Ack("r1", 1, True), Ack("r1", 0, True)]
    expected = {**tensors_for((0, 1), 0), **tensors_for((2, 3), 1)}
    assert handoff.tokens.dtype == torch.int64
    assert torch.equal(handoff.tokens, expected[(-1, "tokens")].long())
    assert (handoff.first_token, handoff.top_logit, handoff.num_stages) == (17, 2.5, 2)
    assert sorted(handoff.layers) == [0, 1, 2, 3]
    assert sorted(handoff.layers[1]) == ["latent"] and sorted(handoff.layers[0]) == [
        "conv",
        "delta",
    ]
    for (layer, name), tensor in expected.items():
        if layer >= 0:
            assert torch.equal(handoff.layers[layer][name], tensor)
    assert receiver.held_bytes == 0 and receiver.counts["bands_ok"] == 2
    # over TCP too, with a callback instead of wait()
    got = []
    receiver = Receiver(KIMI, "float32", on_complete=got.append)
    ((h, p),) = bands("r2", split=((0, 1, 2, 3),))

    async def tcp_client(address):
        assert address.port > 0
        return await send_band(address, h, p)

    assert run_with(receiver, tcp_client, Address("tcp", host="127.0.0.1", port=0)).ok
    assert [g.request_id for g in got] == ["r2"] and receiver.held_bytes == 0


def refusal(receiver, header, payload):
    return run_with(receiver, lambda address: send_band(address, header, payload))


def test_fingerprint_mismatch_names_the_field():
    other = {**KIMI, "kv_lora_rank": 16}
    receiver = Receiver(other, "float32")
    ((h, p),) = bands(split=((0, 1, 2, 3),))
    ack = refusal(receiver, h, p)
    assert not ack.ok and ack.request_id == "r1"
    assert ack.error == "fingerprint kv_lora_rank: the band has 32, this model has 16"
    ack = refusal(Receiver(KIMI, "bfloat16"), h, p)
    assert ack.error == "fingerprint dtype: the band has 'float32', this model has 'bfloat16'"


def test_wrong_tensors_are_refused_by_name():
    ((h, p),) = bands(split=((0, 1, 2, 3),))
    specs = list(h.tensors)
    i = next(k for k, s in enumerate(specs) if s.name == "latent")
    specs[i] = msgspec.structs.replace(specs[i], shape=[T, 1, 41], nbytes=T * 41 * 4)
    bad = msgspec.structs.replace(h, tensors=specs)
    payload = list(p)
    payload[i] = torch.zeros(T, 1, 41)
    ack = refusal(Receiver(KIMI, "float32"), bad, payload)
    assert ack.error == (
        "layer 1 (M) tensor 'latent': the band has float32 [11, 1, 41], expected "
        "float32 [11, 1, 40] for 11 tokens"
    )
    bad = msgspec.structs.replace(h, tensors=specs[:i] + specs[i + 1 :])
    ack = refusal(Receiver(KIMI, "float32"), bad, p[:i] + p[i + 1 :])
    assert ack.error == "stage 0's band lacks latent of layer 1"
    renamed = msgspec.structs.replace(specs[1], name="k")
    bad = msgspec.structs.replace(h, tensors=[specs[0], renamed, *specs[2:]])
    ack = refusal(Receiver(KIMI, "float32"), bad, p)
    assert ack.error.startswith(
        "layer 0 (L, stage 0) has no tensor 'k'; expected ['conv', 'delta']"
    )


def test_budget_duplicates_coverage_and_token_range():
    (h0, p0), _ = bands()
    ack = refusal(Receiver(KIMI, "float32", max_band_bytes=1000), h0, p0)
    assert "exceeds max_band_bytes 1,000" in ack.error
    receiver = Receiver(KIMI, "float32")

    async def twice(address):
        return [await send_band(address, h0, p0), await send_band(address, h0, p0)]

    first, second = run_with(receiver, twice)
    assert first.ok and second.error == "request 'r1': stage 0's band was already received"
    # a last band that leaves layers uncovered
    (g0, q0), (g1, q1) = bands("r3", split=((0,), (2, 3)))
    receiver = Receiver(KIMI, "float32")

    async def gap(address):
        return [await send_band(address, g0, q0), await send_band(address, g1, q1)]

    ok, refused = run_with(receiver, gap)
    assert ok.ok and refused.error == "request 'r3': its 2 bands leave layers [1] uncovered"
    # token ids outside the vocabulary: refused after the payload, nothing kept
    bad_tokens = dict(tensors_for((0, 1, 2, 3), 0))
    bad_tokens[(-1, "tokens")] = torch.full((T,), 300, dtype=torch.int32)
    fp = fingerprint_from_hf_config(KIMI, "float32")
    header, payload = build_band("r4", 0, 1, fp, bad_tokens, T, 5)
    receiver = Receiver(KIMI, "float32")
    ack = refusal(receiver, header, payload)
    assert ack.error == "token ids span 300..300, outside the vocabulary of 300"
    assert receiver.held_bytes == 0 and receiver.pending() == {}


def raw_exchange(address: Address, data: bytes, then_close: bool = True) -> Ack | None:
    """Write raw bytes, half-close, read whatever ack comes back."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(20)
    sock.connect(address.path)
    sock.sendall(data)
    if then_close:
        sock.shutdown(socket.SHUT_WR)
    buf = b""
    while chunk := sock.recv(65536):
        buf += chunk
    sock.close()
    if not buf:
        return None
    return decode_ack(buf[ACK_PREFIX_BYTES : ACK_PREFIX_BYTES + ack_length(buf[:8])])


def test_garbage_and_broken_senders_cost_only_their_band():
    receiver = Receiver(KIMI, "float32", read_timeout_s=0.5)
    ((h, p),) = bands(split=((0, 1, 2, 3),))
    prefix = encode_band_prefix(h)

    async def client(address):
        acks = {}
        acks["garbage"] = await anyio.to_thread.run_sync(raw_exchange, address, b"\x00" * 64)
        bad_version = b"WPHB" + struct.pack("<HHI", 9, 0, 10)
        acks["version"] = await anyio.to_thread.run_sync(raw_exchange, address, bad_version)
        acks["junk header"] = await anyio.to_thread.run_sync(
            raw_exchange, address, b"WPHB" + struct.pack("<HHI", 3, 0, 5) + b"\xc1" * 5
        )
        # header then half the payload, then silence (the socket stays open)
        half = prefix + p[0].numpy().tobytes()[:10]
        acks["stalled"] = await anyio.to_thread.run_sync(raw_exchange, address, half, False)
        # header then half the payload, then the sender closes
        acks["closed"] = await anyio.to_thread.run_sync(raw_exchange, address, half)
        acks["good"] = await send_band(address, h, p)
        return acks, await receiver.wait("r1", 5)

    acks, handoff = run_with(receiver, client)
    assert acks["garbage"].error.startswith("unknown magic b'\\x00\\x00\\x00\\x00'")
    assert acks["version"].error == "wire version 9 is not supported (this side speaks 3)"
    assert acks["junk header"].error.startswith("band header does not decode")
    assert acks["stalled"] == Ack("r1", 0, False, "the sender stopped sending mid-band")
    assert acks["closed"] == Ack("r1", 0, False, "the sender went away mid-band")
    assert acks["good"].ok and handoff.num_tokens == T
    assert receiver.counts["bands_broken"] == 2 and receiver.held_bytes == 0


def test_incomplete_requests_expire_and_wait_says_why():
    receiver = Receiver(KIMI, "float32", request_timeout_s=0.4)
    (h0, p0), _ = bands()

    async def client(address):
        assert (await send_band(address, h0, p0)).ok
        assert receiver.pending() == {"r1": ([0], 2)} and receiver.held_bytes > 0
        with pytest.raises(TimeoutError, match=r"'r1': stages \[0\] of 2 arrived in 0.1 s"):
            await receiver.wait("r1", 0.1)
        with pytest.raises(HandoffError, match=r"expired: stages \[0\] of 2 arrived in 0.4 s"):
            await receiver.wait("r1", 10)
        return receiver.held_bytes

    assert run_with(receiver, client) == 0
    assert receiver.pending() == {} and receiver.counts["requests_expired"] == 1


def test_held_bytes_are_bounded():
    (h0, p0), (h1, p1) = bands()
    (g0, q0), _ = bands("r2")
    receiver = Receiver(KIMI, "float32", max_held_bytes=band_bytes(h0) + band_bytes(h1))

    async def client(address):
        return [await send_band(address, *band) for band in ((h0, p0), (g0, q0), (h1, p1))]

    first, over, last = run_with(receiver, client)
    assert first.ok and last.ok
    assert over.error.startswith("receiver holds ") and "exceeds max_held_bytes" in over.error


def test_the_library_imports_nothing_of_the_runtime():
    import subprocess
    import sys

    code = (
        "import json, sys, wavepp.handoff.receive, wavepp.handoff.client, wavepp.handoff.hf\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('wavepp'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout)
    assert not [m for m in loaded if not m.startswith("wavepp.handoff") and m != "wavepp"]
    assert "wavepp.handoff.hf" in loaded


def segment_exchange(address: Address, prefix: bytes, payload, header, then: str):
    """Offer a segment (a Unix socket, or TCP), then: ``write`` the payload into the lent
    memfd and say done, answer ``garbage`` instead, or ``hang up``. Returns (the size
    lent, the ack or None)."""
    if address.kind == "unix":
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(address.path)
    else:
        sock = socket.create_connection((address.host, address.port))
    sock.settimeout(20)
    with sock:
        sock.sendall(prefix)
        size, _, fd = _segment_answer(sock, SEGMENT_MAGIC)
        if size == 0:  # declined: the payload on the socket
            for tensor in payload:
                sock.sendall(tensor.reshape(-1).view(torch.uint8).numpy())
        else:
            _write(fd, header, payload)
            os.close(fd)
            if then == "hang up":
                return size, None
            sock.sendall(DONE_MAGIC if then == "write" else b"WPHX")
        return size, _ack(sock)


@pytest.mark.parametrize("kind", ["unix", "tcp"])
def test_a_band_offered_into_a_segment_is_lent_one_over_unix_sockets_only(kind):
    """Over a Unix socket the receiver lends a memfd and the band's tensors are views of
    it; over TCP (or with ``lend_segments`` off) it declines and reads the socket."""
    ((h, p),) = bands(split=((0, 1, 2, 3),))
    offer = encode_band_prefix(h, FLAG_SEGMENT)
    results = {}
    for lend in (True, False):
        receiver = Receiver(KIMI, "float32", lend_segments=lend)
        where = Address("tcp", host="127.0.0.1", port=0) if kind == "tcp" else None

        async def client(address, receiver=receiver):
            size, ack = await anyio.to_thread.run_sync(segment_exchange, address, offer, p, h,
                                                       "write")  # fmt: skip
            return size, ack, await receiver.wait("r1", 5), receiver._buffers.num_segments

        results[lend] = run_with(receiver, client, where)
    for lend, (size, ack, handoff, segments) in results.items():
        lent = lend and kind == "unix"
        assert (size > 0, segments) == (lent, int(lent)) and ack.ok
        assert torch.equal(handoff.tokens, p[0].to(torch.int64))
        for spec, tensor in zip(h.tensors[1:], p[1:], strict=True):
            assert torch.equal(handoff.layers[spec.layer][spec.name], tensor)


def test_a_sender_that_breaks_its_segment_exchange_costs_only_its_band():
    """Garbage where ``WPHD`` belongs is refused; a hang-up before it is a broken band;
    either way the claim is released, the segment is closed rather than lent again (its
    sender may still write into it), and the same band offered again is taken."""
    ((h, p),) = bands(split=((0, 1, 2, 3),))
    offer = encode_band_prefix(h, FLAG_SEGMENT)
    receiver = Receiver(KIMI, "float32")

    async def client(address):
        out = {}
        for then in ("garbage", "hang up", "write"):
            out[then] = await anyio.to_thread.run_sync(segment_exchange, address, offer, p, h,
                                                       then)  # fmt: skip
            await anyio.sleep(0.05)  # the receiver has seen the hang-up
            out[then + " held"] = receiver.held_bytes
            receiver._buffers.tidy()
            out[then + " segments"] = receiver._buffers.num_segments
        return out, await receiver.wait("r1", 5)

    out, handoff = run_with(receiver, client)
    assert out["garbage"][1] == Ack("r1", 0, False,
                                    "expected b'WPHD' after the segment's payload, got b'WPHX'")
    assert out["hang up"][1] is None and out["garbage held"] == out["hang up held"] == 0
    assert out["garbage segments"] == out["hang up segments"] == 0
    assert out["write segments"] == 1  # taken: its tensors are the handoff's
    assert out["write"][1].ok and handoff.num_tokens == T
    assert receiver.counts["bands_refused"] == receiver.counts["bands_broken"] == 1


# -- reservations: a segment for the sender's next band ----------------------------------


def _segment_answer(sock: socket.socket, magic: bytes) -> tuple[int, int, int | None]:
    """(size, segment id, the passed memfd or None) of a segment answer or reservation."""
    import array

    answer, ancillary, _, _ = sock.recvmsg(SEGMENT_BYTES, socket.CMSG_SPACE(16))
    fds = array.array("i")
    for _, _, data in ancillary:
        fds.frombytes(data)
    size, segment_id = parse_segment(answer, magic)
    return size, segment_id, (fds[0] if fds else None)


def _ack(sock: socket.socket) -> Ack:
    buf = b""
    while chunk := sock.recv(65536):
        buf += chunk
    return decode_ack(buf[ACK_PREFIX_BYTES : ACK_PREFIX_BYTES + ack_length(buf[:8])])


def _write(fd: int, header, payload) -> None:
    offsets, _ = payload_layout(header)
    for tensor, at in zip(payload, offsets, strict=True):
        os.pwrite(fd, tensor.reshape(-1).view(torch.uint8).numpy(), at)


def reserved_exchange(address: Address, steps: list) -> list:
    """Bands in turn from this process, each ``(header, payload, how)``: ``offer`` (a
    segment offer that asks for a reservation), ``named`` (written into the last
    reservation before connecting, then named), ``named again`` (the same reservation
    named, nothing written: it holds the band before), ``named garbage`` (written and
    named, then garbage where ``WPHD`` belongs). Returns what each band got back."""
    reservation = None
    out = []
    for header, payload, how in steps:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(20)
            sock.connect(address.path)
            if how == "offer":
                sock.sendall(encode_band_prefix(header, FLAG_SEGMENT | FLAG_RESERVE))
                size, _, fd = _segment_answer(sock, SEGMENT_MAGIC)
                _write(fd, header, payload)
                os.close(fd)
                reservation = _segment_answer(sock, RESERVE_MAGIC)
                sock.sendall(DONE_MAGIC)
                out.append(("lent", size, _ack(sock)))
                continue
            size, segment_id, fd = reservation
            if how != "named again":
                _write(fd, header, payload)
            sock.sendall(encode_band_prefix(header, FLAG_RESERVED, segment_id))
            sock.sendall(b"WPHX" if how == "named garbage" else DONE_MAGIC)
            first = sock.recv(4, socket.MSG_PEEK)
            if first == SEGMENT_MAGIC:  # not held: the payload on the socket
                assert _segment_answer(sock, SEGMENT_MAGIC)[:2] == (0, 0)
                for tensor in payload:
                    sock.sendall(tensor.reshape(-1).view(torch.uint8).numpy())
                out.append(("declined", 0, _ack(sock)))
            else:
                out.append(("named", size, _ack(sock)))
    return out, reservation


def test_a_band_written_into_its_reserved_segment_is_taken_with_one_answer():
    """The first band offers a segment and asks for a reservation: lent one, then a
    second reserved. The next band is written into the reserved one before it connects
    and names it: its only answer is the ack, its tensors are views of that memory. The
    same reservation named again is not held any more: size 0, the payload on the
    socket. Garbage where ``WPHD`` belongs refuses the band and closes its segment."""
    steps, payloads = [], {}
    for n, how in enumerate(("offer", "named", "named again", "offer", "named garbage")):
        ((h, p),) = bands(rid=f"r{n}", split=((0, 1, 2, 3),), seed=n)
        steps.append((h, p, how))
        payloads[f"r{n}"] = (h, p)
    receiver = Receiver(KIMI, "float32")

    async def client(address):
        out, (_, _, fd) = await anyio.to_thread.run_sync(reserved_exchange, address, steps)
        os.close(fd)
        handoffs = {rid: await receiver.wait(rid, 5) for rid in ("r0", "r1", "r2", "r3")}
        await anyio.sleep(0.05)  # the receiver is done with the refused band
        gc.collect()  # its tensors, held by its traceback's frames
        receiver._buffers.tidy()
        return out, handoffs, receiver._buffers.num_segments

    out, handoffs, segments = run_with(receiver, client)
    assert [(how, size > 0, ack.ok) for how, size, ack in out] == [
        ("lent", True, True), ("named", True, True), ("declined", False, True),
        ("lent", True, True), ("named", True, False)]  # fmt: skip
    assert out[-1][2].error == "expected b'WPHD' after the segment's payload, got b'WPHX'"
    for rid, handoff in handoffs.items():
        header, payload = payloads[rid]
        assert torch.equal(handoff.tokens, payload[0].to(torch.int64))
        for spec, tensor in zip(header.tensors[1:], payload[1:], strict=True):
            assert torch.equal(handoff.layers[spec.layer][spec.name], tensor)
    counts = receiver.counts
    assert (counts["segments_reserved"], counts["reservations_used"],
            counts["reservations_missed"]) == (2, 2, 1)  # fmt: skip
    # held by r0, r1, r3; the garbage band's closed, never lent again
    assert segments == 3


def test_a_reservation_is_its_peers_only_and_closed_once_it_lapses():
    ((h, p),) = bands(split=((0, 1, 2, 3),))
    receiver = Receiver(KIMI, "float32")

    async def client(address):
        def ask():
            with socket.socket(socket.AF_UNIX) as sock:
                sock.settimeout(20)
                sock.connect(address.path)
                sock.sendall(encode_band_prefix(h, FLAG_SEGMENT | FLAG_RESERVE))
                _, _, fd = _segment_answer(sock, SEGMENT_MAGIC)
                _write(fd, h, p)
                os.close(fd)
                _, segment_id, fd = _segment_answer(sock, RESERVE_MAGIC)
                os.close(fd)
                sock.sendall(DONE_MAGIC)
                return segment_id, _ack(sock)

        segment_id, ack = await anyio.to_thread.run_sync(ask)
        assert ack.ok
        await receiver.wait("r1", 5)  # and dropped: its segment is free again
        mine = receiver._lender._reserved[segment_id].peer
        assert receiver._lender._unreserve(segment_id, ("someone", "else")) is None
        assert receiver._lender._unreserve(segment_id, None) is None
        kept = segment_id in receiver._lender._reserved
        receiver.expire(now=time.monotonic() + RESERVATION_S + 1)
        gc.collect()
        receiver._buffers.tidy()
        return mine, kept, segment_id in receiver._lender._reserved, receiver._buffers.num_segments

    mine, kept, still, segments = run_with(receiver, client)
    assert mine == (os.getpid(), _io.process_start(os.getpid()))
    assert kept and not still
    assert segments == 1  # the band's, free and kept; the lapsed reservation's closed
    assert receiver.counts["reservations_expired"] == 1
