"""Least frequently used eviction: the evictable tail used by the fewest requests goes
first (ties: least recently used). Everything else is the default policy."""

import attrs

from wavepp.policy import DEFAULT
from wavepp.state import Eviction, Node


def lfu_key(node: Node) -> tuple[int, int]:
    return (node.uses, node.recency)


LFU = Eviction("lfu", key=lfu_key)
POLICY = attrs.evolve(DEFAULT, name="lfu", eviction=LFU)
