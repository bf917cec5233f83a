"""The protocol's invariants by name (DESIGN §4), and the error that reports one broken.

Each invariant has its own :class:`Violation` subclass, so Hypothesis shrinks and
reports every broken invariant separately (it tells failures apart by their type).
"""

from __future__ import annotations

INVARIANTS: dict[str, str] = {
    # the state core
    "leased_block_never_evicted": "a leased or referenced block is never evicted",
    "materialize_never_fails": (
        "materializing an admitted request's escrow never fails and yields exactly the "
        "escrowed slots"
    ),
    "victims_in_eviction_order": (
        "materialization evicts only when no slot is free, starting with the tail of the "
        "node the eviction order puts first"
    ),
    "escrow_backed": "the sum of escrows never exceeds what free + evictable blocks can back",
    "reconcile_monotone": (
        "reuse points never rise (probe -> lease -> agreed point) and every stage serves "
        "the agreed point exactly"
    ),
    "probe_exact": "the probe equals a linear walk on every prefix-closed cache",
    "cache_matches_model": (
        "the cached set equals a plain reference model, stays prefix-closed, and keeps "
        "every held block"
    ),
    "accounting_consistent": "audit(): tree, index, pins, slot pools and counters agree",
    "balanced_when_idle": (
        "after every request ends: zero leases, escrows, references, pending KV and "
        "snapshot slots; every slot free or cached"
    ),
    "reducers_pure": "reducers never mutate their inputs",
    # snapshots
    "leased_snapshot_kept": "the snapshot at a live claim's lease point is never evicted",
    "snapshot_placement_in_range": (
        "snapshot placement picks block counts inside the chunk's unpublished range, and "
        "reservation hands out a slot per reserved point"
    ),
    # the round
    "admitted_only_if_escrowed": (
        "an admitted request holds its whole escrow on every stage; a refused one holds "
        "nothing anywhere"
    ),
    "escrow_order_contract": (
        "the escrow order is a permutation and nobody after a blocking refusal is admitted"
    ),
    # what the policy's functions declare
    "guarantees_hold": (
        "every promise a policy's function declares (wavepp.policy.Guarantee) holds: the "
        "runtime takes faster paths on them"
    ),
    # the planner
    "plan_within_budget": "every wave has 1..budget tokens and a budget within the run's M",
    "plan_in_order": "a request's chunks are consecutive and in order, each ≥ 1 token",
    "plan_covers_every_token": "every admitted token is planned exactly once",
    # anything else a policy raised
    "no_unexpected_error": "a policy's functions raise nothing on a valid protocol step",
}


class Violation(Exception):
    """An invariant of the protocol broken by the policy under test."""

    invariant = ""

    def __str__(self) -> str:
        return f"{self.invariant}: {self.args[0] if self.args else ''}"


VIOLATIONS: dict[str, type[Violation]] = {
    name: type(f"Violated_{name}", (Violation,), {"invariant": name}) for name in INVARIANTS
}


def violated(name: str, detail: str) -> Violation:
    """The exception to raise for a broken invariant ``name``."""
    return VIOLATIONS[name](detail)


def check(condition: bool, name: str, detail: str) -> None:
    if not condition:
        raise violated(name, detail)
