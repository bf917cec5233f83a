"""KV events: a stage's log and its report on the wire, rank 0's view, and the publisher
with its replay socket and a subscriber on real ZMQ sockets (loopback only)."""

from __future__ import annotations

import queue
import time

import anyio
import numpy as np
import pytest

from wavepp.kv_events.changes import Announcer, PipelineView, StageLog, report_limit
from wavepp.kv_events.events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    EventPublisher,
    decode_batch,
    removed,
    stored,
)
from wavepp.kv_events.index import ReplicaIndex, subscribe
from wavepp.policy import DEFAULT
from wavepp.rounds.messages import (
    CacheReport,
    CodecError,
    WaveDone,
    WaveMsg,
    decode_untrusted,
    encode,
    pack_hashes,
    unpack_hashes,
)
from wavepp.state import (
    RequestId,
    block_hashes,
    escrow,
    lease,
    materialize,
    publish,
    release,
    reserve_snapshots,
)

BS = 4


def _compute(cache, log, rid, tokens, snapshot_points=(), with_tokens=False):
    """One request run whole on one stage, through the log as Stage does."""
    hashes = block_hashes(tokens, BS)
    cache, point = lease(cache, RequestId(rid), hashes, len(hashes))
    cache, ok = escrow(cache, RequestId(rid), -(-len(tokens) // BS) - point)
    assert ok
    cache, done = materialize(cache, RequestId(rid))
    log.evicted(done.evicted)
    if snapshot_points:
        before = cache
        cache, _ = reserve_snapshots(cache, RequestId(rid), hashes,
                                     [k for k in snapshot_points if k > point])  # fmt: skip
        log.snapshots_evicted(before, cache)
    before = cache
    cache = publish(cache, RequestId(rid), hashes, len(hashes))
    log.published(before, cache, hashes, point, len(hashes), tokens if with_tokens else None, BS)
    return release(cache, RequestId(rid)), hashes


def test_a_log_reports_transitions_once_and_coalesces():
    cache = DEFAULT.empty_cache(4)
    log = StageLog(3, recurrent=False)
    tokens = np.arange(12, dtype=np.int32)  # 3 blocks
    cache, hashes = _compute(cache, log, "a", tokens)
    report = log.take(cache)
    assert (report.stage, report.recurrent) == (3, False)
    assert unpack_hashes(report.stored) == hashes
    assert report.removed == report.snapshots_stored == report.snapshots_removed == b""
    assert log.take(cache) is None  # nothing new
    # a second prompt evicts the first one's blocks, leaf first; stored and evicted before
    # a report would cancel out, reported ones go as removals
    other = np.arange(100, 116, dtype=np.int32)  # 4 blocks: 1 free slot, 3 evicted
    cache, others = _compute(cache, log, "b", other)
    report = log.take(cache)
    assert set(unpack_hashes(report.removed)) == set(hashes)
    assert unpack_hashes(report.stored) == others
    # stored and evicted again before a report: never reported at all
    cache, _ = _compute(cache, log, "c", np.arange(200, 216, dtype=np.int32))
    cache, kept = _compute(cache, log, "d", np.arange(300, 316, dtype=np.int32))
    report = log.take(cache)
    assert set(unpack_hashes(report.removed)) == set(others)
    assert unpack_hashes(report.stored) == kept
    assert log.num_resyncs == 0


def test_a_report_takes_at_most_limit_and_the_rest_follows():
    cache = DEFAULT.empty_cache(64)
    log = StageLog(0, recurrent=False, limit=5)
    cache, hashes = _compute(cache, log, "a", np.arange(48, dtype=np.int32))  # 12 blocks
    got = []
    while (report := log.take(cache)) is not None:
        assert len(unpack_hashes(report.stored)) <= 5
        got.extend(unpack_hashes(report.stored))
    assert got == list(hashes)
    assert report_limit(4096) == 1024 and report_limit(2) == 1 << 19


def test_snapshots_and_their_evictions_are_reported():
    cache = DEFAULT.empty_cache(32, has_recurrent=True, snapshot_capacity=2)
    log = StageLog(1, recurrent=True)
    cache, first = _compute(cache, log, "a", np.arange(16, dtype=np.int32), (2, 4))
    report = log.take(cache)
    assert set(unpack_hashes(report.snapshots_stored)) == {first[1], first[3]}
    # a second prompt's snapshots take the pool's two slots: the first prompt's go (LRU)
    cache, second = _compute(cache, log, "b", np.arange(50, 66, dtype=np.int32), (2, 4))
    report = log.take(cache)
    assert set(unpack_hashes(report.snapshots_removed)) == {first[1], first[3]}
    assert set(unpack_hashes(report.snapshots_stored)) == {second[1], second[3]}
    assert log.num_resyncs == 0


def test_a_view_off_the_cache_is_reported_again_in_full():
    cache = DEFAULT.empty_cache(16)
    log = StageLog(0, recurrent=False)
    quiet = StageLog(0, recurrent=False)  # misses the publish (a policy changing it elsewhere)
    cache, hashes = _compute(cache, quiet, "a", np.arange(12, dtype=np.int32))
    report = log.take(cache)
    assert log.num_resyncs == 1
    assert set(unpack_hashes(report.stored)) == set(hashes)


def test_reports_ride_waves_and_bad_ones_are_refused():
    report = CacheReport(1, True, pack_hashes((1, 2)), b"", pack_hashes((3,)), b"")
    wave = decode_untrusted(encode(WaveMsg(5, 64, [], cache=[report])), WaveMsg)
    done = decode_untrusted(encode(WaveDone(5, [], cache=wave.cache)), WaveDone)
    assert done.cache == [report]
    bad = CacheReport(1, True, b"\x01" * 7, b"", b"", b"")
    with pytest.raises(CodecError, match="not whole uint64s"):
        decode_untrusted(encode(WaveDone(5, [], cache=[bad])), WaveDone)


def test_rank_zero_announces_what_every_stage_holds_and_points_every_l_stage_has():
    tokens = np.arange(12, dtype=np.int32)
    h = block_hashes(tokens, BS)
    zero = StageLog(0, recurrent=False)
    zero.tokens.update({h[0]: (None, tokens[:4].astype("<i4").tobytes()),
                        h[1]: (h[0], tokens[4:8].astype("<i4").tobytes())})  # fmt: skip
    published = []
    announcer = Announcer(PipelineView(3, BS, zero.tokens.get), published.append, {})
    rep = lambda s, rec, **kw: CacheReport(  # noqa: E731
        s, rec, *(pack_hashes(kw.get(k, ())) for k in ("st", "rm", "sst", "srm")))
    announcer.report([rep(0, False, st=h[:2]), rep(1, True, st=h[:2], sst=h[1:2])])
    assert published == []  # stage 2 holds nothing yet
    announcer.report([rep(2, True, st=h[:1], sst=h[:1])])
    # block 0 is everywhere; a point after it needs a snapshot on both L stages: no
    assert published.pop() == [stored([h[0]], None, tokens[:4], BS, 0)]
    announcer.report([rep(2, True, st=h[1:2], sst=h[1:2])])
    assert published.pop() == [stored([h[1]], h[0], tokens[4:8], BS, 0),
                               stored([h[1]], h[0], tokens[4:8], BS, 1)]  # fmt: skip
    announcer.report([rep(1, True, srm=h[1:2])])  # a snapshot goes: the point goes
    assert published.pop() == [removed([h[1]], 1)]
    announcer.report([rep(0, False, rm=h[1:2])])  # a block goes anywhere: it goes
    assert published.pop() == [removed([h[1]], 0)]
    assert announcer.view.blocks == {h[0]} and announcer.view.points == set()


def test_the_index_follows_the_groups():
    index = ReplicaIndex(BS)
    h = list(range(1, 9))
    index.apply(_batch([stored(h[:6], None, [], BS, 0)]))
    assert index.predicted_blocks(h, 8) == 6 and not index.recurrent
    assert index.predicted_blocks(h, 4) == 4
    index.apply(_batch([stored([h[2]], h[1], [], BS, 1)]))  # a hybrid: points needed
    assert index.recurrent and index.predicted_blocks(h, 8) == 3
    index.apply(_batch([removed([h[2]], 1)]))
    assert index.predicted_blocks(h, 8) == 0
    index.apply(_batch([AllBlocksCleared()]))
    assert index.num_blocks == 0


def _batch(events):
    from wavepp.kv_events.events import KVEventBatch

    return KVEventBatch(ts=0.0, events=events)


# -- the sockets ----------------------------------------------------------------------


def _frames(sock, timeout_ms=2000):
    assert sock.poll(timeout_ms), "nothing arrived"
    return sock.recv_multipart()


def test_publisher_pub_frames_and_replay():
    import zmq

    pub = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", topic="kv", block_size=BS,
                         buffer_steps=2)  # fmt: skip
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(pub.endpoint)
        time.sleep(0.3)  # the subscription reaches the publisher
        assert pub.publish([stored([1, 2], None, list(range(8)), BS, 0)]) == 0
        topic, seq, payload = _frames(sub)
        assert (topic, int.from_bytes(seq, "big")) == (b"kv", 0)
        assert decode_batch(payload).events[0].block_hashes == [1, 2]
        pub.publish([removed([2], 0)])
        pub.publish([stored([3], 1, list(range(4)), BS, 0)])
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart((b"", (1).to_bytes(8, "big")))  # in the buffer: batches 1, 2
        got = [_frames(dealer) for _ in range(3)]
        assert [int.from_bytes(f[2], "big", signed=True) for f in got] == [1, 2, -1]
        assert isinstance(decode_batch(got[0][3]).events[0], BlockRemoved)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))  # past the buffer: the view
        view, end = _frames(dealer), _frames(dealer)
        assert int.from_bytes(view[2], "big") == 2 and end[2] == (-1).to_bytes(8, "big",
                                                                             signed=True)
        events = decode_batch(view[3]).events
        assert isinstance(events[0], AllBlocksCleared)
        assert [(e.block_hashes, e.parent_block_hash) for e in events[1:]] == [([1, 3], None)]
        assert events[1].token_ids == [0, 1, 2, 3, 0, 1, 2, 3]
        dealer.send_multipart((b"junk",))  # not a request: ignored, the socket still serves
        dealer.send_multipart((b"", (9).to_bytes(8, "big")))
        assert _frames(dealer)[2] == (-1).to_bytes(8, "big", signed=True)
    finally:
        ctx.destroy(linger=0)
        pub.close()


