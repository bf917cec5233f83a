"""A device profile measured on this machine (``--sim-device measured:FILE``).

``python -m wavepp.sim.calibrate`` times each part of a built-in model on the torch
executor — every mixer kind and MLP kind, the model's last layer as the last stage runs
it, the embedding and the head — on a small grid of waves, and fits each part to

    seconds(wave) = wave_s + chunk_s · C + token_s · T + pair_s · Σ t·(p + t/2)

(C the wave's chunks, T its new tokens, t each chunk's new tokens after p cached ones;
the head's token term counts the logits' rows instead, and neither it nor the embedding
has a chunk term). A part that runs a loop per sequence (a recurrent mixer's state,
the rows-only last layer's rows) pays per chunk; profiles written before that term read
it as 0. Each fit leaves out the executor's own
per-wave cost, which a stage pays once however many parts it holds (``wave_overhead_s``:
the parts' summed times against the whole model's, timed on the same waves).

:class:`MeasuredStageCost` prices a stage's half-layer units from the fits, the way
:class:`~wavepp.sim.executor.StageCostModel` prices a stage of a datasheet device, so
the simulator predicts this machine for the model it was calibrated on — including its
cores: where the run's ranks x threads exceed the cores the profile was measured on,
every wave takes that many times longer (the ranks of one machine share its cores), or
with ``--sim-burn`` each wave is spent as work on a core (``wavepp.sim.executor.burn``)
and the machine shares its cores as it does.
The file is checked as untrusted input before any figure of it is used
(:func:`load_profile`).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from pathlib import Path

import attrs

from wavepp.model.config import MIXERS, MLPS, RECURRENT
from wavepp.plan.placement import WaveShape, share_row
from wavepp.sim.executor import WaveCost, attention_pairs
from wavepp.sim.profiles import LinkProfile

SCHEMA = "wavepp.sim.measured/1"
PREFIX = "measured:"
MAX_FILE_BYTES = 4 << 20  # a profile holds a few hundred numbers; refuse anything huge
NOMINAL_PRIOR_D = 1e-3  # the torch executor's prior per-wave cost (TorchExecutor.prior_cost)


class ProfileError(ValueError):
    """A measured profile that cannot be used, with the reason."""


@attrs.frozen
class PartCost:
    """One part's fitted seconds on a wave, and the torch executor's own prior for it
    (``prior_a`` per token, ``prior_c`` per attention pair: FLOPs at a nominal rate)."""

    wave_s: float
    token_s: float
    pair_s: float
    prior_a: float = 0.0
    prior_c: float = 0.0
    chunk_s: float = 0.0

    def seconds(self, tokens: float, pairs: float, chunks: float = 0.0) -> float:
        return self.wave_s + self.chunk_s * chunks + self.token_s * tokens + self.pair_s * pairs


@attrs.frozen
class MeasuredProfile:
    """What :mod:`wavepp.sim.calibrate` wrote: one model on one machine."""

    model: str
    d_model: int
    vocab: int  # the workload's token ids are drawn as the torch run draws them
    mixers: tuple[str, ...]  # per layer
    mlps: tuple[str, ...]  # per layer
    act_bytes: int  # bytes per activation element (the run's dtype)
    parts: dict[str, PartCost]  # "mixer:<kind>", "mlp:<kind>", "last_layer", "embed", "head"
    wave_overhead_s: float  # the executor's per-wave cost, once per stage
    noise: float  # spread of repeated identical waves (coefficient of variation)
    machine: dict
    link: LinkProfile | None = None  # the data plane between two local ranks, if measured
    source: str = ""  # the file

    @property
    def num_layers(self) -> int:
        return len(self.mixers)

    def core_sharing(self, ranks: int, threads: int) -> float:
        """How much longer each wave takes when ``ranks`` ranks of ``threads`` torch
        threads each (0: the runtime's default, the cores divided among the ranks) share
        the profile's machine: ranks x threads over its cores where that exceeds 1 (every
        stage busy at once, each thread an equal share of a core: an upper bound, as
        stages idle part of the time); 1 where the profile does not say its cores."""
        cores = self.machine.get("cores")
        if cores is None:
            return 1.0
        per_rank = threads or max(1, cores // max(1, ranks))
        return max(1.0, ranks * per_rank / cores)

    def part(self, key: str) -> PartCost:
        if key not in self.parts:
            raise ProfileError(f"{self.source}: no measurement of {key}")
        return self.parts[key]

    def unit_key(self, unit: int) -> str:
        """The part a half-layer unit is priced by (the last layer is one entry)."""
        layer, half = divmod(unit, 2)
        if layer == self.num_layers - 1:
            return "last_layer"
        return f"mlp:{self.mlps[layer]}" if half else f"mixer:{self.mixers[layer]}"

    def unit_costs(self, shape: WaveShape) -> tuple[list[float], list[float], float, float,
                                                     float]:  # fmt: skip
        """(mixers, MLPs of layers 0..L-2, last layer, embedding, head) on ``shape`` as
        ``wavepp.exec.layer_costs.measure`` times them (each part a stage of its own, so
        each with the executor's per-wave cost): what ``balanced`` places by."""
        tokens = shape.chunks * shape.tokens
        pairs = shape.chunks * attention_pairs(shape.prefix, shape.tokens)
        e = self.wave_overhead_s

        def of(key: str, n: float = tokens, p: float = pairs, c: int = shape.chunks) -> float:
            return self.part(key).seconds(n, p, c) + e

        body = range(self.num_layers - 1)
        return ([of(f"mixer:{self.mixers[i]}") for i in body],
                [of(f"mlp:{self.mlps[i]}") for i in body],
                of("last_layer"), of("embed", p=0.0, c=0),
                of("head", shape.chunks, 0.0, 0))  # fmt: skip

    def rowless_costs(self, shape: WaveShape) -> list[float | None]:
        """Per layer 0..L-2: an attention mixer's seconds on ``shape`` with no rows of its
        own (its fit without the attention term: what each of two stages sharing it
        pays besides its share, as ``layer_costs.measure(shared=True)`` times it), or
        None for a recurrent mixer, which cannot be shared."""
        tokens = shape.chunks * shape.tokens
        return [None if self.mixers[i] in RECURRENT
                else self.part(f"mixer:{self.mixers[i]}").seconds(tokens, 0.0, shape.chunks)
                + self.wave_overhead_s for i in range(self.num_layers - 1)]  # fmt: skip

    def to_json(self, points: Sequence[dict] = ()) -> dict:
        return {
            "schema": SCHEMA,
            "model": self.model,
            "d_model": self.d_model,
            "vocab": self.vocab,
            "layers": [[m, f] for m, f in zip(self.mixers, self.mlps, strict=True)],
            "act_bytes": self.act_bytes,
            "parts": {k: attrs.asdict(v) for k, v in sorted(self.parts.items())},
            "wave_overhead_s": self.wave_overhead_s,
            "noise": self.noise,
            "link": None if self.link is None else {"bytes_s": self.link.bytes_s,
                                                    "latency_s": self.link.latency_s},
            "machine": self.machine,
            "points": list(points),
        }  # fmt: skip


def _number(data: dict, key: str, where: str, positive: bool = False) -> float:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ProfileError(f"{where}: {key} must be a finite number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ProfileError(f"{where}: {key} must be {'positive' if positive else '≥ 0'}, "
                           f"got {value!r}")  # fmt: skip
    return float(value)


def parse_profile(data: object, source: str = "profile") -> MeasuredProfile:
    """A profile from its JSON form, every field checked (types, ranges, known kinds,
    a fit for every part the model's layers need)."""
    if not isinstance(data, dict):
        raise ProfileError(f"{source}: not a JSON object")
    if data.get("schema") != SCHEMA:
        raise ProfileError(f"{source}: schema {data.get('schema')!r}, expected {SCHEMA!r} "
                           "(write it with python -m wavepp.sim.calibrate)")  # fmt: skip
    model = data.get("model")
    if not isinstance(model, str) or not 0 < len(model) <= 200:
        raise ProfileError(f"{source}: model must be a name, got {model!r}")
    layers = data.get("layers")
    if (not isinstance(layers, list) or not 1 <= len(layers) <= 1024
            or not all(isinstance(x, list) and len(x) == 2 and x[0] in MIXERS and x[1] in MLPS
                       for x in layers)):  # fmt: skip
        raise ProfileError(f"{source}: layers must be 1..1024 [mixer, mlp] pairs of "
                           f"{MIXERS} and {MLPS}")  # fmt: skip
    d_model, vocab, act_bytes = data.get("d_model"), data.get("vocab"), data.get("act_bytes")
    for key, value in (("d_model", d_model), ("vocab", vocab), ("act_bytes", act_bytes)):
        if type(value) is not int or not 1 <= value <= 1 << 24:
            raise ProfileError(f"{source}: {key} must be a positive integer, got {value!r}")
    raw_parts = data.get("parts")
    if not isinstance(raw_parts, dict) or len(raw_parts) > 64:
        raise ProfileError(f"{source}: parts must be an object of part fits")
    parts = {}
    fields = [f.name for f in attrs.fields(PartCost)]
    for key, fit in raw_parts.items():
        if not isinstance(fit, dict) or set(fit) - set(fields):
            raise ProfileError(f"{source}: part {key!r} must hold only {fields}")
        fit = {"chunk_s": 0.0} | fit  # written before the chunk term: none
        parts[key] = PartCost(*(_number(fit, f, f"{source}: part {key!r}") for f in fields))
    mixers = tuple(m for m, _ in layers)
    mlps = tuple(f for _, f in layers)
    need = {f"mixer:{m}" for m in mixers[:-1]} | {f"mlp:{f}" for f in mlps[:-1]}
    need |= {"last_layer", "embed", "head"}
    if need - set(parts):
        raise ProfileError(f"{source}: no fit for {sorted(need - set(parts))}")
    link = data.get("link")
    if link is not None:
        if not isinstance(link, dict):
            raise ProfileError(f"{source}: link must be null or an object")
        link = LinkProfile("measured", _number(link, "bytes_s", f"{source}: link", True),
                           _number(link, "latency_s", f"{source}: link"))  # fmt: skip
    machine = data.get("machine")
    if not isinstance(machine, dict):
        raise ProfileError(f"{source}: machine must be an object")
    rate = machine.get("burn_blocks_s")
    if rate is not None:  # written since --sim-burn: the hashing rate when measured
        _number(machine, "burn_blocks_s", f"{source}: machine", positive=True)
    for key in ("cores", "threads"):
        value = machine.get(key)
        if value is not None and (type(value) is not int or not 1 <= value <= 1 << 16):
            raise ProfileError(f"{source}: machine {key} must be a positive integer, got "
                               f"{value!r}")  # fmt: skip
    return MeasuredProfile(
        model, d_model, vocab, mixers, mlps, act_bytes, parts,
        _number(data, "wave_overhead_s", source), _number(data, "noise", source),
        machine, link, source,
    )  # fmt: skip


@functools.cache
def load_profile(path: str) -> MeasuredProfile:
    """The profile in ``path`` (at most 4 MiB of JSON), checked; :class:`ProfileError`
    names what is wrong before anything is used."""
    file = Path(path)
    try:
        size = file.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ProfileError(f"{path}: {size:,} bytes, more than a profile's "
                               f"{MAX_FILE_BYTES:,}")  # fmt: skip
        data = json.loads(file.read_bytes())
    except OSError as error:
        raise ProfileError(f"{path}: cannot read it ({error.strerror or error})") from None
    except (ValueError, RecursionError) as error:
        raise ProfileError(f"{path}: not JSON ({error})") from None
    return parse_profile(data, path)


def measured_path(sim_device: str) -> str | None:
    """FILE of ``--sim-device measured:FILE``; None for a datasheet device."""
    return sim_device[len(PREFIX):] if sim_device.startswith(PREFIX) else None


@attrs.frozen
class MeasuredStageCost:
    """Predicted time of one wave on a stage holding ``units`` of the profile's model:
    each unit's fitted part, the embedding on the first stage, the head's rows on the
    last, plus the executor's per-wave cost once; all of it times ``sharing``, where the
    run's ranks outnumber the machine's cores (``MeasuredProfile.core_sharing``)."""

    profile: MeasuredProfile
    units: range
    is_first: bool
    is_last: bool
    sharing: float = 1.0
    # the share of the first (last) unit's mixer this stage runs with the stage before
    # (after) it: that mixer's fit with its attention term cut to the stage's part of it
    # (its per-token term in full on both sides: the fit does not part the projections
    # both stages run from the output projection each runs for its own rows)
    shared_first: float | None = None
    shared_last: float | None = None

    def cost(self, chunks: Sequence[tuple[int, int]], num_finished: int) -> WaveCost:
        """``chunks``: (start, end) token ranges; start is the chunk's attention prefix."""
        tokens = sum(end - start for start, end in chunks)
        if tokens == 0:
            return WaveCost(0.0, 0.0, 0.0)
        pairs = sum(attention_pairs(s, e - s) for s, e in chunks)
        p = self.profile

        def part(u: int) -> float:  # a shared mixer: all rows' projections, its pairs' share
            share = (1 - self.shared_first if self.shared_first and u == self.units.start
                     else self.shared_last if self.shared_last and u == self.units.stop - 1
                     else 1.0)  # fmt: skip
            return p.part(p.unit_key(u)).seconds(tokens, share * pairs, len(chunks))

        seconds = p.wave_overhead_s + sum(
            part(u) for u in self.units
            if not (p.unit_key(u) == "last_layer" and u % 2)  # the last layer: one entry
        )
        if self.is_first:
            seconds += p.part("embed").seconds(tokens, 0.0)
        if self.is_last and num_finished:
            seconds += p.part("head").seconds(num_finished, 0.0)
        return WaveCost(seconds * self.sharing, 0.0, 0.0)

    @property
    def has_recurrent(self) -> bool:
        return any(self.profile.mixers[u // 2] in RECURRENT for u in self.units if u % 2 == 0)

    def shared_rows(self, chunks: Sequence) -> int:
        """The rows of a mixer shared with the next stage that this stage sends on besides
        the wave's (``TorchExecutor.forward``): 0 when it shares none."""
        if not self.shared_last:
            return 0
        return share_row([(c.start, c.end) for c in chunks], self.shared_last,
                         self.profile.d_model // 2)  # fmt: skip

    def generic_prior(self) -> tuple[float, float, float, float]:
        """(a, c, d, floor): what the torch executor's planner starts from for the same
        layers (FLOPs at its nominal rate, its nominal per-wave cost, no floor) — none
        of the fitted times."""
        p = self.profile
        keys = [p.unit_key(u) for u in self.units if not (p.unit_key(u) == "last_layer"
                                                          and u % 2)]  # fmt: skip
        a = sum(p.part(k).prior_a for k in keys)
        c = sum(p.part(k).prior_c for k in keys)
        return max(a, 1e-12), c, NOMINAL_PRIOR_D, 0.0
