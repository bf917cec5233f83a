"""The state core: immutable cache tables and the pure reducers of admission.

No torch and no I/O here. Every reducer returns a new value and leaves its
input untouched; see DESIGN §2–§4 for the protocol these functions implement.
"""

from wavepp.state.audit import Usage, audit, usage
from wavepp.state.cache import (
    LRU,
    Claim,
    Eviction,
    Node,
    Snapshot,
    StageCache,
    empty_cache,
    lru_key,
    tail_evictable,
)
from wavepp.state.errors import InvariantError, StateError, UnknownRequest
from wavepp.state.guarantees import Guarantee, guarantees, guarantees_of
from wavepp.state.hashing import (
    ROOT_SEED,
    as_tokens,
    block_hashes,
    extend_block_hashes,
    num_blocks_for,
)
from wavepp.state.ids import ROOT, BlockHash, NodeId, RequestId, SlotId
from wavepp.state.inflight import InFlight, empty_inflight
from wavepp.state.probe import (
    MASK_WIDTH,
    attention_hit,
    longest_prefix,
    point_from_mask,
    probe,
    probe_linear,
    reuse_mask,
    snapshot_floor,
    snapshot_floor_linear,
)
from wavepp.state.reducers import (
    Materialized,
    SnapshotReservation,
    agree,
    block_table,
    can_ever_fit,
    cancel,
    escrow,
    lease,
    materialize,
    publish,
    reconcile,
    release,
    reserve_snapshots,
    resume_slot,
)

__all__ = [
    "LRU",
    "MASK_WIDTH",
    "ROOT",
    "ROOT_SEED",
    "BlockHash",
    "Claim",
    "Eviction",
    "Guarantee",
    "InFlight",
    "InvariantError",
    "Materialized",
    "Node",
    "NodeId",
    "RequestId",
    "SlotId",
    "Snapshot",
    "SnapshotReservation",
    "StageCache",
    "StateError",
    "UnknownRequest",
    "Usage",
    "agree",
    "as_tokens",
    "attention_hit",
    "audit",
    "block_hashes",
    "block_table",
    "can_ever_fit",
    "cancel",
    "empty_cache",
    "empty_inflight",
    "escrow",
    "extend_block_hashes",
    "guarantees",
    "guarantees_of",
    "lease",
    "longest_prefix",
    "lru_key",
    "materialize",
    "num_blocks_for",
    "point_from_mask",
    "probe",
    "probe_linear",
    "publish",
    "reconcile",
    "release",
    "reserve_snapshots",
    "resume_slot",
    "reuse_mask",
    "snapshot_floor",
    "snapshot_floor_linear",
    "tail_evictable",
    "usage",
]