async def _until_seq(feed, seq: int) -> None:
    """Until the subscriber has applied batch ``seq``."""
    with anyio.fail_after(30):  # hang guard
        while feed.last_seq != seq:
            await anyio.sleep(0.02)


class _NoRoom(queue.Queue):
    def put_nowait(self, item):
        raise queue.Full


def test_subscribe_learns_the_past_fills_gaps_and_shows_its_state():
    pub = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", block_size=BS,
                         buffer_steps=4)  # fmt: skip
    index = ReplicaIndex(BS)
    h = list(range(10, 20))
    for i in range(6):  # before anyone listens, more than the buffer holds
        pub.publish([stored([h[i]], h[i - 1] if i else None, [0] * BS, BS, 0)])

    async def main():
        # the default silence (5 s) before a probe: with 1 s, a probe that timed out on a
        # loaded machine marked the feed disconnected before the check below
        feed = subscribe(pub.endpoint, pub.replay_endpoint, index)
        async with anyio.create_task_group() as tg:
            tg.start_soon(feed.run)
            await _until_seq(feed, 5)
            assert index.predicted_blocks(h, 10) == 6 and feed.connected
            # the next batch never reaches the PUB socket (its send queue is full): the
            # subscriber sees a gap and gets it from the replay socket
            saved, pub._queue = pub._queue, _NoRoom()
            pub.publish([removed([h[5]], 0)])
            pub._queue = saved
            pub.publish([stored([h[5]], h[4], [0] * BS, BS, 0)])
            await _until_seq(feed, 7)
            assert pub.num_dropped == 1 and feed.feed.num_replays >= 2
            assert index.predicted_blocks(h, 10) == 6
            tg.cancel_scope.cancel()

    try:
        anyio.run(main)
    finally:
        pub.close()


