"""KV events in vLLM 0.32's wire format, and the ZMQ publisher rank 0 runs (docs/fleet.md).

The structs are wire-compatible with ``vllm.distributed.kv_events``: a ``KVEventBatch``
is a msgpack array ``[ts, events, data_parallel_rank]``; each event is a msgpack map
tagged by its class name (``{"type": "BlockStored", ...}``), defaults omitted, as vLLM's
``msgspec`` structs encode them. WavePP publishes its chained block hash
(``wavepp.state.hashing``) as vLLM's ``ExternalBlockHash`` int.

:class:`EventPublisher` does what vLLM's ``ZmqEventPublisher`` does: a PUB socket sends
``[topic, seq (8 bytes big-endian), payload]``; a ROUTER socket answers a replay request
``[identity, b"", start_seq]`` with every buffered batch from ``start_seq`` on, then
``[identity, b"", b"", -1 (8 bytes), b""]``. Unlike vLLM's, a replay that reaches back
past the bounded buffer is answered with the current view instead: one batch, tagged with
the latest sequence number, that starts with ``AllBlocksCleared`` and stores every block
announced now — so a subscriber that joins late or missed too much is whole again. One
peer (its address) is answered at most ``REPLAY_BURST`` replays per ``REPLAY_WINDOW_S``;
more are dropped unanswered.

Given the shared secret (``--handoff-secret``, ``wavepp.signing``), every frame the
publisher sends carries one frame more, its signature over the topic, the sequence
number and the payload (:func:`sign_batch`; the end mark too): a subscriber given the
secret applies only what the secret signed. Without it the frames are vLLM's, exactly.
"""

from __future__ import annotations

import contextlib
import queue
import struct
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from typing import Annotated, Any

import msgspec

from wavepp.signing import sign

MAX_BATCH_BYTES = 128 << 20  # one batch's payload; a larger frame is refused undecoded
MAX_EVENTS = 1 << 20  # events in one batch
MAX_BLOCKS = 1 << 20  # block hashes (and their token ids' blocks) in one event
MAX_TOKENS = 1 << 26  # token ids in one BlockStored
MAX_TEXT = 4096  # characters of a string field

Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]
ExternalBlockHash = int | Annotated[bytes, msgspec.Meta(max_length=64)]
#  vLLM's ExternalBlockHash; WavePP publishes ints (its 64-bit chained hashes)
Hashes = Annotated[list[ExternalBlockHash], msgspec.Meta(max_length=MAX_BLOCKS)]

ATTENTION_GROUP = 0  # group_idx of blocks every stage holds
SNAPSHOT_GROUP = 1  # group_idx of a hybrid's reuse points (a snapshot on every L stage)
ATTENTION_KIND = "full_attention"  # vLLM's KVCacheSpecKind values
SNAPSHOT_KIND = "mamba"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the events; tagged ``{"type": "<class name>"}`` as vLLM tags them."""


class BlockStored(KVCacheEvent):
    """Blocks ``block_hashes`` (a run of one chain, parent first) became reusable."""

    block_hashes: Hashes
    parent_block_hash: ExternalBlockHash | None  # the block before the first; None at root
    token_ids: Annotated[list[int], msgspec.Meta(max_length=MAX_TOKENS)]  # of those blocks
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
    lora_id: int | None
    medium: Text | None
    lora_name: Text | None
    extra_keys: Annotated[list[tuple[Any, ...] | None], msgspec.Meta(max_length=MAX_BLOCKS)] | None = None  # noqa: E501
    group_idx: int | None = None  # WavePP: ATTENTION_GROUP, or SNAPSHOT_GROUP (hybrids)
    kv_cache_spec_kind: Text | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: Text | None = None
    ownership: Text | None = None
    session_id: Text | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks ``block_hashes`` are no longer reusable (in group ``group_idx``)."""

    block_hashes: Hashes
    medium: Text | None
    group_idx: int | None = None
    locality: Text | None = None
    ownership: Text | None = None


