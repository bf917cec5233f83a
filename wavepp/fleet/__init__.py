"""A fleet of pipelines: KV events in vLLM's format and the index a router keeps of them
(``docs/fleet.md``). ``python -m wavepp.fleet`` launches a fleet (``__main__``).

Importing this package loads neither ZMQ nor torch: the publisher and the subscriber
import pyzmq when they start.
"""

from wavepp.fleet.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventPublisher,
    EventsError,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from wavepp.fleet.index import Feed, ReplicaIndex, subscribe

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
