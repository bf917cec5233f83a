"""A router over WavePP replicas (``python -m wavepp.route``; ``docs/fleet.md``).

- :mod:`wavepp.route.policies`: routing policies as functions, by name or ``pkg.mod:fn``;
- :mod:`wavepp.route.replicas`: each replica's state, load, KV-event index and text tree;
- :mod:`wavepp.route.router`: forwarding with retries, idempotent by request id;
- :mod:`wavepp.route.app`: the HTTP app (``/health``, ``/metrics``: ``wavepp_route_*``).
"""

from wavepp.route.policies import (
    DEFAULT_ROUTE_POLICY,
    OVERLAP_SCORE_WEIGHT,
    ROUTE_POLICIES,
    ReplicaView,
    RouteRequest,
    cost_terms,
    dynamo_cost,
    least_load,
    load_route_policy,
    prefix,
    prefix_policy,
    reuse_tokens,
    round_robin,
    text_tree,
)
from wavepp.route.texttree import TextTree

__all__ = [
    "DEFAULT_ROUTE_POLICY",
    "OVERLAP_SCORE_WEIGHT",
    "ROUTE_POLICIES",
    "ReplicaView",
    "RouteRequest",
    "TextTree",
    "cost_terms",
    "dynamo_cost",
    "least_load",
    "load_route_policy",
    "prefix",
    "prefix_policy",
    "reuse_tokens",
    "round_robin",
    "text_tree",
]
