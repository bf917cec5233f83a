"""The handoff receiver over real sockets: bands assembled into a Handoff, each refusal
acked with its reason, broken senders costing only their band, bounded memory."""

from __future__ import annotations

import json
import socket
import struct
import tempfile

import anyio
import msgspec
import pytest
import torch

from wavepp.handoff.assembly import HandoffError
from wavepp.handoff.client import build_band, send_band
from wavepp.handoff.receive import Receiver
from wavepp.handoff.wire import (
    ACK_PREFIX_BYTES,
    Ack,
    Address,
    ack_length,
    band_bytes,
    decode_ack,
    encode_band_prefix,
    expected_tensors,
    fingerprint_from_hf_config,
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
    # the dtype table, the id rule and the signatures
    leaves = {"wavepp", "wavepp.dtypes", "wavepp.ids", "wavepp.signing"}
    assert not [m for m in loaded if not m.startswith("wavepp.handoff") and m not in leaves]
    assert "wavepp.handoff.hf" in loaded
