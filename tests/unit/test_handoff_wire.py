"""The handoff wire format (``wavepp.handoff.wire``): round trips, each check refusing
with a message that names the problem, and untrusted bytes that only ever give a
``WireError`` within the stated bounds."""

from __future__ import annotations

import contextlib
import math
import struct
import tracemalloc

import hypothesis.strategies as st
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings

from wavepp.handoff import wire
from wavepp.handoff.wire import (
    ACK_PREFIX_BYTES,
    ALIGN,
    MAX_HEADER_BYTES,
    PREFIX_BYTES,
    Ack,
    Address,
    BandHeader,
    TensorSpec,
    WireError,
    ack_length,
    band_bytes,
    decode_ack,
    decode_header,
    encode_ack,
    encode_band_prefix,
    expected_tensors,
    fingerprint_from_hf_config,
    header_length,
    parse_address,
    payload_layout,
)
from wavepp.model import config_from_hf
from wavepp.model.linear import GatedDeltaNet, KimiDeltaAttention

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 3,
    "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
    "intermediate_size": 96,
}  # fmt: skip
KIMI = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
    "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 300,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "kv_lora_rank": 32,
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "linear_num_heads": 4,
    "linear_head_dim": 16, "linear_conv_kernel_dim": 4, "intermediate_size": 96,
    "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_token": 2,
}  # fmt: skip
QWEN = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
    "num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300,
    "layer_types": ["linear_attention", "linear_attention", "full_attention"],
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "intermediate_size": 96,
}  # fmt: skip
MINIMAX = {
    "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2",
    "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300, "intermediate_size": 32,
    "num_local_experts": 8, "num_experts_per_tok": 2,
}  # fmt: skip


def band(config=LLAMA, stage=0, num_stages=1, layers=(0, 1, 2), t=5, dtype="float32"):
    """A valid header holding the given layers, as a sender builds it."""
    fp = fingerprint_from_hf_config(config, dtype)
    tensors = []
    for layer in ([-1] if stage == 0 else []) + list(layers):
        for name, (kind, shape) in expected_tensors(config, dtype, layer, t).items():
            nbytes = wire.DTYPES[kind] * math.prod(shape)
            tensors.append(TensorSpec(layer, name, kind, list(shape), nbytes))
    last = stage == num_stages - 1
    return BandHeader(
        request_id="req-1", stage=stage, num_stages=num_stages, fingerprint=fp,
        layers=list(layers), num_tokens=t, tensors=tensors,
        first_token=7 if last else -1, top_logit=1.5 if last else 0.0,
    )  # fmt: skip


def refused(header: BandHeader, match: str) -> None:
    raw = msgspec.msgpack.encode(header)
    with pytest.raises(WireError, match=match):
        decode_header(raw)
    with pytest.raises(WireError, match=match):
        encode_band_prefix(header)


# -- round trips ---------------------------------------------------------------------


@pytest.mark.parametrize("config", [LLAMA, KIMI, QWEN, MINIMAX])
def test_band_round_trip(config):
    n = config["num_hidden_layers"]
    header = band(config, stage=1, num_stages=2, layers=tuple(range(1, n)), t=9)
    prefix = encode_band_prefix(header)
    assert prefix[:4] == b"WPHB"
    assert struct.unpack("<HHI", prefix[4:12]) == (3, 0, len(prefix) - PREFIX_BYTES)
    assert header_length(prefix[:PREFIX_BYTES]) == len(prefix) - PREFIX_BYTES
    assert decode_header(prefix[PREFIX_BYTES:]) == header
    assert band_bytes(header) == sum(s.nbytes for s in header.tensors) > 0


def test_ack_round_trip_and_long_error_cut():
    ack = Ack("req-1", 2, False, "x" * 10_000)
    raw = encode_ack(ack)
    assert raw[:4] == b"WPHA"
    length = ack_length(raw[:ACK_PREFIX_BYTES])
    assert length == len(raw) - ACK_PREFIX_BYTES
    back = decode_ack(raw[ACK_PREFIX_BYTES:])
    assert (back.request_id, back.stage, back.ok) == ("req-1", 2, False)
    assert len(back.error) == 4096 and back.error.endswith("...")
    assert decode_ack(encode_ack(Ack("", -1, True))[ACK_PREFIX_BYTES:]) == Ack("", -1, True, "")


