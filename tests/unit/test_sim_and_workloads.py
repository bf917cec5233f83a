import numpy as np
import pytest

from wavepp.exec.profiles import DEVICES, MODELS, split_layers
from wavepp.exec.sim import StageCostModel
from wavepp.workload import cold, mixed, seeded, short_suffix


def stage_model(model="llama3-70b", device="h200", stages=4, stage=0):
    m = MODELS[model]
    return StageCostModel(m, DEVICES[device], split_layers(m.num_layers, stages)[stage], False)


def test_cost_grows_with_tokens_and_attention_prefix():
    cm = stage_model()
    short = cm.cost([(0, 4096)], 0).seconds
    assert cm.cost([(0, 8192)], 0).seconds > short
    assert cm.cost([(131072, 131072 + 4096)], 0).seconds > short  # same tokens, long prefix


def test_no_wave_beats_the_roofline():
    for name in MODELS:
        for dev in DEVICES.values():
            cm = stage_model(name, dev.name)
            for chunks in ([(0, 1)], [(0, 16384)], [(200_000, 204_096)]):
                cost = cm.cost(chunks, 1)
                assert cost.seconds >= cost.flops / dev.peak_flops
                assert cost.seconds >= cost.bytes / dev.hbm_bytes_s


def test_llama_70b_stage_time_matches_a_hand_count():
    # 20 of 80 layers; one layer: 8192x(8192+2x1024+8192) attention + 3x8192x28672 MLP.
    layer = 8192 * (8192 + 2 * 1024 + 8192) + 3 * 8192 * 28672
    gemm = 2 * 20 * layer * 8192 / (989e12 * 0.8)
    attn = 4 * 64 * 128 * 8192 * 4096 * 20 / (989e12 * 0.55)
    assert stage_model().cost([(0, 8192)], 0).seconds == pytest.approx(gemm + attn + 0.0005)


def test_layer_split_even_and_uneven():
    assert [len(r) for r in split_layers(48, 4)] == [12, 12, 12, 12]
    assert [len(r) for r in split_layers(10, 4)] == [3, 3, 2, 2]
    assert [r.start for r in split_layers(16, 4, [3, 5, 4, 4])] == [0, 3, 8, 12]
    with pytest.raises(ValueError, match="must be 4 positive counts summing to 16"):
        split_layers(16, 4, [3, 5, 4, 5])


def test_workloads_are_deterministic_and_shaped():
    a, b = short_suffix(6, 1000, seed=3), short_suffix(6, 1000, seed=3)
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a, b, strict=True))
    docs, turns = a[:6], a[6:]
    assert all(d.warmup for d in docs) and not any(t.warmup for t in turns)
    assert all(t.num_tokens == 1000 + 4096 and t.expected_reuse == 960 for t in turns)
    assert any(np.array_equal(t.tokens[:1000], d.tokens) for t in turns for d in docs)
    s = seeded(8, 1000, seed=0, block_size=64)
    assert sum(r.warmup for r in s) == 2 and all(r.expected_reuse == 896 for r in s if not r.warmup)
    m = mixed(8, 1000, 3000, seed=0)
    assert sum(1 for r in m if not r.warmup and r.num_tokens == 3000) == 2
    assert not np.array_equal(cold(2, 100, 0)[0].tokens, cold(2, 100, 1)[0].tokens)