class AllBlocksCleared(KVCacheEvent):
    """Nothing is reusable any more (and, in a replay, what follows is the whole view)."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: Annotated[list[Event], msgspec.Meta(max_length=MAX_EVENTS)]


class EventsError(ValueError):
    """Bytes that are not a KV-event batch (or a replay frame) of the published schema."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(raw: bytes | bytearray | memoryview) -> KVEventBatch:
    """A publisher's payload as a :class:`KVEventBatch`, or :class:`EventsError`.

    The bytes are untrusted: the size is checked before decoding, every list is bounded,
    and anything that is not exactly the schema is refused.
    """
    if len(raw) > MAX_BATCH_BYTES:
        raise EventsError(f"event batch of {len(raw):,} bytes exceeds {MAX_BATCH_BYTES:,}")
    try:
        return _decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise EventsError(f"not a KV-event batch: {error}") from None


# -- the publisher ------------------------------------------------------------------


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


MAX_REPLAY_BATCHES = 64  # batches one replay request is answered with; more: the view
END_SEQ = seq_bytes(-1)  # the replay's last frame, as vLLM ends it
REPLAY_BURST = 16  # replays one peer is answered within REPLAY_WINDOW_S; more are dropped
REPLAY_WINDOW_S = 10.0
MAX_REPLAY_PEERS = 4096  # peers whose replays are counted (the oldest forgotten first)
DOMAIN = b"wavepp kv-events v1\n"


def batch_body(topic: bytes, seq: bytes, payload: bytes) -> bytes:
    """What a batch's signature covers: the topic (length first), the sequence number
    and the payload."""
    return struct.pack(">I", len(topic)) + topic + seq + payload


def sign_batch(secret: bytes, topic: bytes, seq: bytes, payload: bytes) -> bytes:
    """The signature frame of a batch (or of the replay's end mark)."""
    return sign(secret, DOMAIN, batch_body(topic, seq, payload)).encode()


def stored(hashes: Sequence[int], parent: int | None, tokens: Sequence[int], block_size: int,
           group: int) -> BlockStored:  # fmt: skip
    """A BlockStored as WavePP publishes it: a run of one chain in one group."""
    kind = SNAPSHOT_KIND if group == SNAPSHOT_GROUP else ATTENTION_KIND
    return BlockStored(list(hashes), parent, list(tokens), block_size, None, "CPU", None,
                       group_idx=group, kv_cache_spec_kind=kind)  # fmt: skip


def removed(hashes: Sequence[int], group: int) -> BlockRemoved:
    return BlockRemoved(list(hashes), "CPU", group_idx=group)


