"""Placement of layers over stages (wavepp.plan.placement): a balanced placement is a
valid cut of the model's units, and no other cut has a faster slowest stage."""

import itertools

import pytest
from hypothesis import given as hypothesis_given
from hypothesis import settings
from hypothesis import strategies as st

from wavepp.plan.placement import (
    HALF_LAYER_GAIN,
    PlacementError,
    balanced,
    even,
    given,
    parse_counts,
    typical_wave,
    whole_layers,
)

costs = st.floats(0.0, 10.0, allow_nan=False)


def _slowest(units, mixers, mlps, last, embed, head) -> float:
    """The slowest stage's seconds of a placement given as units per stage."""
    per_unit = [c for pair in zip(mixers, mlps, strict=True) for c in pair] + [last / 2] * 2
    times, at = [], 0
    for s, n in enumerate(units):
        times.append(sum(per_unit[at : at + n]) + (embed if s == 0 else 0)
                     + (head if s == len(units) - 1 else 0))  # fmt: skip
        at += n
    return max(times)


def _valid_cuts(num_layers: int, stages: int, halves: bool):
    """Every placement a balanced one may choose: contiguous, each stage ≥ 1 unit, the
    last stage holding the whole last layer."""
    total = 2 * num_layers
    inner = range(1, total - 1) if halves else range(2, total - 1, 2)
    for cuts in itertools.combinations(inner, stages - 1):
        bounds = (0, *cuts, total)
        yield tuple(b - a for a, b in itertools.pairwise(bounds))


@settings(max_examples=200, deadline=None)
@hypothesis_given(st.integers(1, 6).flatmap(lambda n: st.tuples(
    st.lists(costs, min_size=n, max_size=n), st.lists(costs, min_size=n, max_size=n),
    costs, costs, costs, st.integers(1, n + 1))))  # fmt: skip
def test_balanced_is_a_valid_cut_no_other_cut_beats(case):
    mixers, mlps, last, embed, head, stages = case
    num_layers = len(mixers) + 1
    p = balanced(mixers, mlps, last, embed, head, stages)
    assert len(p.units) == stages and sum(p.units) == 2 * num_layers
    assert min(p.units) >= 1 and p.units[-1] >= 2
    slowest = _slowest(p.units, mixers, mlps, last, embed, head)
    assert max(p.predicted_s) == pytest.approx(slowest)
    best_whole = min(_slowest(u, mixers, mlps, last, embed, head)
                     for u in _valid_cuts(num_layers, stages, False))  # fmt: skip
    best_any = min(_slowest(u, mixers, mlps, last, embed, head)
                   for u in _valid_cuts(num_layers, stages, True))  # fmt: skip
    # whole layers unless a cut inside one is more than HALF_LAYER_GAIN faster
    assert slowest == pytest.approx(best_whole) or slowest == pytest.approx(best_any)
    assert slowest <= best_whole * (1 - HALF_LAYER_GAIN) + 1e-9 or all(
        u % 2 == 0 for u in p.units
    )
    assert slowest <= best_whole + 1e-9
    if best_any < best_whole * (1 - HALF_LAYER_GAIN):  # a cut inside a layer pays: taken
        assert slowest == pytest.approx(best_any)
    whole_only = balanced(mixers, mlps, last, embed, head, stages, halves=False)
    assert all(u % 2 == 0 for u in whole_only.units)
    assert max(whole_only.predicted_s) == pytest.approx(best_whole)


@settings(max_examples=100, deadline=None)
@hypothesis_given(st.lists(costs, min_size=1, max_size=7), st.integers(1, 7), costs)
def test_whole_layers_minimizes_the_slowest_stage(layer_costs, stages, head):
    n = len(layer_costs)
    if stages > n:
        with pytest.raises(PlacementError):
            whole_layers(lambda a, b, s: 0.0, n, stages)
        return

    def span(a: int, b: int, s: int) -> float:
        return sum(layer_costs[a:b]) + (head if s == stages - 1 else 0.0)

    counts = whole_layers(span, n, stages)
    assert len(counts) == stages and sum(counts) == n and min(counts) >= 1

    def slowest(counts) -> float:
        starts = list(itertools.accumulate(counts[:-1], initial=0))
        return max(span(a, a + c, s) for s, (a, c) in enumerate(zip(starts, counts, strict=True)))

    best = min(slowest(tuple(b - a for a, b in itertools.pairwise((0, *cuts, n))))
               for cuts in itertools.combinations(range(1, n), stages - 1))  # fmt: skip
    assert slowest(counts) == pytest.approx(best)


def test_a_short_last_stage_is_balanced_by_cutting_inside_a_layer():
    # The vllm_compare Llama on its short-suffix wave (one thread, ms): 2/2 leaves the
    # last stage at 66% of the first; a cut after layer 1's mixer evens them (95%).
    p = balanced([171.0] * 3, [73.0] * 3, 60.0, 1.0, 17.0, 2)
    assert p.units == (3, 5) and p.layers == (1.5, 2.5)
    assert min(p.predicted_s) / max(p.predicted_s) > 0.9
    assert balanced([171.0] * 3, [73.0] * 3, 60.0, 1.0, 17.0, 2, halves=False).units == (4, 4)


def test_even_and_given_placements():
    assert even(10, 4).units == (6, 6, 4, 4)
    assert given(parse_counts("1.5, 2.5"), 4).units == (3, 5)
    for text, problem in (("2,x", "not 'auto'"), ("1.25,2.75", "halves"), ("0,4", "positive")):
        with pytest.raises(PlacementError, match=problem):
            parse_counts(text)
    with pytest.raises(PlacementError, match="sums to 5"):
        given([2, 3], 4)
    with pytest.raises(PlacementError, match="whole last layer"):
        given([3.5, 0.5], 4)
    with pytest.raises(PlacementError, match="fewer than"):
        even(2, 4)


def test_typical_wave():
    # 128 prompts of 4,096 tokens reusing 3,840: chunks of 256 fill a budget of 2,048
    w = typical_wave(2048, [(4096, 3840)] * 128, 16, 2048)
    assert (w.chunks, w.tokens, w.prefix) == (8, 256, 3840)
    # cold 4,096-token prompts in waves of 512: one chunk, on average 1,792 tokens in
    w = typical_wave(512, [(4096, 0)] * 4, 16, 2048)
    assert (w.chunks, w.tokens, w.prefix) == (1, 512, 1792)
    # a server: one cold prompt of the default length
    assert typical_wave(2048, [], 16, 1024).tokens == 1024
