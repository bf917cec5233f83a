"""Smallest fit first with an aging bound.

Escrows are tried smallest first, so a round admits as many short suffixes as fit; a
refusal blocks nobody, except for a request refused in ``AGING_BOUND`` earlier rounds:
it is tried first, and while it does not fit nothing after it is admitted (the later
offers give their leases up to it, as under FCFS). So no request waits more than
``AGING_BOUND`` rounds behind smaller ones before it is served as under FCFS.
"""

from collections.abc import Sequence

import attrs

from wavepp.policy import DEFAULT, EscrowCandidate, EscrowOrder

AGING_BOUND = 3  # rounds


def aged(candidate: EscrowCandidate) -> bool:
    return candidate.waited >= AGING_BOUND


def smallest_first(candidates: Sequence[EscrowCandidate]) -> list[int]:
    def rank(i: int) -> tuple:
        c = candidates[i]
        if aged(c):
            return (0, c.position, 0)  # aged requests first, oldest first
        return (1, c.need, c.position)

    return sorted(range(len(candidates)), key=rank)


SMALLEST_FIT = EscrowOrder("smallest-fit-aging", order=smallest_first, blocks=aged)
POLICY = attrs.evolve(DEFAULT, name="smallest-fit", escrow_order=SMALLEST_FIT)