class _SlowEnd:
    """A replay socket whose end mark leaves half a second after the batches."""

    def __init__(self, sock) -> None:
        self._sock = sock

    def send_multipart(self, frames, *args, **kwargs):
        if frames[3] == END_SEQ:
            time.sleep(0.5)
        return self._sock.send_multipart(frames, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def test_a_replay_answer_shows_the_feed_connected_before_its_end_mark():
    """A subscriber that has applied batches from a replay is connected, though the
    replay's end mark has not come yet (a check right after the batches flaked)."""
    pub = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", block_size=BS,
                         buffer_steps=4)  # fmt: skip
    index = ReplicaIndex(BS)
    for i in range(3):
        pub.publish([stored([10 + i], 9 + i if i else None, [0] * BS, BS, 0)])
    pub._replay = _SlowEnd(pub._replay)

    async def main():
        feed = subscribe(pub.endpoint, pub.replay_endpoint, index)
        async with anyio.create_task_group() as tg:
            tg.start_soon(feed.run)
            await _until_seq(feed, 2)
            assert feed.connected and feed.feed.num_replays == 1
            tg.cancel_scope.cancel()

    try:
        anyio.run(main)
    finally:
        pub.close()


def test_a_quiet_publisher_stays_connected_and_a_gone_one_does_not():
    """An idle pipeline publishes nothing; its replay socket answers the subscriber's probe,
    so the router does not take it out. A closed publisher answers nothing."""
    pub = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", block_size=BS)
    pub.publish([stored([7], None, [0] * BS, BS, 0)])
    closed = False

    async def main():
        nonlocal closed
        feed = subscribe(pub.endpoint, pub.replay_endpoint, ReplicaIndex(BS), silent_s=0.2,
                         replay_timeout_s=0.2)  # fmt: skip
        async with anyio.create_task_group() as tg:
            tg.start_soon(feed.run)
            with anyio.fail_after(10):  # hang guard
                while feed.last_seq != 0:
                    await anyio.sleep(0.02)
                for _ in range(20):  # 2 s of quiet: ten silences, each probed
                    await anyio.sleep(0.1)
                    assert feed.connected
                assert feed.feed.num_batches == 1
                pub.close()
                closed = True
                while feed.connected:
                    await anyio.sleep(0.05)
            tg.cancel_scope.cancel()

    try:
        anyio.run(main)
    finally:
        if not closed:
            pub.close()