# -- the prefix and ack prefix -------------------------------------------------------


@pytest.mark.parametrize(
    ("prefix", "match"),
    [
        (b"WPHX" + struct.pack("<HHI", 3, 0, 10), "magic"),
        (b"WPHB" + struct.pack("<HHI", 4, 0, 10), r"version 4 is not supported \(.* speaks 3\)"),
        (b"WPHB" + struct.pack("<HHI", 1, 0, 10), "version 1 is not supported"),
        (b"WPHB" + struct.pack("<HHI", 2, 1, 10), "version 2 is not supported"),
        (b"WPHB" + struct.pack("<HHI", 3, 1, 10), r"unknown band flags 0x1 \(version 3 has none\)"),
        (b"WPHB" + struct.pack("<HHI", 3, 8, 10), "unknown band flags 0x8"),
        (b"WPHB" + struct.pack("<HHI", 3, 0, 0), "header_len 0"),
        (b"WPHB" + struct.pack("<HHI", 3, 0, MAX_HEADER_BYTES + 1), "header_len"),
        (b"WPHB", "prefix is 4 bytes"),
    ],
)
def test_prefix_checks(prefix, match):
    with pytest.raises(WireError, match=match):
        header_length(prefix)


def test_payload_layout_aligns_every_tensor():
    header = band(KIMI, stage=0, num_stages=1, layers=tuple(range(KIMI["num_hidden_layers"])),
                  t=7)  # fmt: skip
    offsets, size = payload_layout(header)
    ends = [at + spec.nbytes for at, spec in zip(offsets, header.tensors, strict=True)]
    assert all(at % ALIGN == 0 for at in offsets)
    assert all(end <= nxt for end, nxt in zip(ends, offsets[1:], strict=False))
    assert size % ALIGN == 0 and ends[-1] <= size < ends[-1] + ALIGN


@pytest.mark.parametrize(
    ("prefix", "match"),
    [
        (b"WPHB" + struct.pack("<I", 10), "magic"),
        (b"WPHA" + struct.pack("<I", 0), "ack_len 0"),
        (b"WPHA" + struct.pack("<I", 65537), "ack_len 65537"),
    ],
)
def test_ack_prefix_checks(prefix, match):
    with pytest.raises(WireError, match=match):
        ack_length(prefix)


def test_ack_garbage_is_refused():
    with pytest.raises(WireError, match="ack does not decode"):
        decode_ack(b"\x93\x01\x02")
    with pytest.raises(WireError, match="ack does not decode"):
        decode_ack(msgspec.msgpack.encode({"request_id": "r", "stage": 0, "ok": True, "x": 1}))


# -- header checks -------------------------------------------------------------------


def with_tensor(header: BandHeader, i: int, **changes) -> BandHeader:
    tensors = list(header.tensors)
    tensors[i] = msgspec.structs.replace(tensors[i], **changes)
    return msgspec.structs.replace(header, tensors=tensors)


def test_header_consistency_checks():
    good = band()
    fp = good.fingerprint
    refused(
        with_tensor(good, 1, nbytes=good.tensors[1].nbytes + 4),
        "nbytes 644 but shape \\[5, 2, 16\\] of float32 is 640 bytes",
    )
    refused(with_tensor(good, 1, dtype="float64"), "dtype 'float64' is not one of")
    refused(with_tensor(good, 1, shape=[]), "does not decode.*shape")
    refused(with_tensor(good, 1, shape=[1] * 9, nbytes=4), "does not decode.*shape")
    refused(with_tensor(good, 1, shape=[2**31 + 1], nbytes=4), "does not decode")
    refused(with_tensor(good, 2, name="k"), "tensor 'k' of layer 0 appears twice")
    refused(with_tensor(good, 1, layer=5), "layers \\[0, 1, 2\\] do not include it")
    refused(msgspec.structs.replace(good, layers=[0, 2, 1]), "not strictly ascending: 2 then 1")
    refused(msgspec.structs.replace(good, layers=[0, 0, 1]), "not strictly ascending")
    refused(msgspec.structs.replace(good, layers=[0, 1, 3]), "layer 3 is outside the model's 3")
    refused(msgspec.structs.replace(good, stage=1), "stage 1 is not below num_stages 1")
    refused(msgspec.structs.replace(good, first_token=-1), "carries no first_token")
    mid = band(stage=0, num_stages=2, layers=(0,))
    refused(msgspec.structs.replace(mid, first_token=3), "only the last stage")
    refused(msgspec.structs.replace(good, request_id=""), "does not decode.*request_id")
    # wavepp.ids.MAX_ID_CHARS + 1
    refused(msgspec.structs.replace(good, request_id="r" * 129), "does not decode")
    refused(msgspec.structs.replace(good, num_tokens=0), "does not decode.*num_tokens")
    bad_fp = msgspec.structs.replace(fp, dtype="int8")
    refused(msgspec.structs.replace(good, fingerprint=bad_fp), "fingerprint dtype 'int8'")
    bad_fp = msgspec.structs.replace(fp, layer_kinds="AA")
    refused(msgspec.structs.replace(good, fingerprint=bad_fp), "3 layers but 2 layer kinds")
    bad_fp = msgspec.structs.replace(fp, layer_kinds="AXA")
    refused(msgspec.structs.replace(good, fingerprint=bad_fp), "letters outside")


