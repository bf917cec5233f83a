"""Recompute-cost-aware eviction: a block deep in a long prompt costs more to compute
again (attention over a longer prefix), so evict the tails that end shallowest first;
ties go to the least recently used."""

import attrs

from wavepp.policy import DEFAULT
from wavepp.state import Eviction, Node


def shallow_first(node: Node) -> tuple[int, int]:
    return (node.depth + node.num_blocks, node.recency)


EVICTION = Eviction("recompute-cost", key=shallow_first)
POLICY = attrs.evolve(DEFAULT, name="recompute-cost", eviction=EVICTION)
