"""What each part of a model costs on this rank's device: the measurements behind
``--layers-per-stage auto`` (``wavepp.plan.placement``).

Each distinct mixer kind and MLP kind is built once as a one-unit stage (a mixer alone,
or an MLP alone) with the run's weights of the first layer that has it, and timed on a
typical wave over a pool of its own; so are the model's last layer as the last stage runs it
(its cache for every token, its outputs for the logits' rows), the embedding and the
head. Each figure is the median of a few timed waves after one warm-up wave. With
``shared``, each attention mixer is also timed as a stage sharing it runs it with no rows
of its own (its projections and cache writes, no attention): what sharing it costs each of
the two stages besides its share.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import attrs
import numpy as np
import torch

from wavepp.exec.base import ChunkWork
from wavepp.exec.torch_exec import TorchExecutor
from wavepp.model import build_stage
from wavepp.model.config import ModelConfig
from wavepp.plan.placement import WaveShape


@attrs.frozen
class ModelCosts:
    """Seconds of each part of the model on one wave (``shape``)."""

    mixers: tuple[float, ...]  # layers 0..L-2: the mixer, with its input norm
    mlps: tuple[float, ...]  # layers 0..L-2: the MLP, with its norm
    last_layer: float  # the model's last layer as the last stage runs it
    embed: float
    head: float
    shape: WaveShape
    # layers 0..L-2: the mixer with no rows of its own, or None (not shareable, not timed)
    shared: tuple[float | None, ...] = ()


def measure(cfg: ModelConfig, weights: dict[str, torch.Tensor], shape: WaveShape,
            device: torch.device, dtype: torch.dtype, block_size: int,
            full_last_layer: bool = False, repeats: int = 3,
            shared: bool = False) -> ModelCosts:  # fmt: skip
    """Time every part of the model on ``shape`` with this process's torch threads;
    ``shared``: the attention mixers with no rows of their own too."""
    last = cfg.num_layers - 1
    timed: dict[tuple[str, str], float] = {}

    def unit(i: int, part: int, rowless: bool = False) -> float:  # part 0: mixer, 1: MLP
        kind = ("mlp", cfg.mlps[i]) if part else ("mixer", cfg.mixers[i], rowless)
        if kind not in timed:
            units = range(2 * i + part, 2 * i + part + 1)
            stage = build_stage(cfg, range(0), False, False, weights, device, dtype, units)
            timed[kind] = _time_stage(stage, shape, block_size, False, repeats,
                                      shared_last=0.0 if rowless else None)  # fmt: skip
        return timed[kind]

    mixers = tuple(unit(i, 0) for i in range(last))
    mlps = tuple(unit(i, 1) for i in range(last))
    rowless = tuple(unit(i, 0, True) if shared and cfg.kind(i) == "A" else None
                    for i in range(last))  # fmt: skip
    tail = build_stage(cfg, range(last, last + 1), False, True, weights, device, dtype)
    with_head = _time_stage(tail, shape, block_size, True, repeats, full_last_layer)
    rows = _activations(shape.chunks, cfg.d_model, device, dtype)
    head = _median(lambda: tail.head(rows), repeats, device)
    first = build_stage(cfg, range(0), True, False, weights, device, dtype)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (shape.chunks * shape.tokens,), generator=generator)
    ids = ids.to(device)
    embed = _median(lambda: first.model.embed_tokens(ids), repeats, device)
    return ModelCosts(mixers, mlps, max(0.0, with_head - head), embed, head, shape,
                      rowless if shared else ())  # fmt: skip


def _activations(tokens: int, width: int, device: torch.device, dtype: torch.dtype):
    """Seeded random hidden states: zeros would route every token of a MoE layer to the
    same experts, a path real traffic does not take."""
    generator = torch.Generator().manual_seed(0)
    return torch.randn(tokens, width, generator=generator).to(device, dtype)


def _time_stage(stage, shape: WaveShape, block_size: int, ending: bool, repeats: int,
                full_last_layer: bool = False,
                shared_last: float | None = None) -> float:  # fmt: skip
    """Median seconds of one wave of ``shape`` on ``stage`` over a pool of its own
    (``ending``: every chunk ends its prompt, as on the last stage)."""
    return statistics.median(wave_times(stage, shape, block_size, ending, repeats,
                                        full_last_layer, shared_last))  # fmt: skip


def wave_times(stage, shape: WaveShape, block_size: int, ending: bool, repeats: int,
               full_last_layer: bool = False,
               shared_last: float | None = None) -> list[float]:  # fmt: skip
    """Seconds of each of ``repeats`` waves of ``shape`` on ``stage`` over a pool of its
    own, after one warm-up wave (``ending``: every chunk ends its prompt;
    ``shared_last``: the stage's last mixer shared, at that share)."""
    per = -(-(shape.prefix + shape.tokens) // block_size)
    executor = TorchExecutor(stage, shape.chunks * per, block_size, snapshot_capacity=1,
                             full_last_layer=full_last_layer,
                             shared_last=shared_last)  # fmt: skip
    end = shape.prefix + shape.tokens
    chunks = [ChunkWork(f"costs-{s}", shape.prefix, end, end if ending else end + 1,
                        tuple(range(s * per, (s + 1) * per)), (), False,
                        resume_slot=0 if shape.prefix else None,
                        tokens=np.zeros(shape.tokens, dtype=np.int32))
              for s in range(shape.chunks)]  # fmt: skip
    x = _activations(shape.chunks * shape.tokens, stage.cfg.d_model, executor.device,
                     executor.dtype)  # fmt: skip

    def wave() -> None:
        executor.forward(chunks, x)
        for c in chunks:  # recurrent layers: resume from the snapshot slot each time
            executor.cancel(c.request_id)

    return _timings(wave, repeats, executor.device)


def _median(run: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median seconds of ``run`` after one warm-up call."""
    return statistics.median(_timings(run, repeats, device))


@torch.inference_mode()
def _timings(run: Callable[[], object], repeats: int, device: torch.device) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``run`` after one warm-up call (first-call
    allocations, kernel plans); on a GPU each call is timed to its kernels' end."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    run()
    times = []
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - started)
    return times
