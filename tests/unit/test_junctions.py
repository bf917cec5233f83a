"""The default snapshot placement adds the points where waiting requests branch off."""

from wavepp.policy import ChunkSpan, at_junctions
from wavepp.state import RequestId, empty_cache

HASHES = tuple(range(1, 41))


def span(held, end, shared=(), starts_at_held=False):
    return ChunkSpan(RequestId("p"), HASHES, held, end, ends_request=False, interval=16,
                     starts_at_held=starts_at_held, shared=shared)  # fmt: skip


def test_waiters_branch_points_inside_the_chunk_get_a_snapshot():
    cache = empty_cache(64, has_recurrent=True)
    assert at_junctions(cache, span(4, 20)) == (16,)
    assert at_junctions(cache, span(4, 20, shared=(3, 5, 11, 20, 21))) == (5, 11, 16, 20)
    # a chunk starting right at its held blocks can save the state it resumes from
    assert at_junctions(cache, span(4, 8, shared=(4,), starts_at_held=True)) == (4,)
    assert at_junctions(cache, span(4, 8, shared=(4,))) == ()


def test_attention_only_stages_save_no_snapshot():
    assert at_junctions(empty_cache(64), span(4, 20, shared=(5,))) == ()
