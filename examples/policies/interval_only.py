"""Junction snapshots (DESIGN §4a): besides every interval and the request's end, save
a snapshot where the request leaves the cached path — the block count up to which the
stage already caches its prefix — so the next sibling request resumes there instead of
at the last interval point below it."""

import attrs

from wavepp.policy import DEFAULT, ChunkSpan, every_interval_and_end
from wavepp.state import StageCache, attention_hit


def with_junction(cache: StageCache, span: ChunkSpan) -> tuple[int, ...]:
    points = set(every_interval_and_end(cache, span))
    if cache.has_recurrent:
        hit = attention_hit(cache, span.hashes)
        if span.held < hit <= span.end_blocks:
            points.add(hit)
    return tuple(sorted(points))


POLICY = attrs.evolve(DEFAULT, name="junction", snapshot_placement=with_junction)
