"""Round and wave messages: exact round trips, and clean errors for a peer's bad bytes."""

import msgspec
import pytest

from wavepp.rounds.messages import (
    AdmitEntry,
    AdmitRound,
    ChunkMsg,
    CodecError,
    DataMessage,
    Heartbeat,
    RoundMessage,
    WaveDone,
    WaveMsg,
    decode_untrusted,
    encode,
    pack_hashes,
    unpack_hashes,
)
from wavepp.transport.frames import INLINE_MAX_BYTES, INLINE_MIN_BYTES, inline_after


def test_round_trip_of_every_message():
    hashes = (0, 1, 2**64 - 1)
    messages = [
        AdmitRound(3, [AdmitEntry("req-1", 200, pack_hashes(hashes), 2)]),
        AdmitRound(5, [AdmitEntry("req-2", 200, pack_hashes(hashes), 2)], anchors=[1]),
        Heartbeat(4),
        WaveMsg(9, 8192, [ChunkMsg("req-1", 128, 200, 200, False)]),
        WaveDone(9, [], stop=True),
    ]
    for message in messages:
        kind = RoundMessage if isinstance(message, AdmitRound | Heartbeat) else DataMessage
        assert decode_untrusted(encode(message), kind) == message
    assert unpack_hashes(pack_hashes(hashes)) == hashes


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        encode(Heartbeat(1))[:-1],
        msgspec.msgpack.encode({"type": "AdmitRound", "round_id": -1, "entries": []}),
        msgspec.msgpack.encode({"type": "AdmitRound", "round_id": 1, "entries": [
            {"request_id": "a", "num_tokens": 5, "hashes": b"123", "probe_limit": 0}]}),
        msgspec.msgpack.encode({"type": "Heartbeat", "round_id": 1, "extra": 2}),
        msgspec.msgpack.encode({"type": "Pickle", "round_id": 1}),
    ],
)  # fmt: skip
def test_bad_bytes_give_a_codec_error(raw):
    with pytest.raises(CodecError):
        decode_untrusted(raw, RoundMessage)


def test_a_wave_is_not_a_round_message():
    with pytest.raises(CodecError):
        decode_untrusted(encode(WaveMsg(1, 1, [])), RoundMessage)


def test_the_broadcast_inline_room_grows_alike_on_every_rank_up_to_its_ceiling():
    room = INLINE_MIN_BYTES
    assert inline_after(room, 0) == inline_after(room, 100) == room  # never shrinks
    assert inline_after(room, room + 1) == 2 * room
    assert inline_after(2 * room, 10) == 2 * room
    assert inline_after(room, 10 * INLINE_MAX_BYTES) == INLINE_MAX_BYTES


@pytest.mark.parametrize("ended_at", [float("inf"), float("nan"), -1.0, 2e12])
def test_a_relayed_outcome_with_an_impossible_clock_is_refused(ended_at):
    """A HandoffOutcome's ``ended_at`` goes into the result and the JSON record, where an
    infinity would not be JSON: a peer's must be a wall clock."""
    from wavepp.rounds.messages import HandoffOutcome, HandoffRelay

    good = HandoffRelay([HandoffOutcome("a", 1, True, "", "", 8, 0.01, 1.8e9, 0.005)])
    assert decode_untrusted(encode(good), DataMessage) == good
    raw = msgspec.msgpack.encode({"type": "HandoffRelay", "handoffs": [
        ["a", 1, True, "", "", 8, 0.01, ended_at, 0.005]]})  # fmt: skip
    with pytest.raises(CodecError):
        decode_untrusted(raw, DataMessage)


def test_ids_between_ranks_follow_the_one_id_rule():
    from wavepp.ids import MAX_ID_CHARS, id_problem

    longest, over = "r" * MAX_ID_CHARS, "r" * (MAX_ID_CHARS + 1)
    assert id_problem(longest) is None and id_problem(over) is not None
    entry = AdmitEntry(longest, 200, pack_hashes((1,)), 2)
    assert decode_untrusted(encode(AdmitRound(1, [entry])), RoundMessage).entries == [entry]
    raw = encode(AdmitRound(1, [AdmitEntry(over, 200, pack_hashes((1,)), 2)]))
    with pytest.raises(CodecError):
        decode_untrusted(raw, RoundMessage)


def test_one_table_of_dtype_names():
    import numpy as np
    import torch

    from wavepp.dtypes import FLOATS, ITEMSIZE, name_of, torch_dtype

    for name in FLOATS:
        assert name_of(torch_dtype(name)) == name
        assert torch_dtype(name).itemsize == ITEMSIZE[name]
    assert name_of(torch.int32) == name_of(np.dtype("int32")) == "int32"
    with pytest.raises(ValueError, match="int8"):
        name_of(torch.int8)
    with pytest.raises(ValueError):
        torch_dtype("int32")
