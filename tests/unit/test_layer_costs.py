"""The costs behind --layers-per-stage auto: every part of a model timed on a wave, and
the wave a run's prompts make typical."""

import numpy as np
import torch

from wavepp.exec.layer_costs import measure
from wavepp.launch.setup import reusable_prefixes
from wavepp.model import BUILTIN, random_weights
from wavepp.plan.placement import WaveShape, balanced
from wavepp.workload.generators import RequestSpec


def test_every_part_of_a_hybrid_model_is_timed():
    cfg = BUILTIN["tiny-kimi"]  # KDA and MLA mixers, dense and sparse MLPs
    costs = measure(cfg, random_weights(cfg, 0), WaveShape(2, 32, 64), torch.device("cpu"),
                    torch.float32, 16, repeats=1, shared=True)  # fmt: skip
    assert len(costs.mixers) == len(costs.mlps) == len(costs.shared) == cfg.num_layers - 1
    # attention (MLA) mixers are timed with no rows of their own too; recurrent ones not
    for i, rowless in enumerate(costs.shared):
        assert (rowless is None) == (cfg.kind(i) == "L")
        assert rowless is None or rowless > 0
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


def test_a_placement_from_rank_0_is_checked_before_use():
    import json

    import pytest

    from wavepp.launch.setup import received_placement

    ok = received_placement(json.dumps({"units": [3, 5], "shares": [0.6]}).encode(), 2, 4)
    assert ok.spans == [range(0, 3), range(2, 8)] and ok.shares == (0.6,)
    assert received_placement(b'{"units": [4, 4], "shares": []}', 2, 4).shares == ()
    for bad in (b"[4, 4]", b'{"units": [4, 4]}', b'{"units": [3, 5], "shares": [1.5]}',
                b'{"units": [4, 4], "shares": [0.5]}', b'{"units": [3, 5], "shares": [true]}',
                b'{"units": [3, 5], "shares": [0.5, 0.5]}', b"\xff",
                b'{"units": [3, 5], "shares": [' + b"9" * 400 + b"]}"):  # fmt: skip
        with pytest.raises(RuntimeError, match="rank 0 sent a placement"):
            received_placement(bad, 2, 4)


def test_sharing_needs_the_torch_executor_one_rank_a_stage_and_attention():
    from wavepp.config import RunConfig
    from wavepp.launch.backends import backend_for, sharing_refused
    from wavepp.plan.placement import given

    mixers = BUILTIN["tiny-kimi"].mixers  # LLLALLLA
    assert sharing_refused(mixers, 1, given([3.3, 4.7], 8)) is None  # layer 3: MLA
    assert "recurrent" in sharing_refused(mixers, 1, given([1.3, 6.7], 8))
    assert "--tp" in sharing_refused(mixers, 2)
    assert "torch executor" in backend_for(RunConfig(executor="sim")).sharing_refused()
