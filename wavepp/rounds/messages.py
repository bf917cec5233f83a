"""Typed messages between ranks and their codec: no Python objects cross ranks.

Every message is a frozen ``msgspec.Struct`` encoded as msgpack. Bytes from a peer
are input, not objects: :func:`decode_untrusted` checks the size first, decodes into
exactly the expected type (with bounds on every field), and raises ``CodecError`` for
anything else — never a crash, never an unbounded allocation.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
import numpy as np

from wavepp.ids import MAX_ID_CHARS

MAX_MESSAGE_BYTES = 64 << 20  # one round or wave descriptor; more is refused undecoded
MAX_ENTRIES = 65_536  # requests in one round / chunks in one wave
MAX_STAGES = 4096  # pipeline stages
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=1e9)]
MAX_HASH_BYTES = 8 << 22  # 4M blocks: a 268M-token prompt at block 64
MAX_ADDRESS_CHARS = 4096  # a handoff target: unix:/path, tcp://host:port, pull:

Count = Annotated[int, msgspec.Meta(ge=0, le=2**62)]
Id = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]
Mask = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


class CodecError(ValueError):
    """Bytes from a peer that are not a valid message of the expected type."""


class _Msg(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag=True):
    pass


# -- rounds plane (rank 0 -> all, by broadcast) ---------------------------------------


class AdmitEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One request offered to an admission round."""

    request_id: Id
    num_tokens: Annotated[int, msgspec.Meta(ge=1, le=2**40)]  # whole prompt length
    hashes: Annotated[bytes, msgspec.Meta(max_length=MAX_HASH_BYTES)]  # packed <u8 block hashes
    probe_limit: Count  # reuse point cap in blocks: leaves ≥ 1 token to compute
    handoff: Annotated[str, msgspec.Meta(max_length=MAX_ADDRESS_CHARS)] = ""
    #  where every stage sends its band of the request's cache when it ends ("": nowhere)


class AdmitRound(_Msg, frozen=True):
    """Open one admission round over these requests, in FCFS order."""

    round_id: Count
    entries: Annotated[list[AdmitEntry], msgspec.Meta(max_length=MAX_ENTRIES)]
    anchors: Annotated[list[Count], msgspec.Meta(max_length=MAX_ENTRIES)] = []
    #  rank 0's probe point of each entry: the round's first mask window ends there
    #  (``rounds.admission.window_tops`` checks them); empty: at each probe limit


class Heartbeat(_Msg, frozen=True):
    """Rank 0 is alive and has nothing to admit."""

    round_id: Count


class Stop(_Msg, frozen=True):
    """The run is over; ``reason`` is logged."""

    round_id: Count
    reason: Annotated[str, msgspec.Meta(max_length=4096)]


RoundMessage = AdmitRound | Heartbeat | Stop
# Cancels never travel on the rounds plane: they ride with the next wave
# (``WaveMsg.cancels``), so every stage drops a request after its chunks in flight.


# -- data plane (stage s -> s+1, and last stage -> rank 0) ----------------------------


