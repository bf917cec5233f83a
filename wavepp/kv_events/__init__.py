"""KV events in vLLM's format: the publisher a pipeline's rank 0 runs (``--kv-events``),
the log of cache changes its stages keep, and the index a router keeps of them
(``docs/fleet.md``). The fleet launcher is ``python -m wavepp.fleet``.

Importing this package loads neither ZMQ nor torch: the publisher and the subscriber
import pyzmq when they start.
"""

from wavepp.kv_events.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventPublisher,
    EventsError,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from wavepp.kv_events.index import Feed, ReplicaIndex, subscribe

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventPublisher",
    "EventsError",
    "Feed",
    "KVEventBatch",
    "ReplicaIndex",
    "decode_batch",
    "encode_batch",
    "subscribe",
]
