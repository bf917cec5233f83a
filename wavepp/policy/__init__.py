"""Swappable policies (DESIGN §4a): every decision point of the protocol in one record.

A function in the record declares what it promises beyond its field's contract with
``@guarantees(Guarantee...)``; the runtime takes a faster path only on a declared
promise, never by comparing a field to the default.

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
from wavepp.state import Guarantee, guarantees, guarantees_of

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
    "Guarantee",
    "Placement",
    "Policy",
    "PolicyError",
    "always",
    "arrival_order",
    "at_junctions",
    "every_interval_and_end",
    "for_run",
    "for_rung",
    "guarantees",
    "guarantees_of",
    "load_policy",
    "resolve",
    "resolve_eviction",
    "resolve_planner",
    "resolve_probe",
    "with_overrides",
]
