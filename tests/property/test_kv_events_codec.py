"""KV-event batches decode with the published schema: random batches round-trip, and
untrusted bytes decode to a batch or EventsError — never anything else."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from wavepp.kv_events.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventsError,
    KVEventBatch,
    decode_batch,
    encode_batch,
)

u64 = st.integers(0, 2**64 - 1)
maybe_text = st.none() | st.text(max_size=12)
stored = st.builds(
    BlockStored,
    block_hashes=st.lists(u64, max_size=5),
    parent_block_hash=st.none() | u64,
    token_ids=st.lists(st.integers(0, 2**31 - 1), max_size=20),
    block_size=st.integers(1, 256),
    lora_id=st.none() | st.integers(0, 10),
    medium=maybe_text,
    lora_name=maybe_text,
    group_idx=st.none() | st.integers(0, 3),
    kv_cache_spec_kind=maybe_text,
    session_id=maybe_text,
)
removed = st.builds(BlockRemoved, block_hashes=st.lists(u64, max_size=5), medium=maybe_text,
                    group_idx=st.none() | st.integers(0, 3))  # fmt: skip
events = st.lists(st.one_of(stored, removed, st.just(AllBlocksCleared())), max_size=8)
batches = st.builds(KVEventBatch, ts=st.floats(0, 2e9), events=events,
                    data_parallel_rank=st.none() | st.integers(0, 7))  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(batches)
def test_round_trip(batch):
    assert decode_batch(encode_batch(batch)) == batch


def test_wire_shape_is_vllms():
    """An array [ts, events, dp rank]; events as maps tagged by class name, defaults left
    out — the shape vLLM's msgspec structs give (checked against vLLM itself in
    tests/integration/test_kv_events_vllm.py)."""
    batch = KVEventBatch(ts=1.5, events=[
        BlockStored([7, 8], None, [1, 2, 3, 4], 2, None, "CPU", None, group_idx=0,
                    kv_cache_spec_kind="full_attention"),
        BlockRemoved([8], "CPU", group_idx=0), AllBlocksCleared(),
    ], data_parallel_rank=0)  # fmt: skip
    plain = msgspec.msgpack.decode(encode_batch(batch))
    assert plain == [1.5, [
        {"type": "BlockStored", "block_hashes": [7, 8], "parent_block_hash": None,
         "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": None, "medium": "CPU",
         "lora_name": None, "group_idx": 0, "kv_cache_spec_kind": "full_attention"},
        {"type": "BlockRemoved", "block_hashes": [8], "medium": "CPU", "group_idx": 0},
        {"type": "AllBlocksCleared"}], 0]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_crash(raw):
    try:
        batch = decode_batch(raw)
    except EventsError:
        return
    assert isinstance(batch, KVEventBatch)


@settings(max_examples=200, deadline=None)
@given(batches, st.data())
def test_corrupted_batches_never_crash(batch, data):
    raw = bytearray(encode_batch(batch))
    for _ in range(data.draw(st.integers(1, 4))):
        if not raw:
            break
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] = data.draw(st.integers(0, 255))
    raw = raw[: data.draw(st.integers(0, len(raw)))]
    try:
        batch = decode_batch(bytes(raw))
    except EventsError:
        return
    assert isinstance(batch, KVEventBatch)


def test_oversized_and_overlong_refused():
    import pytest

    with pytest.raises(EventsError, match="exceeds"):
        decode_batch(b"\x00" * ((128 << 20) + 1))
    # a list claiming 2**32 - 1 items in 6 bytes: refused, nothing allocated
    with pytest.raises(EventsError):
        decode_batch(b"\x93\xcb" + b"\x00" * 8 + b"\xdd\xff\xff\xff\xff")
    with pytest.raises(EventsError):  # a hash past 64 bits or of the wrong type
        decode_batch(msgspec.msgpack.encode(
            [0.0, [{"type": "BlockRemoved", "block_hashes": [1.5], "medium": None}]]))  # fmt: skip