def test_unknown_fields_and_wrong_types_are_refused():
    raw = msgspec.msgpack.encode({**msgspec.structs.asdict(band()), "extra": 1})
    with pytest.raises(WireError, match=r"does not decode.*extra"):
        decode_header(raw)
    with pytest.raises(WireError, match="does not decode"):
        decode_header(b"\xc1")
    with pytest.raises(WireError, match="exceeds"):
        decode_header(b"\x00" * (MAX_HEADER_BYTES + 1))


# -- addresses -----------------------------------------------------------------------


def test_addresses():
    assert parse_address("unix:/tmp/x.sock") == Address("unix", path="/tmp/x.sock")
    with pytest.raises(ValueError, match="accepted forms"):
        parse_address("dir:/data/out")  # a folder layout no longer ships
    assert parse_address("tcp://127.0.0.1:9000") == Address("tcp", host="127.0.0.1", port=9000)
    assert parse_address("tcp://decode-1.local:1") == Address("tcp", host="decode-1.local", port=1)
    v6 = parse_address("tcp://[::1]:65535")
    assert v6 == Address("tcp", host="::1", port=65535)
    for text in ("unix:/tmp/x.sock", "tcp://h:2", "tcp://[fe80::1]:80"):
        assert str(parse_address(text)) == text


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("unix:relative", "absolute"),
        ("unix:/" + "a" * 107, "at most 107 bytes"),
        ("tcp://host", "no :PORT"),
        ("tcp://host:0", "port 0 outside"),
        ("tcp://host:70000", "port 70000 outside"),
        ("tcp://[nothex]:80", "not an IPv6"),
        ("tcp://::1:80", "IPv6 goes in"),
        ("tcp://bad host:80", "not a name"),
        ("http://x:1", "unknown form"),
        ("", "unknown form"),
    ],
)
def test_bad_addresses(text, match):
    with pytest.raises(ValueError, match=match) as info:
        parse_address(text)
    assert repr(text) in str(info.value) and "tcp://HOST:PORT" in str(info.value)


# -- fingerprints and expected tensors -----------------------------------------------


def test_fingerprints():
    fp = fingerprint_from_hf_config(LLAMA, "bfloat16")
    assert (fp.architecture, fp.layer_kinds, fp.num_heads, fp.num_kv_heads, fp.head_dim) == (
        "LlamaForCausalLM", "AAA", 4, 2, 16)  # fmt: skip
    fp = fingerprint_from_hf_config(KIMI, "float32")
    assert (fp.layer_kinds, fp.num_kv_heads, fp.head_dim, fp.kv_lora_rank, fp.rope_dim) == (
        "LMLM", 0, 0, 32, 8)  # fmt: skip
    assert fingerprint_from_hf_config(QWEN, "float32").layer_kinds == "LLA"
    assert fingerprint_from_hf_config(MINIMAX, "float16").layer_kinds == "AA"
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        fingerprint_from_hf_config({"model_type": "gpt2"}, "float32")
    with pytest.raises(ValueError, match="dtype 'int32'"):
        fingerprint_from_hf_config(LLAMA, "int32")


