"""Which layers each stage holds: by count, or by measured cost (``--layers-per-stage``).

A model of ``L`` layers is ``2L`` **units**: unit ``2i`` is layer ``i``'s mixer (its input
norm, its attention or recurrence, and its cache), unit ``2i + 1`` its MLP (the
post-attention norm and the dense or sparse MLP). A stage holds a contiguous run of units,
so a stage boundary may fall inside a layer, between its mixer and its MLP: only the
residual stream crosses it, as between layers. The model's last layer is one unit to the
placement (on the last stage its outputs are computed for the logits' rows only).

Balanced placement (``auto``) takes each unit's measured time on a typical wave plus the
embedding (stage 0) and the head (last stage) and cuts the units into ``P`` runs whose
slowest is as fast as possible. Cuts between whole layers are preferred unless cutting
inside one makes the slowest stage more than ``HALF_LAYER_GAIN`` faster. Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache

import attrs

HALF_LAYER_GAIN = 0.03  # a cut inside a layer must make the slowest stage 3% faster


class PlacementError(ValueError):
    """``--layers-per-stage`` does not describe a placement of this model."""


@attrs.frozen
class Placement:
    """Units per stage, how they were chosen, and (auto) each stage's predicted seconds."""

    units: tuple[int, ...]  # per stage: units held (2 per whole layer)
    how: str  # "even", "given" or "auto"
    predicted_s: tuple[float, ...] = ()  # auto: each stage's time on the measured wave
    shape: str = ""  # auto: the wave the costs were measured on

    @property
    def spans(self) -> list[range]:
        """Each stage's units as a range over 0..2L-1."""
        out, at = [], 0
        for n in self.units:
            out.append(range(at, at + n))
            at += n
        return out

    @property
    def layers(self) -> tuple[float, ...]:
        """Layers per stage (a half for a stage boundary inside a layer)."""
        return tuple(n / 2 for n in self.units)

    def describe(self) -> str:
        text = ",".join(f"{n / 2:g}" for n in self.units)
        if not self.predicted_s:
            return f"{text} ({self.how})"
        times = ", ".join(f"{t * 1e3:.1f}" for t in self.predicted_s)
        return f"{text} ({self.how}: predicted stage times {times} ms on {self.shape})"

    def as_record(self) -> dict:
        out: dict = {"layers": list(self.layers), "how": self.how}
        if self.predicted_s:
            out["predicted_stage_s"] = list(self.predicted_s)
            out["measured_on"] = self.shape
        return out


def parse_counts(text: str) -> list[float]:
    """``--layers-per-stage`` counts ('13,11,12,12' or '1.5,2.5'): positive multiples of
    one half."""
    try:
        counts = [float(part.strip()) for part in text.split(",")]
    except ValueError:
        raise PlacementError(f"--layers-per-stage {text!r} is not 'auto' or a comma-separated "
                             "list of layer counts") from None  # fmt: skip
    if any(c <= 0 or (2 * c) % 1 for c in counts):
        raise PlacementError(f"--layers-per-stage {text!r}: every stage needs a positive "
                             "count of layers in halves (a half: a layer's mixer or its "
                             "MLP)")  # fmt: skip
    return counts


def even(num_layers: int, stages: int) -> Placement:
    """Whole layers, as even as they go (earlier stages take the remainder)."""
    if num_layers < stages:
        raise PlacementError(f"the model has {num_layers} layers, fewer than the {stages} stages")
    base, extra = divmod(num_layers, stages)
    return Placement(tuple(2 * (base + (s < extra)) for s in range(stages)), "even")


def given(counts: Sequence[float], num_layers: int) -> Placement:
    """The counts of ``--layers-per-stage``, checked against the model."""
    if sum(counts) != num_layers:
        raise PlacementError(f"--layers-per-stage {','.join(f'{c:g}' for c in counts)} sums to "
                             f"{sum(counts):g} layers; the model has {num_layers}")  # fmt: skip
    units = tuple(int(2 * c) for c in counts)
    if len(units) > 1 and units[-1] == 1:
        raise PlacementError("--layers-per-stage: the last stage must hold the model's whole "
                             "last layer (its outputs are computed for the logits' rows only)")
    return Placement(units, "given")


