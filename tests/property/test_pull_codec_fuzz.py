"""Untrusted bytes on a band server: whatever a decoder sends as its pull frame, reading
it gives a valid ``Pull`` or a ``WireError`` — never another exception, a hang, or an
allocation beyond the frame's bound."""

from __future__ import annotations

import struct
import tracemalloc

import hypothesis.strategies as st
import msgspec
from hypothesis import HealthCheck, given, settings

from wavepp.handoff import wire

FP = wire.Fingerprint(architecture="LlamaForCausalLM", num_layers=2, hidden_size=8,
                      vocab_size=64, layer_kinds="AA", num_heads=2, num_kv_heads=1,
                      head_dim=4, kv_lora_rank=0, rope_dim=0, dtype="float32")  # fmt: skip
VALID = [wire.encode_pull(wire.Pull("r-1", 0, FP)),
         wire.encode_pull(wire.Pull("x" * 128, 4095, FP, auth="token"))]  # fmt: skip
FUZZ = settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PEAK_BYTES = 4 * wire.MAX_PULL_BYTES


def read_frame(raw: bytes) -> wire.Pull | None:
    """What a band server does with the bytes: the prefix checked first, then only the
    length it allows decoded. None when refused (a WireError)."""
    tracemalloc.start()
    try:
        try:
            length = wire.pull_length(raw[: wire.PULL_PREFIX_BYTES])
            return wire.decode_pull(raw[wire.PULL_PREFIX_BYTES :][:length])
        except wire.WireError:
            return None
        finally:
            _, peak = tracemalloc.get_traced_memory()
            assert peak < PEAK_BYTES + len(raw), f"reading a pull peaked at {peak} bytes"
    finally:
        tracemalloc.stop()


@FUZZ
@given(st.binary(max_size=2048))
def test_arbitrary_bytes(raw):
    read_frame(raw)
    read_frame(b"WPHP" + struct.pack("<HHI", 1, 0, len(raw)) + raw)


@st.composite
def mutated(draw):
    raw = bytearray(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "cut", "insert"]))
        at = draw(st.integers(0, max(len(raw) - 1, 0)))
        if op == "flip" and raw:
            raw[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "cut":
            raw = raw[:at]
        else:
            raw[at:at] = draw(st.binary(min_size=1, max_size=16))
    return bytes(raw)


@FUZZ
@given(mutated())
def test_mutated_valid_frames(raw):
    pull = read_frame(raw)
    assert pull is None or isinstance(pull, wire.Pull)


values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner,
                                                                max_size=5),
    max_leaves=20,
)  # fmt: skip


@settings(max_examples=1000, deadline=None)
@given(st.dictionaries(st.sampled_from(["request_id", "stage", "fingerprint", "auth", "other"]),
                       values, max_size=5))  # fmt: skip
def test_wrong_types_and_fields(fields):
    body = msgspec.json.encode(fields)
    read_frame(b"WPHP" + struct.pack("<HHI", 1, 0, len(body)) + body)


def test_a_frame_claiming_more_than_the_bound_is_refused_before_reading():
    assert read_frame(b"WPHP" + struct.pack("<HHI", 1, 0, 2**32 - 1)) is None