def test_kimi_checkpoint_layer_lists():
    """Kimi's own config.json names layers in linear_attn_config (1-indexed)."""
    config = {k: v for k, v in KIMI.items() if k != "layer_types"}
    config["linear_attn_config"] = {"kda_layers": [1, 3], "full_attn_layers": [2, 4],
                                    "num_heads": 4, "head_dim": 16}  # fmt: skip
    assert fingerprint_from_hf_config(config, "float32").layer_kinds == "LMLM"


def test_expected_tensors_match_wavepp_layers():
    assert expected_tensors(LLAMA, "float16", 2, 7) == {
        "k": ("float16", (7, 2, 16)), "v": ("float16", (7, 2, 16))}  # fmt: skip
    assert expected_tensors(KIMI, "float32", 1, 7) == {"latent": ("float32", (7, 1, 40))}
    assert expected_tensors(KIMI, "bfloat16", -1, 7) == {"tokens": ("int32", (7,))}
    # the recurrent states are exactly what WavePP's own layers hold
    cfg = config_from_hf(KIMI)
    kda = KimiDeltaAttention(64, cfg.linear_heads, cfg.linear_k_dim, cfg.conv_kernel, 1e-5)
    got = expected_tensors(KIMI, "bfloat16", 0, 7)
    assert {k: v[1] for k, v in got.items()} == kda.state_shapes()
    assert {v[0] for v in got.values()} == {"float32"}
    cfg = config_from_hf(QWEN)
    gdn = GatedDeltaNet(64, cfg.linear_k_heads, cfg.linear_heads, cfg.linear_k_dim,
                        cfg.linear_v_dim, cfg.conv_kernel, 1e-6)  # fmt: skip
    got = expected_tensors(QWEN, "float32", 1, 7)
    assert {k: v[1] for k, v in got.items()} == gdn.state_shapes() == {
        "delta": (4, 16, 8), "conv": (3, 96)}  # fmt: skip
    assert expected_tensors(QWEN, "float32", 2, 3)["k"] == ("float32", (3, 2, 16))
    with pytest.raises(ValueError, match="layer 3 is outside"):
        expected_tensors(QWEN, "float32", 3, 3)
    # a fingerprint passed in (a receiver's own) gives the same answer for every layer
    for config, dtype in ((LLAMA, "float16"), (KIMI, "bfloat16"), (QWEN, "float32")):
        fp = fingerprint_from_hf_config(config, dtype)
        for layer in range(-1, fp.num_layers):
            assert expected_tensors(config, dtype, layer, 5, fp) == expected_tensors(
                config, dtype, layer, 5)


def test_transformers_configs_fingerprint():
    transformers = pytest.importorskip("transformers")
    from tests.helpers.families import kimi_config, minimax_config, qwen_config

    assert fingerprint_from_hf_config(kimi_config().to_dict(), "float32").layer_kinds == "LLMLM"
    assert fingerprint_from_hf_config(qwen_config().to_dict(), "float32").layer_kinds == "LLALA"
    fp = fingerprint_from_hf_config(minimax_config().to_dict(), "float32")
    assert (fp.architecture, fp.num_kv_heads, fp.head_dim) == ("MiniMaxM2ForCausalLM", 2, 16)
    llama = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4)
    assert fingerprint_from_hf_config(llama.to_dict(), "float32").head_dim == 8


# -- untrusted bytes -----------------------------------------------------------------

FUZZ = settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
VALID = [
    encode_band_prefix(band(c, layers=tuple(range(c["num_hidden_layers"]))))
    for c in (LLAMA, KIMI, QWEN, MINIMAX)
]
PEAK_BYTES = 64 << 20  # whatever the input, decoding never holds more than this


def decode_all(raw: bytes) -> None:
    """Every decoder on raw: a value or WireError, nothing else, within PEAK_BYTES."""
    tracemalloc.start()
    try:
        for fn, cut in ((header_length, PREFIX_BYTES), (ack_length, ACK_PREFIX_BYTES)):
            with contextlib.suppress(WireError):
                fn(raw[:cut])
        for fn in (decode_header, decode_ack):
            with contextlib.suppress(WireError):
                fn(raw)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < PEAK_BYTES, f"decoding {len(raw)} bytes peaked at {peak} bytes"


@FUZZ
@given(st.binary(max_size=4096))
def test_arbitrary_bytes_only_raise_wire_error(raw):
    decode_all(raw)


