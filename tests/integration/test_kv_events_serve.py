"""KV events end to end: a P = 2 server on the torch executor (tiny-kimi: KDA stages with
snapshots and MLA), a subscriber's ReplicaIndex, and admission's own answer.

Requests sharing prefixes (cut off block boundaries, pools small enough that blocks and
snapshots are evicted) go one at a time; before each, the index's predicted reuse must
equal the cached tokens admission then grants.
"""

from __future__ import annotations

import signal
import subprocess

import anyio
import httpx
import numpy as np
import pytest

from tests.helpers.serve import start_server
from wavepp.kv_events.index import ReplicaIndex, subscribe
from wavepp.state import block_hashes, longest_prefix

pytestmark = pytest.mark.slow

OPTIONS = ["--model", "tiny-kimi", "--capacity-blocks", "48", "--snapshot-capacity", "10",
           "--snapshot-interval", "4", "--kv-events", "tcp://127.0.0.1:0"]  # fmt: skip


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    docs = [rng.integers(1, 500, size=n).tolist() for n in (70, 53, 90)]
    tail = lambda n: rng.integers(1, 500, size=n).tolist()  # noqa: E731
    a, b, c = docs
    return [a + tail(9), a + tail(21), a + b + tail(5), b + tail(30), a + b + tail(40),
            c + tail(7), a + tail(3), c + a + tail(11), a + b + c + tail(2), b + tail(17),
            a + b + tail(33), c + tail(60), a + tail(12)]  # fmt: skip


async def latest_seq(replay: str, start: int) -> int:
    """The newest batch the publisher has numbered (it numbers them before the answer to
    the request that caused them leaves), asked of its replay socket."""
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(replay)
    try:
        await sock.send_multipart((b"", start.to_bytes(8, "big", signed=True)))
        newest = start - 1
        while True:
            frames = await sock.recv_multipart()
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq < 0:
                return newest
            newest = max(newest, seq)
    finally:
        sock.close(linger=0)
        ctx.term()


def test_predicted_reuse_equals_granted_reuse(tmp_path):
    server, url, _ = start_server(tmp_path, OPTIONS)
    try:
        anyio.run(_check, url)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()
            raise
    err = (tmp_path / "server.err").read_text()
    assert code == 0, err[-4000:]
    assert "KV events on tcp://127.0.0.1:" in err


async def _check(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        info = (await client.get("/v1/models")).json()["data"][0]["wavepp"]
        events = info["kv_events"]
        assert events["endpoint"].startswith("tcp://127.0.0.1:") and events["recurrent"]
        bs = info["block_size"]
        index = ReplicaIndex(bs)  # as the router makes it: it learns the replica's kind
        feed = subscribe(events["endpoint"], events["replay"], index, events["topic"])
        granted, predicted, held = [], [], []
        async with anyio.create_task_group() as tg:
            tg.start_soon(feed.run)
            with anyio.fail_after(300):  # hang guard
                for n, tokens in enumerate(prompts()):
                    newest = await latest_seq(events["replay"], 0)
                    while (feed.last_seq if feed.last_seq is not None else -1) < newest:
                        await anyio.sleep(0.01)
                    limit = (len(tokens) - 1) // bs
                    hashes = block_hashes(tokens, bs)
                    guess = index.predicted_blocks(hashes, limit) * bs
                    held.append(longest_prefix(index.blocks, hashes, limit) * bs)
                    answer = await client.post("/v1/prefill",
                                               json={"tokens": tokens, "id": f"q{n}"})  # fmt: skip
                    assert answer.status_code == 200, answer.text
                    granted.append(answer.json()["cached_tokens"])
                    predicted.append(guess)
            tg.cancel_scope.cancel()
        assert predicted == granted
        assert sum(g > 0 for g in granted) >= 6  # prefixes were really reused
        assert index.recurrent
        # some reuse stopped short of the blocks held everywhere: at a common snapshot
        assert any(h > p for h, p in zip(held, predicted, strict=True)), (held, predicted)
        assert feed.feed.num_rebuilds == 0 and feed.feed.num_refused == 0
