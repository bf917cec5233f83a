"""Tiny random checkpoints of the three families, made and saved by ``transformers``.

Weights are re-drawn at unit scale (transformers initializes at std 0.02, which makes
every logit near zero and every router near uniform, so parity would prove little);
the MoE correction biases are nonzero so that routing depends on them.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

VOCAB = 300


def kimi_config(layers=("kda", "kda", "mla", "kda", "mla")) -> transformers.PretrainedConfig:
    return transformers.KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=len(layers), num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        n_group=2, topk_group=1, routed_scaling_factor=2.0, linear_head_dim=16,
        linear_num_heads=4, rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        layer_types=["linear_attention" if k == "kda" else "full_attention" for k in layers],
        mlp_layer_types=["dense"] + ["sparse"] * (len(layers) - 1),
    )  # fmt: skip


def qwen_config(layers=("gdn", "gdn", "gattn", "gdn", "gattn")) -> transformers.PretrainedConfig:
    return transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_hidden_layers=len(layers),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1], pad_token_id=0,
        layer_types=["linear_attention" if k == "gdn" else "full_attention" for k in layers],
    )  # fmt: skip


def minimax_config(num_layers: int = 4) -> transformers.PretrainedConfig:
    return transformers.MiniMaxM2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
        num_experts_per_tok=2, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5},
    )  # fmt: skip


MODELS = {
    "kimi_linear": (kimi_config, transformers.KimiLinearForCausalLM),
    "qwen3_next": (qwen_config, transformers.Qwen3NextForCausalLM),
    "minimax_m2": (minimax_config, transformers.MiniMaxM2ForCausalLM),
}


@torch.no_grad()
def redraw(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name or name.endswith(("A_log", "dt_bias")):
            p.add_(0.1 * torch.randn(p.shape, generator=generator))
        else:
            std = 1.0 if "embed_tokens" in name else p.shape[-1] ** -0.5
            p.copy_(std * torch.randn(p.shape, generator=generator))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=generator))


def make_checkpoint(family: str, path: Path, seed: int = 0, **config_args):
    """(transformers model in eval mode, directory it was saved to)."""
    make_config, cls = MODELS[family]
    torch.manual_seed(seed)
    model = cls(make_config(**config_args)).eval()
    redraw(model, seed)
    model.save_pretrained(path)
    return model, path


@torch.inference_mode()
def hf_last_logits(model, tokens) -> torch.Tensor:
    ids = torch.as_tensor(tokens, dtype=torch.long)[None]
    return model(ids).logits[0, -1].float()
