"""The costs behind --layers-per-stage auto: every part of a model timed on a wave, and
the wave a run's prompts make typical."""

import numpy as np
import torch

from wavepp.exec.layer_costs import measure
from wavepp.main import reusable_prefixes
from wavepp.model import BUILTIN, random_weights
from wavepp.plan.placement import WaveShape, balanced
from wavepp.workload.generators import RequestSpec


def test_every_part_of_a_hybrid_model_is_timed():
    cfg = BUILTIN["tiny-kimi"]  # KDA and MLA mixers, dense and sparse MLPs
    costs = measure(cfg, random_weights(cfg, 0), WaveShape(2, 32, 64), torch.device("cpu"),
                    torch.float32, 16, repeats=1)  # fmt: skip
    assert len(costs.mixers) == len(costs.mlps) == cfg.num_layers - 1
    assert min(costs.mixers) > 0 and min(costs.mlps) > 0 and costs.head > 0
    assert costs.embed > 0 and costs.last_layer >= 0
    # layers of one kind are timed once
    kinds = {(cfg.mixers[i], cost) for i, cost in enumerate(costs.mixers)}
    assert len(kinds) == len({cfg.mixers[i] for i in range(cfg.num_layers - 1)})
    placement = balanced(costs.mixers, costs.mlps, costs.last_layer, costs.embed, costs.head, 3)
    assert sum(placement.units) == 2 * cfg.num_layers


def test_reusable_prefixes_follow_earlier_prompts():
    rng = np.random.default_rng(0)
    seed = rng.integers(0, 100, 64, dtype=np.int32)
    later = np.concatenate([seed[:48], rng.integers(0, 100, 40, dtype=np.int32)])

    def spec(rid, tokens, warmup=False, reuse=0):
        return RequestSpec(rid, tokens, warmup, reuse)

    specs = [spec("seed", seed, warmup=True), spec("a", later), spec("b", later),
             spec("c", rng.integers(0, 100, 30, dtype=np.int32), reuse=16)]  # fmt: skip
    # a: three blocks of the seed; b: all of a's five full blocks; c: its expected reuse
    assert reusable_prefixes(specs, 16) == [(88, 48), (88, 80), (30, 16)]


PINNED = 14831.3946  # what seed 0 drew for tiny-kimi at 8714b17


def test_a_seed_names_the_same_weights():
    # Layers register norms, mixer, MLP in this order whatever part of them a stage
    # holds: random_weights draws in it, and a seed's first tokens must not move.
    weights = random_weights(BUILTIN["tiny-kimi"], 0)
    # each tensor's sum weighted by its place in the draw: a swap of two tensors shows
    total = sum(k * float(t.double().sum()) for k, t in enumerate(weights.values(), 1))
    assert abs(total - PINNED) < 1e-3
