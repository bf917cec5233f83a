"""BROKEN ON PURPOSE: a size-aware eviction order that forgets leases.

It frees the largest tails first (fewest victims per materialization) and counts a
node's evictable tail as everything below its last child, ignoring the pins that
leases and references put on it, so materialization may evict a block a live request
holds. ``python -m wavepp.checker`` rejects it: ``leased_block_never_evicted``.
"""

import attrs

from wavepp.policy import DEFAULT
from wavepp.state import Eviction, Node


def largest_first(node: Node) -> tuple[int, int]:
    return (-node.num_blocks, node.recency)


def below_last_child(node: Node) -> int:
    if node.node_id == 0:
        return 0
    under_child = max(node.children.values()) if node.children else 0
    return node.num_blocks - under_child  # the bug: node.pins are not consulted


POLICY = attrs.evolve(
    DEFAULT,
    name="broken-evicts-leased",
    eviction=Eviction(
        "largest-first-ignoring-leases", key=largest_first, evictable=below_last_child
    ),
)
