"""Which layers each stage holds: by count, or by measured cost (``--layers-per-stage``).

A model of ``L`` layers is ``2L`` **units**: unit ``2i`` is layer ``i``'s mixer (its input
norm, its attention or recurrence, and its cache), unit ``2i + 1`` its MLP (the
post-attention norm and the dense or sparse MLP). A stage holds a contiguous run of units,
so a stage boundary may fall inside a layer, between its mixer and its MLP: only the
residual stream crosses it, as between layers. The model's last layer is one unit to the
placement (on the last stage its outputs are computed for the logits' rows only).

A stage boundary may also fall inside an attention mixer: the two stages **share** it.
Both hold the mixer's weights and store every token's keys and values (its cache is
whole on each), and each computes the outputs of some of the wave's rows: the earlier
stage the first rows, up to its **share** of the rows' attention work, the later the rest
(``wavepp.exec.torch_exec``). The shared unit counts to the earlier stage's units, and
the earlier stage hands its cache on. A layer count with a fraction that is not a half
places such a boundary: ``1.3,2.7`` puts 2.6 units on stage 0, so stage 0 shares unit 2
(layer 1's mixer) and runs 60% of its work.

Balanced placement (``auto``) takes each unit's measured time on a typical wave plus the
embedding (stage 0) and the head (last stage) and cuts the units into ``P`` runs whose
slowest is as fast as possible. Cuts between whole layers are preferred unless cutting
inside one makes the slowest stage more than ``HALF_LAYER_GAIN`` faster; sharing a mixer,
given the mixers that can be shared and what each costs with no rows of its own, is
taken when it makes the slowest stage ``SHARE_GAIN`` faster still. Pure: no torch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from functools import cache

import attrs

HALF_LAYER_GAIN = 0.03  # a cut inside a layer must make the slowest stage 3% faster
SHARE_GAIN = 0.03  # a shared mixer must make the slowest stage 3% faster still
MIN_SHARE = 0.05  # a share is kept between 5% and 95% of the mixer's work
_UNIT_SLACK = 1e-4  # given counts: a boundary this close to a whole unit is on it


class PlacementError(ValueError):
    """``--layers-per-stage`` does not describe a placement of this model."""


@attrs.frozen
class Placement:
    """Units per stage, how they were chosen, and (auto) each stage's predicted seconds."""

    units: tuple[int, ...]  # per stage: units held (2 per whole layer; a shared one counts
    # to the earlier stage)
    how: str  # "even", "given" or "auto"
    predicted_s: tuple[float, ...] = ()  # auto: each stage's time on the measured wave
    shape: str = ""  # auto: the wave the costs were measured on
    # per boundary between stages s and s + 1: 0.0, or the share of the mixer the two
    # share (stage s's last unit) that stage s runs; () when no mixer is shared
    shares: tuple[float, ...] = ()

    def __attrs_post_init__(self) -> None:
        if self.shares and len(self.shares) != len(self.units) - 1:
            raise ValueError(f"{len(self.shares)} shares for {len(self.units)} stages")
        for s, share in enumerate(self.shares):
            end = sum(self.units[: s + 1])  # stage s's units end before this one
            if share and not (0.0 < share < 1.0 and end % 2 == 1):
                raise PlacementError(f"stage {s} cannot share unit {end - 1} at {share}: only "
                                     "a layer's mixer (an even unit) can be shared, at a share "
                                     "strictly between 0 and 1")  # fmt: skip

    def share(self, boundary: int) -> float:
        """The earlier stage's share of the mixer on ``boundary`` (0.0: none shared)."""
        return self.shares[boundary] if self.shares else 0.0

    def shared_first(self, stage: int) -> float | None:
        """The share that cuts the mixer ``stage`` shares with the stage before, if any."""
        return (self.share(stage - 1) or None) if stage else None

    def shared_last(self, stage: int) -> float | None:
        """The share that cuts the mixer ``stage`` shares with the stage after, if any."""
        return (self.share(stage) or None) if stage < len(self.units) - 1 else None

    @property
    def spans(self) -> list[range]:
        """Each stage's units as a range over 0..2L-1 (a shared mixer in both stages')."""
        out, at = [], 0
        for s, n in enumerate(self.units):
            back = 1 if self.shared_first(s) else 0
            out.append(range(at - back, at + n))
            at += n
        return out

    @property
    def layers(self) -> tuple[float, ...]:
        """Layers per stage (a half for a stage boundary inside a layer, a share of a
        mixer for one inside a mixer)."""
        out = []
        for s, n in enumerate(self.units):
            last, first = self.shared_last(s), self.shared_first(s)
            units = n - (1 - last if last else 0) + (1 - first if first else 0)
            out.append(round(units / 2, 6))
        return tuple(out)

    def describe(self) -> str:
        text = ",".join(f"{n:g}" for n in self.layers)
        sharing = "".join(f"; layer {(sum(self.units[: b + 1]) - 1) // 2}'s attention shared "
                          f"{share:.2f} / {1 - share:.2f} by stages {b} and {b + 1}"
                          for b, share in enumerate(self.shares) if share)  # fmt: skip
        if not self.predicted_s:
            return f"{text} ({self.how}{sharing})"
        times = ", ".join(f"{t * 1e3:.1f}" for t in self.predicted_s)
        return f"{text} ({self.how}: predicted stage times {times} ms on {self.shape}{sharing})"

    def as_record(self) -> dict:
        out: dict = {"layers": list(self.layers), "how": self.how}
        if any(self.shares):
            out["shared_mixers"] = [{"stages": [b, b + 1], "layer": (sum(self.units[: b + 1]) - 1)
                                     // 2, "share": share}
                                    for b, share in enumerate(self.shares) if share]  # fmt: skip
        if self.predicted_s:
            out["predicted_stage_s"] = list(self.predicted_s)
            out["measured_on"] = self.shape
        return out


def share_row(spans: Sequence[tuple[int, int]], share: float, per_row: int = 0) -> int:
    """The row ``m`` that cuts a shared mixer's rows for a wave of chunks ``spans``
    (each chunk's new tokens ``start..end-1``, rows in that order): the earlier stage runs
    rows ``0..m-1``, the later the rest. A row at position ``p`` weighs ``p + 1 +
    per_row`` (the keys it attends to, plus its other per-row work in keys' worth), and
    ``m`` is the first row at which the weights before it reach ``share`` of the wave's.
    Integer sums of the chunks' positions and ``share``, so every rank computes the same
    ``m``; the executor and the simulator both cut by it."""

    def weight(start: int, rows: int) -> int:  # rows start..start+rows-1
        return rows * (2 * start + rows + 1) // 2 + per_row * rows

    total = sum(weight(s, e - s) for s, e in spans)
    target, before, at = share * total, 0, 0
    for s, e in spans:
        here = weight(s, e - s)
        if before + here >= target and e > s:
            lo, hi = 0, e - s  # the fewest rows j of this chunk with before + weight >= target
            while lo < hi:
                mid = (lo + hi) // 2
                if before + weight(s, mid) >= target:
                    hi = mid
                else:
                    lo = mid + 1
            return at + lo
        before += here
        at += e - s
    return at


def parse_counts(text: str) -> list[float]:
    """``--layers-per-stage`` counts ('13,11,12,12', '1.5,2.5', or '1.3,2.7' with a mixer
    shared): positive numbers."""
    try:
        counts = [float(part.strip()) for part in text.split(",")]
    except ValueError:
        raise PlacementError(f"--layers-per-stage {text!r} is not 'auto' or a comma-separated "
                             "list of layer counts") from None  # fmt: skip
    if any(not c > 0 or c == float("inf") for c in counts):
        raise PlacementError(f"--layers-per-stage {text!r}: every stage needs a positive "
                             "count of layers")  # fmt: skip
    return counts


def even(num_layers: int, stages: int) -> Placement:
    """Whole layers, as even as they go (earlier stages take the remainder)."""
    if num_layers < stages:
        raise PlacementError(f"the model has {num_layers} layers, fewer than the {stages} stages")
    base, extra = divmod(num_layers, stages)
    return Placement(tuple(2 * (base + (s < extra)) for s in range(stages)), "even")


def given(counts: Sequence[float], num_layers: int) -> Placement:
    """The counts of ``--layers-per-stage``, checked against the model."""
    text = ",".join(f"{c:g}" for c in counts)
    if abs(2 * sum(counts) - 2 * num_layers) > _UNIT_SLACK:
        raise PlacementError(f"--layers-per-stage {text} sums to {sum(counts):g} layers; the "
                             f"model has {num_layers}")  # fmt: skip
    ends, shares, at = [], [], 0.0
    for c in counts[:-1]:  # each boundary, in units: a whole unit, or inside a mixer
        at += 2 * c
        whole = round(at)
        if abs(at - whole) <= _UNIT_SLACK:
            ends.append(whole)
            shares.append(0.0)
            continue
        unit = int(at)
        if unit % 2 or unit >= 2 * num_layers - 2:
            raise PlacementError(
                f"--layers-per-stage {text}: a boundary at {at / 2:g} layers falls inside "
                f"layer {unit // 2}'s {'MLP' if unit % 2 else 'mixer'}; a count may only "
                "cut inside the mixer of a layer before the last (a half is a cut between "
                "a layer's mixer and its MLP)")  # fmt: skip
        share = round(at - unit, 6)
        if not MIN_SHARE <= share <= 1 - MIN_SHARE:
            raise PlacementError(f"--layers-per-stage {text}: the stages around layer "
                                 f"{unit // 2}'s mixer would share it {share:g} / {1 - share:g}; "
                                 f"keep each share at least {MIN_SHARE:g}")  # fmt: skip
        ends.append(unit + 1)
        shares.append(share)
    bounds = [0, *ends, 2 * num_layers]
    units = tuple(b - a for a, b in itertools.pairwise(bounds))
    if any(n < 1 for n in units):
        raise PlacementError(f"--layers-per-stage {text}: every stage must hold a unit of "
                             "its own (a mixer or an MLP)")  # fmt: skip
    if len(units) > 1 and units[-1] < 2:
        raise PlacementError("--layers-per-stage: the last stage must hold the model's whole "
                             "last layer (its outputs are computed for the logits' rows only)")
    return Placement(units, "given", shares=tuple(shares) if any(shares) else ())


def balanced(mixers: Sequence[float], mlps: Sequence[float], last_layer: float,
             embed: float, head: float, stages: int, halves: bool = True,
             shape: str = "",
             shared: Sequence[float | None] | None = None) -> Placement:  # fmt: skip
    """The placement whose slowest stage is fastest, from each layer's measured mixer and
    MLP seconds (all but the model's last layer), the last layer's (as the last stage runs
    it), the embedding's (stage 0) and the head's (last stage). ``shared``: per layer but
    the last, None where its mixer cannot be shared, else the seconds of that mixer with
    no rows of its own (what each of two stages sharing it pays besides its share)."""
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
    chosen, best_units = whole, whole[0]  # the best cut between units, whole or half
    if halves:
        cut = best_cuts(span, len(costs), stages, whole=False)
        best_units = cut[0]
        if cut[0] < whole[0] * (1 - HALF_LAYER_GAIN):
            chosen = cut
    sizes = chosen[1]
    times, at = [], 0
    for s, n in enumerate(sizes):
        times.append(span(at, at + n, s))
        at += n
    units = (*sizes[:-1], sizes[-1] + 1)  # every entry is one unit, the last layer two
    if halves and shared is not None and any(f is not None for f in shared):
        fixed = [None] * len(costs)  # per entry: a shareable mixer's fixed seconds
        for i, f in enumerate(shared):
            if f is not None:
                fixed[2 * i] = min(f, costs[2 * i])
        cut = shared_cuts(costs, fixed, embed, head, stages, best_units)
        if cut is not None and max(cut[0]) < best_units * (1 - SHARE_GAIN):
            times, ends = cut
            bounds = [0, *(int(e) + (e % 1 > 0) for e in ends), len(costs) + 1]
            units = tuple(b - a for a, b in itertools.pairwise(bounds))
            return Placement(units, "auto", tuple(times), shape,
                             tuple(e % 1 for e in ends))  # fmt: skip
    return Placement(units, "auto", tuple(times), shape)


def shared_cuts(costs: Sequence[float], fixed: Sequence[float | None], embed: float,
                head: float, stages: int, ceiling: float,
                steps: int = 60) -> tuple[list[float], list[float]] | None:  # fmt: skip
    """(each stage's seconds, each boundary's position) of the cut into ``stages`` runs of
    the entries ``costs`` (as :func:`balanced` lays them out) whose slowest stage is
    fastest when a boundary may fall inside an entry with a ``fixed`` cost (a shareable
    mixer): at ``j + f`` the stage before runs ``fixed + f * (cost - fixed)`` of entry
    ``j`` and the stage after ``fixed + (1 - f) * (cost - fixed)``. A bisection over the
    slowest stage's time below ``ceiling``, each time filled greedily (every stage takes
    all it can); None when no such cut beats the ceiling."""
    n = len(costs)

    def fill(limit: float) -> tuple[list[float], list[float]] | None:
        times, ends, x = [], [], 0.0
        for s in range(stages):
            j = int(x)
            load = embed if s == 0 else 0.0
            if x > j:  # the rest of a shared entry
                load += fixed[j] + (1 - (x - j)) * (costs[j] - fixed[j])
                j += 1
            if s == stages - 1:
                load += sum(costs[j:]) + head
                if load > limit or j >= n:
                    return None
                times.append(load)
                return times, ends
            took, room = 0, n - (stages - 1 - s)  # leave an entry for each later stage
            while j < room and load + costs[j] <= limit:
                load += costs[j]
                j, took = j + 1, took + 1
            f = None
            if j < room and fixed[j] is not None and costs[j] > fixed[j]:
                f = min((limit - load - fixed[j]) / (costs[j] - fixed[j]), 1 - MIN_SHARE)
            if f is not None and f >= MIN_SHARE:
                times.append(load + fixed[j] + f * (costs[j] - fixed[j]))
                ends.append(j + f)
                x = j + f
            elif took:
                times.append(load)
                ends.append(float(j))
                x = float(j)
            else:
                return None
        return None

    best, lo, hi = None, 0.0, ceiling
    for _ in range(steps):
        mid = (lo + hi) / 2
        cut = fill(mid)
        if cut is None:
            lo = mid
        else:
            best, hi = cut, mid
    return best


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
