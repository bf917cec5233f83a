"""Untrusted bytes (DESIGN §9): whatever a peer sends, decoding gives a valid message of
the expected type or a CodecError — never another exception, a hang, or a huge
allocation."""

import contextlib
import struct
import time

import hypothesis.strategies as st
import msgspec
from hypothesis import HealthCheck, given, settings

from wavepp.rounds.messages import (
    AdmitEntry,
    AdmitRound,
    Cancel,
    ChunkMsg,
    CodecError,
    DataMessage,
    Finished,
    Heartbeat,
    OracleAdmit,
    RoundMessage,
    StageReport,
    Stop,
    WaveDone,
    WaveMsg,
    decode_untrusted,
    encode,
    pack_hashes,
)

KINDS = [RoundMessage, DataMessage, WaveMsg, WaveDone, StageReport]
CASES = {"count": 0}

VALID = [
    AdmitRound(1, [AdmitEntry("r-1", 300, pack_hashes((1, 2, 3, 2**64 - 1)), 4)]),
    Cancel(2, ["a", "b"]),
    Heartbeat(3),
    Stop(4, "done"),
    WaveMsg(5, 4096, [ChunkMsg("r-1", 0, 300, 300, False)],
            [OracleAdmit(AdmitEntry("r-2", 64, pack_hashes((7,)), 0), 1)], cancels=["x"]),
    WaveDone(5, [Finished("r-1", 256, 17, 3.5)], cancelled=["x"]),
    StageReport(0, 1.0, 2.0, 3.0, 4, [1.5], 0, 0, 0, 0, 10, 6, 16, True),
]  # fmt: skip
ENCODED = [encode(m) for m in VALID]


def check(raw: bytes) -> None:
    CASES["count"] += 1
    for kind in KINDS:
        start = time.perf_counter()
        with contextlib.suppress(CodecError):
            decode_untrusted(raw, kind)
        # A hang guard, not a speed bound: a decoder that loops or allocates wildly on
        # junk takes seconds or forever; one busy neighbour process must not fail this.
        assert time.perf_counter() - start < 10.0, "decoding must never hang"


FUZZ = settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.binary(max_size=2048))
def test_arbitrary_bytes(raw):
    check(raw)


@st.composite
def mutated(draw):
    raw = bytearray(draw(st.sampled_from(ENCODED)))
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "splice"]))
        at = draw(st.integers(0, max(len(raw) - 1, 0)))
        if op == "flip" and raw:
            raw[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "cut":
            raw = raw[:at]
        elif op == "insert":
            raw[at:at] = draw(st.binary(min_size=1, max_size=16))
        else:
            other = draw(st.sampled_from(ENCODED))
            raw = raw[:at] + other[draw(st.integers(0, len(other))) :]
    return bytes(raw)


@FUZZ
@given(mutated())
def test_mutated_valid_messages(raw):
    check(raw)


values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=5)
    | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20,
)  # fmt: skip
tags = st.sampled_from(["AdmitRound", "Cancel", "Heartbeat", "Stop", "WaveMsg", "WaveDone",
                        "StageReport", "Nope"])  # fmt: skip


@settings(max_examples=1000, deadline=None)
@given(tags, st.dictionaries(st.sampled_from(
    ["round_id", "entries", "request_ids", "wave_id", "budget", "chunks", "finished",
     "reason", "stage", "busy_s", "hashes", "num_tokens", "cancels", "oracle"]), values,
    max_size=6))  # fmt: skip
def test_wrong_types_and_fields(tag, fields):
    check(msgspec.msgpack.encode({"type": tag, **fields}))


def test_huge_length_claims_fail_without_allocating():
    claims = [
        b"\xdd" + struct.pack(">I", 2**32 - 1),  # array of 4G items
        b"\xc6" + struct.pack(">I", 2**32 - 1) + b"x",  # bin of 4 GB
        b"\xdf" + struct.pack(">I", 2**32 - 1),  # map of 4G pairs
        msgspec.msgpack.encode({"type": "AdmitRound", "round_id": 1})[:-1]
        + b"\xdd\xff\xff\xff\xff",
    ]  # fmt: skip
    for raw in claims:
        check(raw)
    too_long = msgspec.msgpack.encode(
        {"type": "Cancel", "round_id": 1, "request_ids": ["a"] * 70_000}
    )
    try:
        decode_untrusted(too_long, RoundMessage)
        raise AssertionError("a list over its bound decoded")
    except CodecError:
        pass


@settings(max_examples=500, deadline=None)
@given(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=0, max_size=10))
def test_data_plane_headers_are_checked_before_allocating(header):
    from wavepp.exec.planes import MAX_TENSOR_BYTES, PlaneError, parse_header

    CASES["count"] += 1
    try:
        size, dtype, shape = parse_header(header, 1 << 20, MAX_TENSOR_BYTES)
    except PlaneError:
        return
    assert 0 < size <= 1 << 20
    if dtype is not None:
        numel = 1
        for d in shape:
            numel *= d
        assert all(d >= 0 for d in shape) and numel * dtype.itemsize <= MAX_TENSOR_BYTES


def test_report_the_number_of_cases(capsys):
    # Passes alone too: it runs one fuzz test itself when the others have not run yet.
    if CASES["count"] == 0:
        test_arbitrary_bytes()
    with capsys.disabled():
        print(f"\ncodec fuzz cases run in this module: {CASES['count']}")
    assert CASES["count"] >= 1500
