"""A researcher's own planner and probe, loaded by dotted path in the integration tests."""

import attrs

from wavepp.plan import fill
from wavepp.policy import DEFAULT
from wavepp.state import probe


def tiny_waves(queue, wave_id, ctx):
    """Waves of at most 128 tokens, whatever the budget."""
    return fill(queue, wave_id, min(128, ctx.budget))


def never_reuse(cache, hashes, limit=None):
    """A probe that reports no reuse at all (and checks the real one is callable)."""
    probe(cache, hashes, limit)
    return 0


# A policy whose queued requests always wait for the producer of their prefix (far past
# the recompute bound), so a test exercises the waiting path whatever the machine's speed.
patient = attrs.evolve(DEFAULT, name="patient", in_flight_wait=1e3)
