"""Checks that a policy's functions keep the promises they declare (``guarantees_hold``).

The runtime takes a faster path on a declared :class:`wavepp.policy.Guarantee` without
looking further, so a false declaration is a protocol bug: the admission machine runs
every declared promise through these checks on every call.

- ``PLAIN_PROBE``: the answer is the linear walk's (``probe_exact``, checked for every
  probe); that it has no other effect cannot be observed and is the author's word.
- ``ESCROW_WITHIN_ROOM``, ``RECONCILE_ONLY_FREES``: checked around every call
  (:func:`keeping_promises` wraps them).
- ``ARRIVAL_ORDER``, ``EVERY_REFUSAL_BLOCKS``: checked on every round's candidates
  (:func:`check_escrow_order`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import attrs

from wavepp.checker.invariants import check
from wavepp.policy import EscrowCandidate, EscrowOrder, Guarantee, Policy, guarantees_of


def keeping_promises(policy: Policy) -> Policy:
    """``policy`` with its escrow and reconcile checked against what they declare.

    The wrappers keep the declarations (``functools.wraps``), so the runtime's paths
    are the same as with the policy itself."""
    return attrs.evolve(policy, escrow=_checked_escrow(policy.escrow),
                        reconcile=_checked_reconcile(policy.reconcile))  # fmt: skip


def _checked_escrow(escrow):
    if Guarantee.ESCROW_WITHIN_ROOM not in guarantees_of(escrow):
        return escrow

    @functools.wraps(escrow)
    def checked(cache, request_id, num_blocks):
        after, ok = escrow(cache, request_id, num_blocks)
        if num_blocks <= cache.num_backable:
            check(ok, "guarantees_hold",
                  f"escrow declares {Guarantee.ESCROW_WITHIN_ROOM.value} but refused "
                  f"{num_blocks} blocks with {cache.num_backable} backable")  # fmt: skip
            check(after.num_backable == cache.num_backable - num_blocks, "guarantees_hold",
                  f"escrow declares {Guarantee.ESCROW_WITHIN_ROOM.value} but escrowing "
                  f"{num_blocks} blocks took backable room from {cache.num_backable} to "
                  f"{after.num_backable}")  # fmt: skip
        return after, ok

    return checked


def _checked_reconcile(reconcile):
    if Guarantee.RECONCILE_ONLY_FREES not in guarantees_of(reconcile):
        return reconcile

    @functools.wraps(reconcile)
    def checked(cache, request_id, hashes, point):
        after, got = reconcile(cache, request_id, hashes, point)
        check(after.num_backable >= cache.num_backable, "guarantees_hold",
              f"reconcile declares {Guarantee.RECONCILE_ONLY_FREES.value} but took "
              f"backable room from {cache.num_backable} to {after.num_backable}")  # fmt: skip
        return after, got

    return checked


def check_escrow_order(
    escrow_order: EscrowOrder, cands: Sequence[EscrowCandidate], order: Sequence[int]
) -> None:
    """The round's ``order`` (the escrow order's permutation of ``cands``) and its
    ``blocks`` keep what they declare."""
    if Guarantee.ARRIVAL_ORDER in guarantees_of(escrow_order.order):
        arrival = sorted(range(len(cands)), key=lambda i: cands[i].position)
        check(list(order) == arrival, "guarantees_hold",
              f"escrow order {escrow_order.name!r} declares arrival order but tried "
              f"{list(order)} for arrival order {arrival}")  # fmt: skip
    if Guarantee.EVERY_REFUSAL_BLOCKS in guarantees_of(escrow_order.blocks):
        for c in cands:
            check(bool(escrow_order.blocks(c)), "guarantees_hold",
                  f"escrow order {escrow_order.name!r} declares that every refusal "
                  f"blocks but {c.request_id!r} does not block")  # fmt: skip
