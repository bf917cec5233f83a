"""What a model's config asks for, read without allocating anything: every weight's name
and shape, and the cache one token and one request's recurrent state take. The modules
are built on PyTorch's ``meta`` device (shapes, no storage), so a config of absurd sizes
costs nothing to describe; the launcher compares the sum with the machine's memory
before any rank builds a stage, and a checkpoint's tensors with the shapes here."""

from __future__ import annotations

import math

import attrs
import torch

from wavepp.model.config import ModelConfig
from wavepp.model.stage import StageModules


@attrs.frozen
class Footprint:
    tensors: dict[str, tuple[int, ...]]  # every weight of the whole model: name -> shape
    cache_row: int  # elements a token's cache holds over every paged layer (keys, values...)
    state: int  # elements one recurrent state holds over every L layer (kept in fp32)

    @property
    def weight_elements(self) -> int:
        return sum(math.prod(shape) for shape in self.tensors.values())


def footprint(cfg: ModelConfig) -> Footprint:
    """The whole model's footprint; OverflowError where its sizes do not fit 64 bits."""
    try:
        with torch.device("meta"):
            modules = StageModules(cfg, range(cfg.num_layers), first=True, last=True)
    except RuntimeError as error:  # "Storage size calculation overflowed"
        raise OverflowError(f"its tensors' sizes overflow 64 bits ({error})") from None
    tensors = {name: tuple(t.shape) for name, t in modules.state_dict().items()}
    cache_row = state = 0
    for i in modules.layer_ids:
        mixer = modules.layer(i).mixer
        if mixer.paged:
            cache_row += sum(math.prod(s) for s in mixer.cache_layout().values())
        else:
            state += sum(math.prod(s) for s in mixer.state_shapes().values())
    return Footprint(tensors, cache_row, state)
