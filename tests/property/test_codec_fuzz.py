"""Untrusted bytes (DESIGN §9): whatever a peer sends, decoding gives a valid message of
the expected type or a CodecError — never another exception, a hang, or a huge
allocation."""

import contextlib
import struct
import time

import hypothesis.strategies as st
import msgspec
import torch
from hypothesis import HealthCheck, given, settings

from wavepp.rounds.messages import (
    AdmitEntry,
    AdmitRound,
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
    Heartbeat(3),
    Stop(4, "done"),
    WaveMsg(5, 4096, [ChunkMsg("r-1", 0, 300, 300, False)],
            [OracleAdmit(AdmitEntry("r-2", 64, pack_hashes((7,)), 0), 1)], cancels=["x"]),
    WaveMsg(6, 64, [ChunkMsg("r-3", 64, 128, 300, False, [5, 7])]),  # junctions for waiters
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
        {"type": "AdmitRound", "round_id": 1, "entries": [
            {"request_id": "a", "num_tokens": 1, "hashes": b"", "probe_limit": 0}] * 70_000}
    )
    try:
        decode_untrusted(too_long, RoundMessage)
        raise AssertionError("a list over its bound decoded")
    except CodecError:
        pass


class PlayedPeer:
    """The real receive path (``Link.recv_blocking``) with its peer played by the test:
    the transport hands out the given header words, then bytes; every buffer the link
    allocates for the peer is recorded."""

    @staticmethod
    def link(words, limits):
        from wavepp.transport.gloo import GlooLink as Link

        class Played(Link):
            def _recv(self, tensor, group):
                self.asked.append(tensor.numel() * tensor.element_size())
                if len(self.asked) == 1:
                    tensor.copy_(torch.tensor(words, dtype=torch.int64))
                else:
                    tensor.fill_(7)

        played = Played(None, src=1, dst=2, limits=limits)
        played.asked = []
        return played


def run_limits():
    from wavepp.transport.frames import DataLimits

    return DataLimits.for_run(budget=512, width=128, dtype=torch.float32,
                              max_descriptor_bytes=1 << 16)  # fmt: skip


def check_header(words):
    from wavepp.transport.base import PlaneError

    CASES["count"] += 1
    limits = run_limits()
    link = PlayedPeer.link(words, limits)
    try:
        desc, tensor = link.recv_blocking(1 << 20)
    except PlaneError:
        assert link.asked == [80], "nothing may be allocated for a refused header"
        return
    assert 0 < len(desc) <= limits.max_descriptor_bytes
    if tensor is not None:
        assert tensor.dtype == torch.float32 and tensor.dim() == 2
        assert 0 <= tensor.shape[0] <= 512 and tensor.shape[1] == 128
    assert sum(link.asked[1:]) <= limits.max_descriptor_bytes + 512 * 128 * 4


VALID_HEADER = [0x57505044, 1, 300, 1, 2, 64, 128, 0, 0, 0]
INT64 = st.integers(-(2**63), 2**63 - 1)


@settings(max_examples=500, deadline=None)
@given(st.lists(INT64, min_size=10, max_size=10))
def test_data_plane_receive_refuses_arbitrary_headers_before_allocating(words):
    check_header(words)


@st.composite
def near_valid_headers(draw):
    words = list(VALID_HEADER)
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, 9))
        words[at] = draw(st.one_of(INT64, st.integers(-2, 1 << 20), st.sampled_from(
            [0, 1, 2, 3, 5, 6, 127, 128, 129, 511, 512, 513, 1 << 16, (1 << 16) + 1])))  # fmt: skip
    return words


@settings(max_examples=1000, deadline=None)
@given(near_valid_headers())
def test_data_plane_receive_checks_every_field_of_near_valid_headers(words):
    check_header(words)


def test_data_plane_receive_accepts_the_runs_own_shapes_only():
    from wavepp.transport.base import PlaneError

    link = PlayedPeer.link(VALID_HEADER, run_limits())
    desc, tensor = link.recv_blocking()
    assert len(desc) == 300 and tensor.shape == (64, 128) and link.asked == [80, 300, 64 * 128 * 4]
    refused = {
        "claims to come from rank 3": [0x57505044, 3, 300, 1, 2, 64, 128, 0, 0, 0],
        "bad magic": [0, 1, 300, 1, 2, 64, 128, 0, 0, 0],
        "513 rows, this link takes at most 512": [0x57505044, 1, 300, 1, 2, 513, 128, 0, 0, 0],
        "width 129, the model's is 128": [0x57505044, 1, 300, 1, 2, 64, 129, 0, 0, 0],
        "dtype code 3 is not one of this run's": [0x57505044, 1, 300, 3, 2, 64, 128, 0, 0, 0],
        "descriptor of 65537 bytes": [0x57505044, 1, 65537, 0, 0, 0, 0, 0, 0, 0],
        "3-dim tensor": [0x57505044, 1, 300, 1, 3, 64, 128, 1, 0, 0],
    }
    for reason, words in refused.items():
        link = PlayedPeer.link(words, run_limits())
        try:
            link.recv_blocking()
            raise AssertionError(f"accepted a header that should fail with {reason!r}")
        except PlaneError as error:
            assert reason in str(error), (reason, str(error))
        assert link.asked == [80]


def test_report_the_number_of_cases(capsys):
    # Passes alone too: it runs one fuzz test itself when the others have not run yet.
    if CASES["count"] == 0:
        test_arbitrary_bytes()
    with capsys.disabled():
        print(f"\ncodec fuzz cases run in this module: {CASES['count']}")
    assert CASES["count"] >= 1500
