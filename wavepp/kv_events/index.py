"""One replica's reusable view, kept from its KV events (docs/fleet.md).

:class:`ReplicaIndex` holds what a replica announced: the blocks every stage holds
(group 0) and, for a hybrid, the points every stage with L layers can resume from
(group 1). Its prediction is the state core's own probe over those sets — the
gallop + bisect of :func:`wavepp.state.longest_prefix`, then, for a hybrid,
:func:`wavepp.state.snapshot_floor_linear` — so it is the point admission grants: the
largest k ≤ the probe limit with blocks 0..k-1 held everywhere and a snapshot at k on
every L stage (DESIGN §4).

:func:`subscribe` keeps an index current from a publisher's PUB and replay sockets.
Given the shared secret, it applies only batches the secret signed
(``wavepp.kv_events.events.sign_batch``): an impostor that binds a replica's port feeds
it nothing. A batch numbered past what the publisher's own replay socket says it has
published is not the publisher's and is refused; one numbered past a gap no replay could
fill clears the index (rebuilt from there), unless it jumps more than ``MAX_SEQ_JUMP``
ahead, which is refused too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import attrs

from wavepp.kv_events.events import (
    DOMAIN,
    MAX_BATCH_BYTES,
    SNAPSHOT_GROUP,
    AllBlocksCleared,
    BlockStored,
    EventsError,
    KVEventBatch,
    batch_body,
    decode_batch,
)
from wavepp.signing import SignatureError, Verifier
from wavepp.state import BlockHash, longest_prefix, snapshot_floor_linear

logger = logging.getLogger("wavepp.kv_events")

MAX_SEQ_JUMP = 1 << 20  # a batch this far past the last one, unconfirmed, is refused


class ReplicaIndex:
    """A replica's announced blocks and reuse points, fed by :meth:`apply`."""

    def __init__(self, block_size: int, recurrent: bool | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block size must be ≥ 1, got {block_size}")
        self.block_size = block_size
        self.blocks: set[BlockHash] = set()  # group 0: held by every stage
        self.snapshots: set[BlockHash] = set()  # group 1: a snapshot after the block on
        #                                         every L stage (the name the probe reads)
        self.recurrent = bool(recurrent)  # a hybrid: points need group 1. None at start:
        self._learn = recurrent is None  # learnt from the first group-1 event

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def clear(self) -> None:
        """Forget every block (the replica's kind stays known)."""
        self.blocks.clear()
        self.snapshots.clear()

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self.clear()
                continue
            group = event.group_idx or 0
            if group == SNAPSHOT_GROUP and self._learn:
                self.recurrent = True
            table = self.snapshots if group == SNAPSHOT_GROUP else self.blocks
            if group not in (0, SNAPSHOT_GROUP):
                continue  # not a group WavePP publishes
            hashes = [h for h in event.block_hashes if isinstance(h, int)]
            if isinstance(event, BlockStored):
                table.update(hashes)
            else:
                table.difference_update(hashes)

    def predicted_blocks(self, hashes: Sequence[int], probe_limit: int) -> int:
        """The reuse point, in blocks, admission would grant a prompt with these chained
        block hashes: blocks held everywhere, then (a hybrid) down to a common snapshot."""
        point = longest_prefix(self.blocks, hashes, max(probe_limit, 0))
        if self.recurrent:
            point = snapshot_floor_linear(self, hashes, point)  # type: ignore[arg-type]
        return point


# -- the subscriber ------------------------------------------------------------------


@attrs.define
class Feed:
    """A running subscription: what the router shows of it."""

    endpoint: str
    replay_endpoint: str | None
    topic: str
    last_seq: int | None = None  # the latest batch applied
    connected: bool = False  # a batch or a replay answer came within ``silent_s``
    # (a stream quiet for ``silent_s`` is probed through the replay socket)
    num_batches: int = 0
    num_replays: int = 0
    num_rebuilds: int = 0  # gaps no replay could fill: the index was cleared
    num_refused: int = 0  # frames that were not a batch of the schema
    last_heard: float = 0.0  # time.monotonic() of the last frame


def subscribe(endpoint: str, replay_endpoint: str | None, index: ReplicaIndex,
              topic: str = "", *, silent_s: float = 5.0, replay_timeout_s: float = 2.0,
              secret: bytes | None = None) -> _Subscription:  # fmt: skip
    """Keep ``index`` current from a publisher: returns an awaitable to run as a task,
    which also shows the feed's ``last_seq`` and ``connected`` (keep it to read them).
    ``secret``: apply only batches signed with it."""
    return _Subscription(Feed(endpoint, replay_endpoint, topic), index, silent_s,
                         replay_timeout_s, secret)  # fmt: skip


class _Subscription:
    """Awaitable (run it as a task) and carries the feed's figures (``last_seq``,
    ``connected``) as attributes, so a caller can keep it either way."""

    def __init__(self, feed: Feed, index: ReplicaIndex, silent_s: float,
                 replay_timeout_s: float, secret: bytes | None = None) -> None:  # fmt: skip
        self.feed = feed
        self.index = index
        self.silent_s = silent_s
        self.replay_timeout_s = replay_timeout_s
        self._verifier = Verifier(secret) if secret else None

    def _signed(self, frames: list[bytes], what: str) -> list[bytes] | None:
        """``[topic, seq, payload]`` of a batch's frames (their signature checked, given
        the secret), or None (counted as refused) for frames that are not one."""
        if self._verifier is None:
            if len(frames) in (3, 4):  # a signing publisher's fourth frame is ignored
                return frames[:3]
        elif len(frames) == 4:
            try:
                auth = frames[3].decode("ascii")
                self._verifier.verify(auth, DOMAIN, batch_body(*frames[:3]), what)
                return frames[:3]
            except (UnicodeDecodeError, SignatureError) as error:
                logger.warning("KV events from %s: %s", self.feed.endpoint, error)
        self.feed.num_refused += 1
        return None

    @property
    def last_seq(self) -> int | None:
        return self.feed.last_seq

    @property
    def connected(self) -> bool:
        feed = self.feed
        quiet = time.monotonic() - feed.last_heard  # a probe follows silent_s of quiet
        return feed.connected and quiet < self.silent_s + self.replay_timeout_s

    def __await__(self):
        return self.run().__await__()

    async def run(self) -> None:
        """SUB to the publisher; ask the replay socket for the view at the start and on
        every gap; a gap the replay cannot fill clears the index (rebuilt from what
        follows). Runs until cancelled."""
        import zmq
        import zmq.asyncio

        feed = self.feed
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES + 4096)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, feed.topic.encode())
        sub.connect(feed.endpoint)
        try:
            if feed.replay_endpoint is not None:
                await self._replay(ctx, 0)  # what was announced before we came
            while True:
                try:
                    frames = await _recv(sub, self.silent_s)
                except TimeoutError:
                    # a quiet publisher is not a dead one: an idle pipeline announces
                    # nothing, but its replay socket answers (and hands over any batch
                    # that was lost meanwhile)
                    last = feed.last_seq
                    alive = feed.replay_endpoint is not None and await self._replay(
                        ctx, 0 if last is None else last + 1, probe=True)  # fmt: skip
                    if not alive:
                        feed.connected = False
                    continue
                if len(frames) >= 2 and (len(frames[1]) != 8 or frames[0] != feed.topic.encode()):
                    feed.num_refused += 1
                    continue
                frames = self._signed(frames, "KV-event batch")
                if frames is None:
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                feed.connected, feed.last_heard = True, time.monotonic()
                last = feed.last_seq
                if last is not None and seq <= last:
                    continue  # already applied (from a replay)
                if seq != (0 if last is None else last + 1):
                    answered = False
                    if feed.replay_endpoint is not None:
                        answered = await self._replay(ctx, 0 if last is None else last + 1)
                        last = feed.last_seq
                        if last is not None and seq <= last:
                            continue
                    if seq != (0 if last is None else last + 1):
                        ahead = seq - (-1 if last is None else last)
                        if answered or ahead > MAX_SEQ_JUMP:
                            # the publisher's own replay has nothing that far (it answered
                            # up to its latest), or a jump no stream makes: not its batch
                            feed.num_refused += 1
                            logger.warning("KV events from %s: batch %d refused: the "
                                           "publisher is at %s", feed.endpoint, seq, last)
                            continue
                        self.index.clear()  # missed for good: rebuild from here on
                        feed.num_rebuilds += 1
                self._apply(seq, frames[2])
        finally:
            sub.close(linger=0)
            ctx.term()

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except EventsError as error:
            self.feed.num_refused += 1
            logger.warning("KV events from %s: batch %d refused: %s", self.feed.endpoint, seq,
                           error)  # fmt: skip
            self.index.clear()  # what it said is unknown: start again
            self.feed.num_rebuilds += 1
        else:
            self.index.apply(batch)
        self.feed.last_seq = seq
        self.feed.num_batches += 1

    async def _replay(self, ctx, start: int, *, probe: bool = False) -> bool:
        """Ask for every batch from ``start`` on; apply what comes until its end mark.
        Whether the end mark came (a ``probe`` asks only that, on a quiet stream)."""
        import zmq

        feed = self.feed
        if not probe:
            feed.num_replays += 1
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES + 4096)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(feed.replay_endpoint)
        try:
            await dealer.send_multipart((b"", start.to_bytes(8, "big", signed=True)))
            while True:
                frames = await _recv(dealer, self.replay_timeout_s)
                if len(frames) < 4 or frames[0] != b"" or len(frames[2]) != 8:
                    feed.num_refused += 1
                    continue
                frames = self._signed(frames[1:], "KV-event replay")
                if frames is None:
                    continue
                frames = [b"", *frames]
                seq = int.from_bytes(frames[2], "big", signed=True)
                # an answer, a batch or the end mark: the publisher is there (before the
                # batch is applied, so a reader that sees it applied sees this too)
                feed.connected, feed.last_heard = True, time.monotonic()
                if seq < 0:
                    return True
                last = feed.last_seq
                if last is not None and seq <= last:
                    continue
                self._apply(seq, frames[3])
        except TimeoutError:
            if feed.connected or not probe:  # once per silence, not once per probe
                logger.warning("KV events: no replay answer from %s", feed.replay_endpoint)
            return False
        finally:
            dealer.close(linger=0)


async def _recv(sock, timeout_s: float) -> list[bytes]:
    import zmq

    if not await sock.poll(timeout_s * 1000, zmq.POLLIN):
        raise TimeoutError
    return await sock.recv_multipart()
