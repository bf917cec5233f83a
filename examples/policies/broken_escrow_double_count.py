"""BROKEN ON PURPOSE: an escrow that counts a slot twice.

It backs escrows with ``capacity - protected - escrowed`` and forgets the slots already
materialized for running requests, so a slot handed to one request backs another's
escrow too. ``python -m wavepp.checker`` rejects it: ``escrow_backed``.
"""

import attrs

from wavepp.policy import DEFAULT
from wavepp.state import RequestId, StageCache


def escrow_double_count(
    cache: StageCache, request_id: RequestId, num_blocks: int
) -> tuple[StageCache, bool]:
    claim = cache.claims[request_id]
    backable = cache.capacity - cache.num_protected - cache.num_escrowed  # the bug
    if num_blocks > backable:
        return cache, False
    claims = cache.claims.set(
        request_id, attrs.evolve(claim, num_escrowed=claim.num_escrowed + num_blocks)
    )
    return (
        attrs.evolve(
            cache,
            claims=claims,
            num_escrowed=cache.num_escrowed + num_blocks,
            clock=cache.clock + 1,
        ),
        True,
    )


POLICY = attrs.evolve(DEFAULT, name="broken-escrow-double-count", escrow=escrow_double_count)