@FUZZ
@given(st.sampled_from(VALID), st.data())
def test_mutated_headers_only_raise_wire_error(prefix, data):
    raw = bytearray(prefix[PREFIX_BYTES:])
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        cut = data.draw(st.integers(0, len(raw)))
        raw = raw[:cut]
    decode_all(bytes(raw))


def test_huge_declared_sizes_allocate_nothing():
    """A header claiming a 2**31-element tensor decodes without allocating it (the payload
    is the receiver's to bound, by band_bytes)."""
    header = band()
    big = with_tensor(header, 1, shape=[2**31, 2**29], nbytes=2**62)
    raw = msgspec.msgpack.encode(big)
    tracemalloc.start()
    try:
        decoded = decode_header(raw)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert band_bytes(decoded) >= 2**62 and peak < 1 << 20


# -- the pull frame ---------------------------------------------------------------------

PULL_FP = fingerprint_from_hf_config(LLAMA, "float32")


def test_pull_round_trip_and_its_bytes():
    pull = wire.Pull("cmpl-7f3a-1", 1, PULL_FP)
    raw = wire.encode_pull(pull)
    body = msgspec.json.encode(pull)
    assert raw[:12] == b"WPHP" + struct.pack("<HHI", 1, 0, len(body))
    assert raw[12:] == body and body.startswith(b'{"request_id":"cmpl-7f3a-1","stage":1,')
    assert wire.pull_length(raw[:12]) == len(body)
    assert wire.decode_pull(raw[12:]) == pull
    assert wire.decode_pull(body).auth == ""


@pytest.mark.parametrize(("prefix", "match"), [
    (b"WPHB" + struct.pack("<HHI", 1, 0, 10), "bad pull magic"),
    (b"WPHP" + struct.pack("<HHI", 2, 0, 10), "pull version 2 is not supported"),
    (b"WPHP" + struct.pack("<HHI", 1, 4, 10), "unknown pull flags 0x4"),
    (b"WPHP" + struct.pack("<HHI", 1, 0, 0), "pull_len 0 outside"),
    (b"WPHP" + struct.pack("<HHI", 1, 0, (1 << 16) + 1), "pull_len 65537 outside"),
    (b"WPHP", "pull prefix is 4 bytes"),
])  # fmt: skip
def test_pull_prefix_checks(prefix, match):
    with pytest.raises(WireError, match=match):
        wire.pull_length(prefix)


@pytest.mark.parametrize(("change", "match"), [
    ({"extra": 1}, "unknown field `extra`"),
    ({"stage": "1"}, r"Expected `int`, got `str` - at `\$.stage`"),
    ({"stage": -1}, r"Expected `int` >= 0 - at `\$.stage`"),
    ({"request_id": ""}, r"length >= 1 - at `\$.request_id`"),
    ({"request_id": "x" * 129}, r"length <= 128 - at `\$.request_id`"),
    ({"fingerprint": {"architecture": "x"}}, "missing required field"),
    ({"auth": 5}, r"at `\$.auth`"),
])  # fmt: skip
def test_a_pull_decodes_strictly(change, match):
    body = msgspec.to_builtins(wire.Pull("r", 0, PULL_FP)) | change
    with pytest.raises(WireError, match=match):
        wire.decode_pull(msgspec.json.encode(body))
    with pytest.raises(WireError, match="not decode"):
        wire.decode_pull(b'{"request_id": "r", "stage": true}')
    with pytest.raises(WireError, match="exceeds"):
        wire.decode_pull(b" " * ((1 << 16) + 1))


def test_encode_pull_refuses_what_a_stage_would():
    with pytest.raises(WireError, match="exceeds 65536"):
        wire.encode_pull(wire.Pull("r", 0, PULL_FP, auth="a" * 70_000))


def test_targets_are_addresses_or_pull():
    assert wire.parse_target("pull:") == Address(kind="pull")
    assert str(wire.parse_target("pull:")) == wire.PULL_TARGET
    assert wire.parse_target("unix:/x") == parse_address("unix:/x")
    with pytest.raises(ValueError, match="port 0"):
        parse_address("tcp://h:0")
    assert parse_address("tcp://h:0", any_port=True).port == 0
    with pytest.raises(ValueError, match="unknown form"):
        wire.parse_target("pull:/x")
