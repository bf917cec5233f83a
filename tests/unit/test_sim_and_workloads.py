import numpy as np
import pytest

from wavepp.sim.executor import StageCostModel, attention_pairs
from wavepp.sim.profiles import DEVICES, MODELS, WEIGHT_FORMATS, split_layers
from wavepp.workload import cold, mixed, seeded, short_suffix


def stage_model(model="llama3-70b", device="h200", stages=4, stage=0, fmt=None):
    m = MODELS[model]
    layers = split_layers(m.num_layers, stages)[stage]
    return StageCostModel(m, DEVICES[device], layers, False, fmt)


def test_cost_grows_with_tokens_and_attention_prefix():
    cm = stage_model()
    short = cm.cost([(0, 4096)], 0).seconds
    assert cm.cost([(0, 8192)], 0).seconds > short
    assert cm.cost([(131072, 131072 + 4096)], 0).seconds > short  # same tokens, long prefix


def test_no_wave_beats_the_roofline():
    for name in MODELS:
        for dev in DEVICES.values():
            for fmt in WEIGHT_FORMATS:
                try:
                    dev.matrix_flops(fmt)
                except ValueError:
                    continue
                cm = stage_model(name, dev.name, fmt=fmt)
                for chunks in ([(0, 1)], [(0, 16384)], [(200_000, 204_096)]):
                    cost = cm.cost(chunks, 1)
                    assert cost.seconds >= cost.peak_seconds > 0
                    assert cost.seconds >= cost.bytes / dev.hbm_bytes_s


def test_paper_models_have_their_public_sizes():
    billions = {name: m.total_params() / 1e9 for name, m in MODELS.items()}
    assert 47 < billions["kimi-linear-48b"] < 50  # Kimi Linear 48B-A3B
    assert 730 < billions["glm5-class"] < 750  # GLM-5: 744B
    assert 220 < billions["minimax-m2-class"] < 232  # MiniMax-M2: 230B
    assert 1000 < billions["kimi-k3-class"] < 1060  # K2's width with a KDA mix (~1T)
    assert MODELS["kimi-linear-48b"].pattern.count("M") == 6


def test_sim_models_are_the_model_configs_wavepp_reads():
    from wavepp.model.config import ModelConfig

    for m in MODELS.values():
        assert isinstance(m.config, ModelConfig)
        assert m.pattern.replace("M", "A") == m.config.pattern  # M: MLA, paged as A
        assert m.num_layers == m.config.num_layers and m.vocab == m.config.vocab_size
    assert MODELS["qwen3-next-80b"].pattern == "LLLA" * 12
    assert MODELS["glm5-class"].pattern == "M" * 78


def test_mla_caches_the_latent_and_the_rotary_key():
    glm = MODELS["glm5-class"]
    assert glm.kv_bytes_per_token(5) == (512 + 64) * 2
    minimax = MODELS["minimax-m2-class"]
    assert minimax.kv_bytes_per_token(0) == 2 * 8 * 128 * 2
    kimi = MODELS["kimi-k3-class"]
    assert [kimi.kv_bytes_per_token(i) for i in (3, 4)] == [0, (512 + 64) * 2]  # KDA, MLA


def test_weight_formats_set_bytes_and_matrix_rate():
    assert WEIGHT_FORMATS == {"bf16": 2.0, "fp8": 1.0, "nvfp4": 0.5625}
    small = {f: stage_model("minimax-m2-class", "b300", fmt=f).cost([(0, 64)], 0) for f in
             ("bf16", "fp8", "nvfp4")}  # fmt: skip
    assert small["bf16"].bytes > small["fp8"].bytes > small["nvfp4"].bytes  # memory bound
    big = {f: stage_model("minimax-m2-class", "b300", fmt=f).cost([(0, 16384)], 0).seconds
           for f in ("bf16", "nvfp4")}  # fmt: skip
    assert big["nvfp4"] < big["bf16"]  # faster matrix rate
    with pytest.raises(ValueError, match="h200 has no nvfp4"):
        stage_model("minimax-m2-class", "h200", fmt="nvfp4").cost([(0, 64)], 0)


