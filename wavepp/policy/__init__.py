"""Swappable policies (DESIGN §4a): every decision point of the protocol in one record.

No torch here. ``python -m wavepp.checker pkg.mod:NAME`` checks a policy against the
protocol's invariants; ``docs/policies.md`` documents every field's contract.
"""

from wavepp.policy.load import (
    EVICTIONS,
    POLICIES,
    PROBES,
    PolicyError,
    for_run,
    for_rung,
    load_policy,
    resolve,
    resolve_eviction,
    resolve_planner,
    resolve_probe,
    with_overrides,
)
from wavepp.policy.record import (
    DEFAULT,
    EDF,
    FCFS,
    ChunkSpan,
    EscrowCandidate,
    EscrowOrder,
    Placement,
    Policy,
    always,
    arrival_order,
    at_junctions,
    every_interval_and_end,
)

__all__ = [
    "DEFAULT",
    "EDF",
    "EVICTIONS",
    "FCFS",
    "POLICIES",
    "PROBES",
    "ChunkSpan",
    "EscrowCandidate",
    "EscrowOrder",
    "Placement",
    "Policy",
    "PolicyError",
    "always",
    "arrival_order",
    "at_junctions",
    "every_interval_and_end",
    "for_run",
    "for_rung",
    "load_policy",
    "resolve",
    "resolve_eviction",
    "resolve_planner",
    "resolve_probe",
    "with_overrides",
]
