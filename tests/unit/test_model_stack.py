"""One model stack: built-in names, Hugging Face configs and WavePP's own layout give the
same config type, which one ``build_stage`` builds; recurrent states start float32 on
the weights' device (``meta`` stands in for a GPU: a state made on the CPU would show)."""

from __future__ import annotations

import pytest
import torch

from wavepp.model import (
    BUILTIN,
    ModelConfig,
    build_stage,
    config_from_hf,
    hf_config,
    llama_config,
    random_weights,
)
from wavepp.model.registry import own_layout


def test_llama_round_trips_through_hugging_face_and_own_layout():
    cfg = BUILTIN["tiny-llama"]
    assert cfg.family == "llama" and cfg.pattern == "A" * 8 and cfg.rotary_dim == cfg.head_dim
    assert config_from_hf(hf_config(cfg)) == cfg
    hybrid = BUILTIN["tiny-hybrid"]
    assert hybrid.pattern == "LLLALLLA" and hf_config(hybrid) is None
    assert llama_config(**own_layout(hybrid)) == hybrid
    assert config_from_hf(hf_config(BUILTIN["tiny-kimi"])) == BUILTIN["tiny-kimi"]


def test_configs_are_checked():
    with pytest.raises(ValueError, match="unknown layer kinds"):
        llama_config(512, 64, 2, 4, 2, 16, 128, pattern="AX")
    with pytest.raises(ValueError, match="do not group"):
        llama_config(512, 64, 2, 4, 3, 16, 128).validate()
    with pytest.raises(ValueError, match="recurrent layers need"):
        llama_config(512, 64, 2, 4, 2, 16, 128, pattern="L").validate()
    with pytest.raises(ValueError, match="unknown family"):
        ModelConfig("gpt2", 512, 64, 1, ["gqa"], ["dense"], num_heads=4, num_kv_heads=4,
                    head_dim=16).validate()  # fmt: skip


@pytest.mark.parametrize("name", ["tiny-hybrid", "tiny-kimi"])
def test_recurrent_states_start_float32_on_the_weights_device(name):
    cfg = BUILTIN[name]
    stage = build_stage(cfg, range(cfg.num_layers), True, True, random_weights(cfg, 0), "meta",
                        torch.bfloat16)  # fmt: skip
    mixers = [stage.layer(i).mixer for i in stage.layer_ids if not stage.layer(i).mixer.paged]
    assert mixers
    for mixer in mixers:
        parts = mixer.zero_state().values()
        assert all(p.device.type == "meta" and p.dtype == torch.float32 for p in parts)
    if name == "tiny-hybrid":  # gated linear attention runs on meta tensors end to end
        h = torch.empty(40, cfg.d_model, device="meta", dtype=torch.bfloat16)
        with torch.inference_mode():
            out, after, cuts = mixers[0].chunk(h, None, (16,))
        assert out.dtype == torch.bfloat16
        for part in (after["state"], cuts[0]["state"]):
            assert part.device.type == "meta" and part.dtype == torch.float32
