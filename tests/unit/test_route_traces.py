"""The conversation traces the routing study replays (wavepp.workload.sessions), the replay's
clock (benchmarks._replay) and the causes of lost reuse (wavepp.route.explain)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from benchmarks._replay import parse_views, turns_at
from wavepp.route.explain import breakdown, cause, producers
from wavepp.state import block_hashes
from wavepp.workload import read_trace
from wavepp.workload.sessions import (
    SHAPES,
    previous_turns,
    read_sessions,
    replay_order,
    session_trace,
    write_trace,
)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_a_trace_is_mooncakes_format_with_a_shared_head_and_growing_conversations(name, tmp_path):
    shape = SHAPES[name]
    lines = session_trace(shape, 3)
    assert lines == session_trace(shape, 3) and lines != session_trace(shape, 4)  # seeded
    head = shape.system_blocks + shape.app_blocks
    system = lines[0]["hash_ids"][: shape.system_blocks]
    by_session: dict[int, list[dict]] = {}
    for line in lines:
        assert -(-line["input_length"] // 512) == len(line["hash_ids"])
        assert line["hash_ids"][: shape.system_blocks] == system  # every request's first ids
        assert line["input_length"] <= shape.max_input
        by_session.setdefault(line["session"], []).append(line)
    assert [line["timestamp"] for line in lines] == sorted(line["timestamp"] for line in lines)
    assert len(by_session) > shape.num_sessions // 2  # several sessions, interleaved
    for turns in by_session.values():
        assert [t["turn"] for t in turns] == list(range(len(turns)))
        for a, b in itertools.pairwise(turns):
            assert b["hash_ids"][: len(a["hash_ids"])] == a["hash_ids"]  # extends it
            assert b["input_length"] > a["input_length"] and b["timestamp"] > a["timestamp"]
        # one application prompt a conversation
        assert len({tuple(t["hash_ids"][:head]) for t in turns}) == 1
    # replayed, a turn's tokens begin with the previous turn's, to the token
    path = tmp_path / "t.jsonl"
    write_trace(lines, path)
    rows, rejected = read_trace(path)
    assert not rejected and len(rows) == len(lines)
    specs, after = replay_order(path, None, 0, 64)
    for i, j in enumerate(after):
        if j is not None:
            previous = specs[j].tokens
            assert np.array_equal(specs[i].tokens[: len(previous)], previous)
            assert lines[j]["session"] == lines[i]["session"]
            assert lines[j]["turn"] == lines[i]["turn"] - 1
    assert sum(j is None for j in after) == len(by_session)
    assert shape.head_tokens == head * 512


def test_previous_turns_and_lines_without_sessions(tmp_path):
    assert previous_turns([(0, 0), (1, 0), (0, 1), None, (1, 1), (0, 2)]) == [
        None, None, 0, None, 1, 2]  # fmt: skip
    path = tmp_path / "m.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10, "hash_ids": [1]}\n'
                    'not json\n'
                    '{"timestamp": 5, "input_length": 10, "hash_ids": [1], "session": 2, '
                    '"turn": 0}\n')  # fmt: skip
    assert read_sessions(path) == [None, (2, 0)]  # the bad line skipped, as read_trace does


def test_the_replay_compresses_the_trace_clock_to_the_offered_rate():
    tokens = [np.zeros(100, np.int32), np.zeros(300, np.int32), np.zeros(100, np.int32)]
    # 500 tokens over 10 trace seconds = 50 tok/s; offered 500 tok/s: 10x faster, then x 8
    turns, speed = turns_at(tokens, [5.0, 10.0, 15.0], [None, 0, None], 500.0, 8.0, "f1-")
    assert speed == pytest.approx(10.0)
    assert [t.arrival_s for t in turns] == pytest.approx([0.0, 4.0, 8.0])
    assert [t.after for t in turns] == [None, 0, None]
    assert [t.request_id for t in turns] == ["f1-0", "f1-1", "f1-2"]
    assert parse_views("r0=64/-/0/128/500/2;r1=0/64/0/0/0/0") == {
        "r0": (64, None, 0, 128, 500, 2), "r1": (0, 64, 0, 0, 0, 0)}  # fmt: skip


def _sent(replica, cached, sent, answered, views=None, tokens=1000, status="done"):
    return {"num_tokens": tokens, "status": status, "replica": replica, "predicted": None,
            "views": views, "cached_tokens": cached, "sent_s": sent, "answered_s": answered}


def test_each_lost_reuse_has_one_cause():
    producer = _sent("r0", 0, 0.0, 1.0)
    # views: (predicted, announced, in flight, answered unconfirmed, queued, in flight count)
    knew = {"r0": (800, 800, 0, 0, 9000, 3), "r1": (0, 0, 0, 0, 0, 0)}
    assert cause(_sent("r1", 0, 2.0, 3.0, knew), producer, 800, False) == (
        "policy: load or no reuse")
    small = {"r0": (200, 200, 0, 0, 9000, 3), "r1": (0, 0, 0, 0, 0, 0)}  # 20% of the prompt
    assert cause(_sent("r1", 0, 2.0, 3.0, small), producer, 200, False) == (
        "policy: under 30% (looked equal)")
    blind = {"r0": (0, 0, 0, 0, 0, 0), "r1": (0, 0, 0, 0, 0, 0)}
    assert cause(_sent("r1", 0, 0.5, 3.0, blind), producer, 800, False) == "computing elsewhere"
    late = {"r0": (0, 0, 0, 800, 0, 0), "r1": (0, 0, 0, 0, 0, 0)}
    assert cause(_sent("r1", 0, 2.0, 3.0, late), producer, 800, False) == (
        "events not yet arrived")
    # the same knowledge is the policy's when it reads the router's memory
    assert cause(_sent("r1", 0, 2.0, 3.0, late), producer, 800, True) == (
        "policy: load or no reuse")
    floor = {"r0": (512, 800, 0, 0, 0, 0), "r1": (512, 512, 0, 0, 0, 0)}
    assert cause(_sent("r1", 512, 2.0, 3.0, floor), producer, 800, False) == "snapshot floor"
    assert cause(_sent("r1", 0, 2.0, 3.0, blind), producer, 800, False) == "evicted"
    # at the producer's replica: the replica's own cache
    assert cause(_sent("r0", 0, 0.5, 3.0, blind), producer, 800, False) == "computing here"
    assert cause(_sent("r0", 600, 2.0, 3.0, knew), producer, 800, False) == "admission"
    assert cause(_sent("r0", 512, 2.0, 3.0, floor), producer, 800, False) == "snapshot floor"
    assert cause(_sent("r0", 0, 2.0, 3.0, blind), producer, 800, False) == "evicted"
    assert cause(_sent("r0", 800, 2.0, 3.0, blind), producer, 800, False) is None  # lost none
    failed = _sent("r0", 0, 0.0, 1.0, status="http-503")
    assert cause(_sent("r1", 0, 2.0, 3.0), failed, 800, False) == "no producer answer"


def test_the_breakdown_adds_lost_tokens_by_cause_and_checks_predictions():
    doc = list(range(64))
    tokens = [doc[:20], doc[:40], list(range(100, 140))]  # 16-token blocks
    hashes = [block_hashes(t, 16) for t in tokens]
    expected = producers(hashes, [len(t) for t in tokens], 16)
    assert expected == [(None, 0), (0, 16), (None, 0)]
    views = {"r0": (0, 0, 0, 16, 0, 0), "r1": (0, 0, 0, 0, 0, 0)}
    records = [_sent("r0", 0, 0.0, 1.0, tokens=20), _sent("r1", 0, 2.0, 3.0, views, tokens=40),
               _sent("r1", 0, 2.0, 3.0, tokens=40)]  # fmt: skip
    records[1]["predicted"] = 0
    why = breakdown(records, expected, reads_memory=False)
    assert why["lost_tokens"]["events not yet arrived"] == 16
    assert why["lost_requests"]["events not yet arrived"] == 1
    assert sum(why["lost_tokens"].values()) == why["expected_tokens"] - why["cached_tokens"] == 16
    assert why["moved_from_producer"] == 1 and why["predicted_exact"] == 1
    assert why["input_tokens"] == 100 and why["requests"] == 3