class _View:
    """The announced blocks as the published batches leave them: what a replay that
    reaches past the buffer sends instead. Per group: hash -> (parent, token ids)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.groups: dict[int, dict[int, tuple[int | None, tuple[int, ...]]]] = {}

    def apply(self, events: Iterable[Event]) -> None:
        for event in events:
            if isinstance(event, AllBlocksCleared):
                self.groups.clear()
            elif isinstance(event, BlockStored):
                held = self.groups.setdefault(event.group_idx or 0, {})
                size = event.block_size
                parent = event.parent_block_hash
                for i, block in enumerate(event.block_hashes):
                    held[block] = (parent, tuple(event.token_ids[i * size : (i + 1) * size]))
                    parent = block
            else:
                held = self.groups.get(event.group_idx or 0, {})
                for block in event.block_hashes:
                    held.pop(block, None)

    def events(self) -> list[Event]:
        """AllBlocksCleared, then the view as runs of consecutive chain blocks."""
        out: list[Event] = [AllBlocksCleared()]
        for group in sorted(self.groups):
            run: list[int] = []
            tokens: list[int] = []
            first_parent: int | None = None
            for block, (parent, ids) in self.groups[group].items():
                if run and parent != run[-1]:
                    out.append(stored(run, first_parent, tokens, self.block_size, group))
                    run, tokens = [], []
                if not run:
                    first_parent = parent
                run.append(block)
                tokens.extend(ids)
            if run:
                out.append(stored(run, first_parent, tokens, self.block_size, group))
        return out


class EventPublisher:
    """KV-event batches on a ZMQ PUB socket with a replay ROUTER, as vLLM publishes them.

    ``publish`` is cheap and never blocks the caller's loop: it numbers the batch, encodes
    it, keeps it for replay and queues it for a thread that owns the sockets. Both
    endpoints are bound (``tcp://*:5557`` or ``tcp://127.0.0.1:5557``; port 0 takes a
    free one, see :attr:`endpoint`).
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None, *, topic: str = "",
                 block_size: int, buffer_steps: int = 10_000, max_queue: int = 100_000,
                 hwm: int = 100_000, secret: bytes | None = None) -> None:  # fmt: skip
        import zmq

        self._secret = secret
        self._replays: OrderedDict[str, deque[float]] = OrderedDict()  # peer -> answer times
        self.num_replays_dropped = 0  # replay requests over their peer's share

        self._zmq = zmq
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        try:
            self._pub.bind(endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.MAXMSGSIZE, 1024)  # a request is 8 bytes
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as error:
            self._close_sockets()
            raise OSError(f"KV events: cannot bind {endpoint}"
                          f"{' / ' + replay_endpoint if replay_endpoint else ''}: "
                          f"{error}") from None  # fmt: skip
        self.topic = topic
        self._topic = topic.encode()
        self._lock = threading.Lock()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._view = _View(block_size)
        self._queue: queue.Queue[tuple[int, bytes] | None] = queue.Queue(maxsize=max_queue)
        self.last_seq = -1  # the latest batch's sequence number (-1: none yet)
        self.num_dropped = 0  # batches the send queue had no room for (replay has them)
        self._running = True
        self._thread = threading.Thread(target=self._run, name="wavepp-kv-events", daemon=True)
        self._thread.start()

    @property
    def signed(self) -> bool:
        """Whether its batches carry a signature (given the shared secret)."""
        return self._secret is not None

    def publish(self, events: list[Event]) -> int:
        """Send one batch of events; returns its sequence number."""
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0)
        payload = encode_batch(batch)
        with self._lock:
            self.last_seq += 1
            seq = self.last_seq
            self._buffer.append((seq, payload))
            self._view.apply(events)
        try:
            self._queue.put_nowait((seq, payload))
        except queue.Full:  # subscribers see the gap and replay it
            self.num_dropped += 1
        return seq

    def close(self) -> None:
        if not self._running:
            return
        self._running = False
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        self._thread.join(timeout=2.0)
        self._close_sockets()
        self._ctx.term()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)

    def _run(self) -> None:
        while self._running:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                item = self._queue.get(timeout=0.02)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, payload = item
            self._pub.send_multipart(self._frames(seq_bytes(seq), payload), copy=False)

    def _frames(self, seq: bytes, payload: bytes, topic: bytes | None = None) -> tuple:
        """A batch's frames: topic, seq, payload (and its signature, given the secret)."""
        topic = self._topic if topic is None else topic
        if self._secret is None:
            return (topic, seq, payload)
        return (topic, seq, payload, sign_batch(self._secret, topic, seq, payload))

    def _over_share(self, peer: str) -> bool:
        """Whether ``peer`` has had its share of replays lately (and if not, one more)."""
        now = time.monotonic()
        times = self._replays.pop(peer, None) or deque()
        while times and times[0] < now - REPLAY_WINDOW_S:
            times.popleft()
        self._replays[peer] = times  # the latest asker last: the oldest go first
        while len(self._replays) > MAX_REPLAY_PEERS:
            self._replays.popitem(last=False)
        if len(times) >= REPLAY_BURST:
            self.num_replays_dropped += 1
            return True
        times.append(now)
        return False

    def _serve_replay(self) -> None:
        zmq = self._zmq
        try:
            parts = self._replay.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            return
        frames = [part.bytes for part in parts]
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            return  # not a replay request: nothing to answer
        peer = "?"
        with contextlib.suppress(zmq.ZMQError, KeyError):
            peer = parts[-1].get("Peer-Address") or "?"
        if self._over_share(peer):
            return
        client, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
        with self._lock:
            oldest = self._buffer[0][0] if self._buffer else self.last_seq + 1
            many = self.last_seq - max(start, oldest) + 1 > MAX_REPLAY_BATCHES
            # reaching past the buffer, or asking for more than one answer holds: the view
            # (one batch however far back it reaches, so an 8-byte request never costs the
            # whole buffer)
            if (start < oldest or many) and self.last_seq >= 0:
                view = KVEventBatch(ts=time.time(), events=self._view.events(),
                                    data_parallel_rank=0)  # fmt: skip
                replies = [(self.last_seq, encode_batch(view))]
            else:
                replies = [(seq, payload) for seq, payload in self._buffer if seq >= start]
        for seq, payload in replies:
            self._replay.send_multipart((client, b"", *self._frames(seq_bytes(seq), payload)))
        self._replay.send_multipart((client, b"", *self._frames(END_SEQ, b"", b"")))
