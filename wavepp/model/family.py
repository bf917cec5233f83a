"""One stage of a family model: its layers under the checkpoint's names, plus the
embeddings (first stage) and the final norm and head (last stage).

Names follow what ``save_pretrained`` writes: ``model.layers.{i}.self_attn`` (Kimi
Linear, MiniMax-M2) or ``linear_attn`` / ``self_attn`` (Qwen3-Next) for the mixer,
``block_sparse_moe`` (Kimi Linear, MiniMax-M2) or ``mlp`` (Qwen3-Next) for the MLP.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from wavepp.model.attn import GQAttention, LatentAttention
from wavepp.model.common import RMSNorm, StageBase, SwiGLU
from wavepp.model.config import FamilyConfig
from wavepp.model.linear import GatedDeltaNet, KimiDeltaAttention
from wavepp.model.moe import SparseMoE

_ROUTING = {"kimi_linear": "kimi", "qwen3_next": "qwen", "minimax_m2": "minimax"}


def _mixer(cfg: FamilyConfig, kind: str) -> nn.Module:
    if kind == "kda":
        return KimiDeltaAttention(
            cfg.d_model, cfg.linear_heads, cfg.linear_k_dim, cfg.conv_kernel, cfg.norm_eps
        )
    if kind == "gdn":
        return GatedDeltaNet(
            cfg.d_model,
            cfg.linear_k_heads,
            cfg.linear_heads,
            cfg.linear_k_dim,
            cfg.linear_v_dim,
            cfg.conv_kernel,
            cfg.norm_eps,
        )
    if kind == "mla":
        return LatentAttention(
            cfg.d_model,
            cfg.num_heads,
            cfg.q_lora_rank,
            cfg.kv_lora_rank,
            cfg.nope_dim,
            cfg.rope_dim,
            cfg.v_dim,
            cfg.norm_eps,
        )
    return GQAttention(
        cfg.d_model,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.rotary_dim,
        cfg.rope_theta,
        cfg.norm_eps,
        qk_norm="head" if kind == "gattn" else "full",
        gated=kind == "gattn",
    )


def _mlp(cfg: FamilyConfig, kind: str) -> nn.Module:
    if kind == "dense":
        return SwiGLU(cfg.d_model, cfg.d_ff)
    return SparseMoE(
        _ROUTING[cfg.family],
        cfg.d_model,
        cfg.d_expert,
        cfg.num_experts,
        cfg.top_k,
        cfg.shared_ff,
        cfg.norm_topk,
        cfg.routed_scaling,
        cfg.num_groups,
        cfg.topk_groups,
    )


class FamilyLayer(nn.Module):
    def __init__(self, cfg: FamilyConfig, layer: int) -> None:
        super().__init__()
        offset = cfg.family == "qwen3_next"  # Qwen3-Next's norms scale by 1 + weight
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps, offset)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps, offset)
        kind = cfg.mixers[layer]
        self.mixer_name = "linear_attn" if kind == "gdn" else "self_attn"
        self.mlp_name = "mlp" if cfg.family == "qwen3_next" else "block_sparse_moe"
        setattr(self, self.mixer_name, _mixer(cfg, kind))
        setattr(self, self.mlp_name, _mlp(cfg, cfg.mlps[layer]))

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_name)

    @property
    def ffn(self) -> nn.Module:  # "mlp" itself is a checkpoint name (Qwen3-Next)
        return getattr(self, self.mlp_name)


class FamilyStage(StageBase):
    """The modules one stage holds; parameter names match the full checkpoint's."""

    def __init__(self, cfg: FamilyConfig, layers: range, first: bool, last: bool) -> None:
        super().__init__(cfg, layers, first, last, lambda i: FamilyLayer(cfg, i),
                         lambda: RMSNorm(cfg.d_model, cfg.norm_eps,
                                         cfg.family == "qwen3_next"))  # fmt: skip


def build_family_stage(
    cfg: FamilyConfig,
    layers: range,
    first: bool,
    last: bool,
    weights: dict[str, torch.Tensor],
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> FamilyStage:
    """The stage's modules with their weights, on ``device`` in ``dtype``."""
    modules = FamilyStage(cfg, layers, first, last)
    wanted = modules.state_dict().keys()
    missing = [k for k in wanted if k not in weights]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    modules.load_state_dict({k: weights[k] for k in wanted})
    modules.to(device=device, dtype=dtype)
    for m in modules.modules():
        if hasattr(m, "prepare"):
            m.prepare()  # fused / stacked weights, from the loaded ones
    return modules.eval()


def family_random_weights(cfg: FamilyConfig, seed: int) -> dict[str, torch.Tensor]:
    """The full model's weights from a seed, the same on every rank whatever the split."""
    generator = torch.Generator().manual_seed(seed)
    full = FamilyStage(cfg, range(cfg.num_layers), first=True, last=True)

    def randn(shape):
        return torch.randn(shape, generator=generator)

    state = {}
    for name, param in full.state_dict().items():
        shape, leaf = param.shape, name.rsplit(".", 1)[-1]
        if "norm" in name and leaf == "weight" and param.dim() == 1:
            base = 0.0 if cfg.family == "qwen3_next" and "linear_attn.norm" not in name else 1.0
            state[name] = base + 0.1 * randn(shape)
        elif leaf == "A_log":  # decay rates in [1, 16], as the families initialize them
            state[name] = (1.0 + 15.0 * torch.rand(shape, generator=generator)).log()
        elif leaf == "dt_bias":  # softplus^-1 of dt in [1e-3, 1e-1]
            dt = (
                math.log(1e-3)
                + (math.log(1e-1) - math.log(1e-3)) * torch.rand(shape, generator=generator)
            ).exp()
            state[name] = dt + torch.log(-torch.expm1(-dt))
        elif leaf == "e_score_correction_bias":
            state[name] = torch.zeros(shape)
        else:
            fan_in = math.prod(shape[1:]) if param.dim() > 1 else 1
            std = 1.0 if "embed_tokens" in name else fan_in**-0.5
            state[name] = std * randn(shape)
    return state


@torch.inference_mode()
def family_reference_logits(
    cfg: FamilyConfig, weights: dict[str, torch.Tensor], tokens
) -> torch.Tensor:
    """Plain single-process full forward (token-by-token recurrences): last logits."""
    model = build_family_stage(cfg, range(cfg.num_layers), True, True, weights)
    x = model.model.embed_tokens(torch.as_tensor(tokens, dtype=torch.long))  # [n, d_model]
    for i in model.layer_ids:
        layer = model.layer(i)
        x = x + layer.mixer.full(layer.input_layernorm(x))
        x = x + layer.ffn(layer.post_attention_layernorm(x))
    return model.head(x[-1:])[0]