def test_sparse_attention_caps_the_keys_per_query():
    assert attention_pairs(0, 1000) == 1000 * 500
    assert attention_pairs(0, 1000, topk=2048) == 1000 * 500
    assert attention_pairs(100_000, 1000, topk=2048) == 1000 * 2048
    assert attention_pairs(1048, 2000, topk=2048) == 1000 * (1048 + 500) + 1000 * 2048


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


def test_stage_memory_figures_for_per_stage_pools():
    from wavepp.sim.profiles import kv_block_bytes, stage_weight_bytes

    glm = MODELS["glm5-class"]
    stages = split_layers(glm.num_layers, 4)
    weights = [stage_weight_bytes(glm, r, s == 0, s == 3) for s, r in enumerate(stages)]
    assert 95e9 < min(weights) < max(weights) < 115e9  # 741B params x 0.5625 B over 4
    assert weights[0] < weights[1]  # stage 0 holds the 3 dense layers (and the embeddings)
    assert kv_block_bytes(glm, stages[0], 64) == 64 * 20 * (512 + 64) * 2  # 20 MLA layers
    assert kv_block_bytes(MODELS["kimi-k3-class"], range(0, 3), 64) == 0  # KDA only
    assert DEVICES["gb300"].memory_bytes == 288e9


def test_default_sim_pools_follow_each_stages_memory_and_weights():
    from wavepp.config import load
    from wavepp.launch.backends import backend_for
    from wavepp.sim.profiles import POOL_HEADROOM, stage_pool, stage_weight_bytes

    qwen, h200 = MODELS["qwen3-next-80b"], DEVICES["h200"]
    stages = split_layers(qwen.num_layers, 4)
    pools = [stage_pool(qwen, h200, r, s == 0, s == 3, 64, 16) for s, r in enumerate(stages)]
    # 12 layers a stage: 3 gated GQA (2 KV heads x 256, K and V, bf16, 64 tokens) and 9
    # Gated DeltaNet layers whose fp32 32 x 128 x 128 state is snapshotted every 16 blocks.
    per_block = 64 * 3 * 2 * 2 * 256 * 2 + 9 * 32 * 128 * 128 * 4 / 16
    for s, pool in enumerate(pools):
        weights = stage_weight_bytes(qwen, stages[s], s == 0, s == 3)
        assert pool.blocks == int((141e9 * POOL_HEADROOM - weights) // per_block)
    # the embeddings (stage 0) and the LM head (stage 3) leave the end stages less room
    assert pools[0].blocks == pools[3].blocks < pools[1].blocks == pools[2].blocks
    from wavepp.plan.placement import even

    c = load(["--executor", "sim", "--workload", "cold"])
    sim = backend_for(c)
    assert [p.blocks for p in sim.default_pools(4, even(48, 4))] == [p.blocks for p in pools]
    assert sim.default_pools(1, even(48, 1)) is None  # 80 B bf16 weights do not fit one H200
    # the torch executor's pools: the workload sizes them
    assert backend_for(load(["--executor", "torch"])).default_pools(4, even(48, 4)) is None


def test_seeded_pools_hold_their_prefixes():
    from wavepp.config import load
    from wavepp.launch.setup import auto_capacity, seeded_need

    # The old paper seeded-131k cell: 32 prefixes of 117,952 tokens (1,843 blocks each)
    # needed 58,976 blocks; 1.5 x 16 prompts gave 49,152.
    c = load(["--executor", "sim", "--workload", "seeded", "--prompt-tokens", "131072",
              "--requests", "128", "--concurrency", "16"])  # fmt: skip
    specs = seeded(128, 131072, seed=0, block_size=64)
    assert seeded_need(c, specs) == 32 * 1843 + 16 * (2048 - 1843)
    assert auto_capacity(c, specs) == seeded_need(c, specs) > 49_152
    cold_c = load(["--executor", "sim", "--workload", "short-suffix"])
    assert seeded_need(cold_c, short_suffix(4, 1000, seed=0)) == 0  # meant to evict
