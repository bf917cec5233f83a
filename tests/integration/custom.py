"""A researcher's own planner and probe, loaded by dotted path in the integration tests."""

from wavepp.plan import fill
from wavepp.state import probe


def tiny_waves(queue, wave_id, ctx):
    """Waves of at most 128 tokens, whatever the budget."""
    return fill(queue, wave_id, min(128, ctx.budget))


def never_reuse(cache, hashes, limit=None):
    """A probe that reports no reuse at all (and checks the real one is callable)."""
    probe(cache, hashes, limit)
    return 0