class ChunkMsg(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    request_id: Id
    start: Count
    end: Count
    num_tokens: Count
    free: bool  # warm-up work: executed for its cache effects, not charged or measured
    shared: Annotated[list[Count], msgspec.Meta(max_length=MAX_ENTRIES)] = []
    #  block counts in this chunk where queued requests waiting for it branch off its
    #  path: recurrent stages save a snapshot there (DESIGN §4b)


class OracleAdmit(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Oracle rung only: an admission decided on rank 0, applied by every stage for free."""

    entry: AdmitEntry
    point: Count  # agreed reuse point in blocks


class HandoffOutcome(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """How one stage's band of a request's cache went (``wavepp.handoff.send``)."""

    request_id: Id
    stage: Count
    ok: bool  # the receiver acknowledged the band (or its files were written)
    reason: Annotated[str, msgspec.Meta(max_length=64)]  # "" when ok; else one of REASONS
    detail: Annotated[str, msgspec.Meta(max_length=1024)]  # the error, for the result
    num_bytes: Count  # tensor bytes sent
    seconds: Seconds  # from the request's last chunk here to the acknowledgement
    ended_at: Annotated[float, msgspec.Meta(ge=0.0, le=1e12)] = 0.0  # wall clock of that last chunk
    wire_s: Seconds = 0.0  # of ``seconds``, on the wire: connect to the ack received (the
    #                        rest is queueing and setup: the budget, the band's layout)


MAX_REPORT_HASHES = 1 << 20  # block hashes in one stage's CacheReport (8 MiB packed)


class CacheReport(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """One stage's cache changes since its last report, for rank 0's KV events
    (``wavepp.kv_events.changes``; docs/fleet.md). Every list is packed <u8 block hashes; each
    entry is a transition of the stage's reported view (stored: was not in it, is now),
    so rank 0 can count, per block, the stages that hold it."""

    stage: Count
    recurrent: bool  # the stage has L layers: its reuse points need a snapshot
    stored: Annotated[bytes, msgspec.Meta(max_length=MAX_REPORT_HASHES * 8)]  # blocks cached
    removed: Annotated[bytes, msgspec.Meta(max_length=MAX_REPORT_HASHES * 8)]  # blocks evicted
    snapshots_stored: Annotated[bytes, msgspec.Meta(max_length=MAX_REPORT_HASHES * 8)]
    #  blocks h_{k-1} after which the stage now holds a recurrent snapshot (the state at k)
    snapshots_removed: Annotated[bytes, msgspec.Meta(max_length=MAX_REPORT_HASHES * 8)]


class WaveMsg(_Msg, frozen=True):
    """A wave's descriptor; its activations follow as a tensor."""

    wave_id: Count
    budget: Count
    chunks: Annotated[list[ChunkMsg], msgspec.Meta(max_length=MAX_ENTRIES)]
    oracle: Annotated[list[OracleAdmit], msgspec.Meta(max_length=MAX_ENTRIES)] = []
    stop: bool = False  # no chunks: the run is over, forward and exit
    cancels: Annotated[list[Id], msgspec.Meta(max_length=MAX_ENTRIES)] = []
    #  requests to drop on every stage after this wave's chunks (none of theirs follow)
    stage_s: Annotated[list[Seconds], msgspec.Meta(max_length=MAX_STAGES)] = []
    #  wall seconds each stage so far spent on this wave: cache effects + executor
    cache: Annotated[list[CacheReport], msgspec.Meta(max_length=MAX_STAGES)] = []
    #  with --kv-events: cache changes of stages 1.. since their last wave, on to rank 0


class HandoffRelay(_Msg, frozen=True):
    """Stages 1.. -> rank 0 between waves, along the same links: bands that settled, sent
    the moment they do and passed on at once by every stage after (each adding its own),
    so that a request ends when its last band is acknowledged, not when a wave next
    passes that stage and the rest of the pipeline."""

    handoffs: Annotated[list[HandoffOutcome], msgspec.Meta(max_length=MAX_ENTRIES)]


class Finished(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    request_id: Id
    cached_tokens: Count  # tokens reused from the cache (reuse point × block size)
    first_token: Annotated[int, msgspec.Meta(ge=-1)]  # argmax of the last logits; -1 if simulated
    top_logit: float


class WaveDone(_Msg, frozen=True):
    """Last stage -> rank 0: a wave left the pipeline."""

    wave_id: Count
    finished: Annotated[list[Finished], msgspec.Meta(max_length=MAX_ENTRIES)]
    stop: bool = False  # the stop wave reached the last stage: no more will come
    cancelled: Annotated[list[Id], msgspec.Meta(max_length=MAX_ENTRIES)] = []
    stage_s: Annotated[list[Seconds], msgspec.Meta(max_length=MAX_STAGES)] = []
    #  wall seconds every stage spent on the wave (the cost planner's measurements)
    cache: Annotated[list[CacheReport], msgspec.Meta(max_length=MAX_STAGES)] = []
    #  cache changes of stages 1..P-1 (WaveMsg.cache plus the last stage's own)


class Span(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """One wave on one stage, for the timeline (wall-clock seconds)."""

    wave_id: Count
    start: float
    end: float
    num_tokens: Count
    free: bool


class StageReport(_Msg, frozen=True):
    """Each stage's figures at the end of a run, gathered on rank 0."""

    stage: Count
    busy_s: float  # executor time of measured waves
    first_start: float  # wall clock (time.time) of the first measured wave
    last_end: float
    num_waves: Count
    probe_us: list[float]  # sampled hint-probe latencies
    leases: Count
    escrowed: Count
    referenced: Count
    pending: Count
    cached: Count
    free: Count
    capacity: Count
    balanced: bool
    error: str = ""
    spans: Annotated[list[Span], msgspec.Meta(max_length=1 << 20)] = []  # with --trace-out
    snapshots: Count = 0  # recurrent-state snapshots cached in the snapshot pool
    snapshot_pending: Count = 0  # snapshot slots reserved and not published
    snapshot_pinned: Count = 0  # snapshots a claim resumes from
    snapshot_capacity: Count = 0
    kv_bytes: Count = 0  # the stage's KV pool (K/V or latent entries), bytes
    snapshot_bytes: Count = 0  # its snapshot pool, bytes


DataMessage = WaveMsg | WaveDone | HandoffRelay

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[object, msgspec.msgpack.Decoder] = {}


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_untrusted(data: bytes | bytearray | memoryview, kind: object):
    """Decode a peer's bytes into ``kind`` (a message type or union), or raise CodecError."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise CodecError(f"message of {len(data):,} bytes exceeds {MAX_MESSAGE_BYTES:,}")
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.msgpack.Decoder(kind)
    try:
        message = decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise CodecError(f"bad message from peer: {error}") from None
    for entry in getattr(message, "entries", ()):
        if len(entry.hashes) % 8:
            raise CodecError(f"hashes of {entry.request_id!r} are {len(entry.hashes)} bytes")
    for report in getattr(message, "cache", ()):
        for packed in (report.stored, report.removed, report.snapshots_stored,
                       report.snapshots_removed):  # fmt: skip
            if len(packed) % 8:
                raise CodecError(f"stage {report.stage}'s cache report has a list of "
                                 f"{len(packed)} bytes, not whole uint64s")  # fmt: skip
    return message


def pack_hashes(hashes: tuple[int, ...]) -> bytes:
    return np.asarray(hashes, dtype="<u8").tobytes()


def unpack_hashes(data: bytes) -> tuple[int, ...]:
    if len(data) % 8:
        raise CodecError(f"packed hashes of {len(data)} bytes are not whole uint64s")
    return tuple(np.frombuffer(data, dtype="<u8").tolist())