def test_kv_events_options_are_checked():
    from wavepp.config import OptionError, RunConfig, check_option, kv_events_replay, validate

    assert kv_events_replay(RunConfig(kv_events="tcp://*:5557")) == "tcp://*:5558"
    assert kv_events_replay(RunConfig(kv_events="tcp://127.0.0.1:0")) == "tcp://127.0.0.1:0"
    assert kv_events_replay(RunConfig(kv_events="tcp://h:1", kv_events_replay="tcp://h:9")) \
        == "tcp://h:9"
    for bad in ("5557", "tcp://:5557", "tcp://h:65536", "ipc:///tmp/x", "tcp://h:x"):
        with pytest.raises(OptionError, match="--kv-events must be tcp://HOST:PORT"):
            check_option("kv_events", bad)
    with pytest.raises(SystemExit, match="--kv-events-replay needs --kv-events"):
        validate(RunConfig(kv_events_replay="tcp://h:9", budget=64, min_budget=64))
    with pytest.raises(SystemExit, match="must differ"):
        validate(RunConfig(kv_events="tcp://h:9", kv_events_replay="tcp://h:9", budget=64,
                           min_budget=64))  # fmt: skip


def test_a_replay_request_is_answered_with_a_bounded_number_of_frames():
    import zmq

    from wavepp.kv_events.events import MAX_REPLAY_BATCHES

    pub = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", block_size=BS,
                         buffer_steps=10 * MAX_REPLAY_BATCHES)  # fmt: skip
    ctx = zmq.Context()
    try:
        for i in range(4 * MAX_REPLAY_BATCHES):  # all in the buffer
            pub.publish([stored([100 + i], 99 + i if i else None, [0] * BS, BS, 0)])
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))  # every batch since the first
        view, end = _frames(dealer), _frames(dealer)
        assert end[2] == (-1).to_bytes(8, "big", signed=True)  # the view, then the end mark
        events = decode_batch(view[3]).events
        assert isinstance(events[0], AllBlocksCleared) and len(events) > 1
        last = 4 * MAX_REPLAY_BATCHES - 1
        dealer.send_multipart((b"", (last - 2).to_bytes(8, "big")))  # a few: as they were
        got = [_frames(dealer) for _ in range(4)]
        assert [int.from_bytes(f[2], "big", signed=True) for f in got] == [
            last - 2, last - 1, last, -1]
    finally:
        ctx.destroy(linger=0)
        pub.close()
