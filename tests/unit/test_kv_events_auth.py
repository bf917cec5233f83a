"""Who may publish to a router's index (issue 57): given the shared secret, a subscriber
applies only batches the secret signed; a batch numbered past what the publisher's own
replay has is not the publisher's and blinds nothing; one peer gets a bounded share of
replays."""

from __future__ import annotations

import time

import anyio

from wavepp.kv_events.events import (
    REPLAY_BURST,
    EventPublisher,
    KVEventBatch,
    encode_batch,
    seq_bytes,
    stored,
)
from wavepp.kv_events.index import ReplicaIndex, subscribe

BS = 4
SECRET = b"a shared secret of 32 bytes....."


def _store(i: int):
    return [stored([100 + i], 99 + i if i else None, [0] * BS, BS, 0)]


def _until(what, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds  # a hang guard
    while not what():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.02)


def _follow(pub_endpoint, replay_endpoint, index, secret, body, subscriber=None):
    """Run ``body(feed)`` while ``feed`` (``subscriber(...)``, else :func:`subscribe`
    given the secret) follows the publisher."""
    async def main():
        if subscriber is None:
            feed = subscribe(pub_endpoint, replay_endpoint, index, secret=secret)
        else:
            feed = subscriber(pub_endpoint, replay_endpoint, index)
        async with anyio.create_task_group() as tg:
            tg.start_soon(feed.run)
            await anyio.to_thread.run_sync(body, feed)
            tg.cancel_scope.cancel()
        return feed.feed

    return anyio.run(main)


def test_a_subscriber_with_the_secret_applies_only_signed_batches():
    hashes = [100, 101, 102]
    signed = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", block_size=BS,
                            secret=SECRET)  # fmt: skip
    impostor = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", block_size=BS)
    try:
        for i in range(3):
            signed.publish(_store(i))
            impostor.publish(_store(i))
        index = ReplicaIndex(BS)

        def signed_body(feed):
            _until(lambda: feed.last_seq == 2)
            signed.publish(_store(3))
            _until(lambda: feed.last_seq == 3)

        feed = _follow(signed.endpoint, signed.replay_endpoint, index, SECRET, signed_body)
        assert index.predicted_blocks(hashes, 3) == 3 and feed.num_refused == 0
        fooled = ReplicaIndex(BS)

        def impostor_body(feed):
            time.sleep(0.5)
            impostor.publish(_store(3))
            _until(lambda: feed.feed.num_refused >= 2)  # the replay's frames and the batch

        feed = _follow(impostor.endpoint, impostor.replay_endpoint, fooled, SECRET,
                       impostor_body)  # fmt: skip
        assert fooled.num_blocks == 0 and feed.last_seq is None
    finally:
        signed.close()
        impostor.close()


def test_the_routers_handoff_secret_reaches_its_subscriber(tmp_path, monkeypatch):
    """``python -m wavepp.route --handoff-secret FILE``: the router's subscriber applies a
    signing replica's batches and refuses an unsigned publisher's; a bad file is one line."""
    from wavepp.route.__main__ import _events, parser, secret_of

    monkeypatch.delenv("WAVEPP_HANDOFF_SECRET", raising=False)
    (tmp_path / "secret").write_bytes(SECRET + b"\n")
    args = parser().parse_args(["--replica", "http://x:1", "--handoff-secret",
                                str(tmp_path / "secret")])  # fmt: skip
    assert secret_of(args) == SECRET
    _, routers_subscribe = _events(secret_of(args))
    signed = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", block_size=BS,
                            secret=SECRET)  # fmt: skip
    impostor = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", block_size=BS)
    try:
        for i in range(2):
            signed.publish(_store(i))
            impostor.publish(_store(i))
        index, fooled = ReplicaIndex(BS), ReplicaIndex(BS)
        _follow(signed.endpoint, signed.replay_endpoint, index, None,
                lambda feed: _until(lambda: feed.last_seq == 1), routers_subscribe)  # fmt: skip
        assert index.predicted_blocks([100, 101], 2) == 2
        feed = _follow(impostor.endpoint, impostor.replay_endpoint, fooled, None,
                       lambda feed: _until(lambda: feed.feed.num_refused >= 1),
                       routers_subscribe)  # fmt: skip
        assert fooled.num_blocks == 0 and feed.last_seq is None
    finally:
        signed.close()
        impostor.close()
    (tmp_path / "short").write_bytes(b"too short")
    bad = parser().parse_args(["--replica", "http://x:1", "--handoff-secret",
                               str(tmp_path / "short")])  # fmt: skip
    try:
        secret_of(bad)
    except SystemExit as error:
        assert str(error).startswith("wavepp route: --handoff-secret: the handoff secret")
    else:
        raise AssertionError("a 9-byte secret was taken")


def test_a_batch_numbered_past_the_publishers_own_is_refused():
    """One forged frame numbered 2^40 once blinded the index for good (every real batch
    after it looked already applied): now the replay says the publisher is at 2, the
    frame is refused, and batch 3 is applied."""
    pub = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", block_size=BS)
    index = ReplicaIndex(BS)
    try:
        for i in range(3):
            pub.publish(_store(i))

        def body(feed):
            _until(lambda: feed.last_seq == 2)
            payload = encode_batch(KVEventBatch(ts=0.0, events=_store(7)))
            pub._queue.put(((1 << 40), payload))  # the PUB socket sends it as a batch
            _until(lambda: feed.feed.num_refused == 1)
            pub.publish(_store(3))
            _until(lambda: feed.last_seq == 3)

        feed = _follow(pub.endpoint, pub.replay_endpoint, index, None, body)
        assert feed.last_seq == 3 and feed.num_rebuilds == 0
        assert index.predicted_blocks([100, 101, 102, 103], 4) == 4
        assert index.predicted_blocks([100, 101, 102, 103, 104, 105, 106, 107], 8) == 4
    finally:
        pub.close()


def test_one_peer_gets_a_bounded_share_of_replays():
    import zmq

    pub = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", block_size=BS)
    ctx = zmq.Context()
    try:
        pub.publish(_store(0))
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        answered = 0
        for _ in range(REPLAY_BURST + 4):
            dealer.send_multipart((b"", (5).to_bytes(8, "big")))  # past the last: the end mark
            if dealer.poll(1000):
                assert dealer.recv_multipart()[2] == seq_bytes(-1)
                answered += 1
        assert answered == REPLAY_BURST and pub.num_replays_dropped == 4
    finally:
        ctx.destroy(linger=0)
        pub.close()