def balanced(mixers: Sequence[float], mlps: Sequence[float], last_layer: float,
             embed: float, head: float, stages: int, halves: bool = True,
             shape: str = "") -> Placement:  # fmt: skip
    """The placement whose slowest stage is fastest, from each layer's measured mixer and
    MLP seconds (all but the model's last layer), the last layer's (as the last stage runs
    it), the embedding's (stage 0) and the head's (last stage)."""
    if len(mixers) != len(mlps):
        raise ValueError(f"{len(mixers)} mixer costs but {len(mlps)} MLP costs")
    num_layers = len(mixers) + 1
    if num_layers < stages:
        raise PlacementError(f"the model has {num_layers} layers, fewer than the {stages} stages")
    # entries: mixer 0, MLP 0, ..., mixer L-2, MLP L-2, the last layer (one entry, 2 units)
    costs = [c for pair in zip(mixers, mlps, strict=True) for c in pair] + [last_layer]
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def span(a: int, b: int, s: int) -> float:
        return prefix[b] - prefix[a] + (embed if s == 0 else 0.0) + (head if s == stages - 1
                                                                      else 0.0)  # fmt: skip

    whole = best_cuts(span, len(costs), stages, whole=True)
    chosen = whole
    if halves:
        cut = best_cuts(span, len(costs), stages, whole=False)
        if cut[0] < whole[0] * (1 - HALF_LAYER_GAIN):
            chosen = cut
    sizes = chosen[1]
    times, at = [], 0
    for s, n in enumerate(sizes):
        times.append(span(at, at + n, s))
        at += n
    units = (*sizes[:-1], sizes[-1] + 1)  # every entry is one unit, the last layer two
    return Placement(units, "auto", tuple(times), shape)


def whole_layers(span: Callable[[int, int, int], float], num_layers: int,
                 stages: int) -> list[int]:  # fmt: skip
    """Layers per stage minimizing the slowest stage, where ``span(a, b, s)`` is stage
    ``s``'s seconds holding layers a..b-1 (the simulator's placement: a stage's time
    from its cost model, which need not be a sum over layers)."""
    if num_layers < stages:
        raise PlacementError(f"the model has {num_layers} layers, fewer than the {stages} stages")
    return list(best_cuts(span, num_layers, stages, whole=False)[1])


def best_cuts(span: Callable[[int, int, int], float], n: int, stages: int,
              whole: bool) -> tuple[float, tuple[int, ...]]:  # fmt: skip
    """(slowest stage's seconds, entries per stage) minimizing the slowest stage over the
    contiguous cuts of entries 0..n-1 into ``stages`` runs, ``span(a, b, s)`` being stage
    ``s``'s seconds holding entries a..b-1; ``whole``: cuts at even entries only."""

    @cache
    def solve(a: int, s: int) -> tuple[float, tuple[int, ...]]:
        # stages s..stages-1 over entries a..n-1
        if s == stages - 1:
            return span(a, n, s), (n - a,)
        best: tuple[float, tuple[int, ...]] = (float("inf"), ())
        for b in range(a + 1, n - (stages - 1 - s) + 1):
            if whole and b % 2:
                continue
            here = span(a, b, s)
            if here >= best[0]:
                continue
            rest, sizes = solve(b, s + 1)
            if max(here, rest) < best[0]:
                best = (max(here, rest), (b - a, *sizes))
        return best

    return solve(0, 0)


@attrs.frozen
class WaveShape:
    """The wave a placement's costs are measured on: ``chunks`` chunks of ``tokens`` new
    tokens, each after ``prefix`` cached ones."""

    chunks: int
    tokens: int
    prefix: int

    def describe(self) -> str:
        return f"{self.chunks} x {self.tokens} new tokens after {self.prefix:,} cached"


def typical_wave(budget: int, prompts: Sequence[tuple[int, int]], block_size: int,
                 default_tokens: int) -> WaveShape:  # fmt: skip
    """The run's typical wave from its prompts' (tokens, reusable tokens): chunks of a
    prompt's mean new tokens (at most the budget) fill the budget, each after the mean
    reused prefix plus half the new tokens it does not cover (where a chunk of a longer
    suffix starts, on average). Without prompts (a server): one prompt of
    ``default_tokens``, cold."""
    if not prompts:
        prompts = [(default_tokens, 0)]
    fresh = sum(max(1, n - reused) for n, reused in prompts) / len(prompts)
    reused = sum(reused for _, reused in prompts) / len(prompts)
    tokens = max(1, min(budget, round(fresh)))
    prefix = int(reused + (fresh - tokens) / 2) // block_size * block_size
    return WaveShape(max(1, budget // tokens), tokens, prefix)
