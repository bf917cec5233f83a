"""What a reducer promises beyond its contract, declared by its author as data.

The runtime takes a faster path only where the function in use declares the promise
that path relies on; it never asks *which* function it was given. A function declares
with the :func:`guarantees` decorator (it sets an attribute, nothing else); one that
declares nothing gets the general path, which is always correct.

``functools.wraps`` copies the declaration with the rest of ``__dict__``, so a wrapper
that only observes (logs, counts) keeps the wrapped function's paths. A wrapper that
changes what the function does must declare again: ``guarantees()`` with nothing
withdraws every promise. ``python -m wavepp.checker`` checks the promises a policy's
functions declare (invariant ``guarantees_hold``); ``docs/policies.md`` lists them.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_ATTRIBUTE = "__wavepp_guarantees__"


class Guarantee(enum.Enum):
    """One promise a function can declare, and the path the runtime takes on it."""

    PLAIN_PROBE = "plain_probe"
    """probe: returns the linear walk's point and has no effect besides, so a rung may
    use its own walk instead (R1 swaps in the linear one)."""

    ESCROW_WITHIN_ROOM = "escrow_within_room"
    """escrow: ``escrow(cache, rid, n)`` holds whenever ``n <= cache.num_backable`` and
    then lowers ``num_backable`` by exactly ``n``. With the next one, a round whose
    stages all have room for every offer's whole prompt skips the escrow collective."""

    RECONCILE_ONLY_FREES = "reconcile_only_frees"
    """reconcile: never lowers ``num_backable`` (it only gives protection up)."""

    ARRIVAL_ORDER = "arrival_order"
    """escrow order's ``order``: the candidates by ``position`` (arrival)."""

    EVERY_REFUSAL_BLOCKS = "every_refusal_blocks"
    """escrow order's ``blocks``: true for every candidate. With ARRIVAL_ORDER this is
    first come, first served: rank 0 stops offering past the first offer that cannot
    fit (``rounds.admission.worth_offering``)."""


def guarantees(*declared: Guarantee) -> Callable[[F], F]:
    """Decorator: ``fn`` promises exactly ``declared`` (nothing: no promise)."""
    promised = frozenset(declared)
    for item in promised:
        if not isinstance(item, Guarantee):
            raise TypeError(f"{item!r} is not a wavepp Guarantee")

    def declare(fn: F) -> F:
        setattr(fn, _ATTRIBUTE, promised)
        return fn

    return declare


def guarantees_of(fn: object) -> frozenset[Guarantee]:
    """What ``fn`` declares it guarantees; empty where it declares nothing."""
    promised = getattr(fn, _ATTRIBUTE, frozenset())
    if not isinstance(promised, frozenset):
        return frozenset()
    return promised
