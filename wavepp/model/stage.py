"""One stage of a model: its decoder layers under the checkpoint's names, plus the
embeddings (first stage) and the final norm and head (last stage); the seeded random
weights of a whole model; its plain reference forward.

Names follow what ``save_pretrained`` writes: ``model.layers.{i}.self_attn`` for
attention, MLA and KDA, ``linear_attn`` for Gated DeltaNet and gated linear attention;
``mlp`` (Llama, Qwen3-Next) or ``block_sparse_moe`` (Kimi Linear, MiniMax-M2) for the MLP.

A stage may be split over tensor-parallel ranks (``build_stage(..., tp=group)``): its
layers hold the rank's heads, widths and experts (``wavepp.model.tp``) and the
executor sums their partial outputs over the group.
"""

from __future__ import annotations

import math

import attrs
import torch
from torch import nn

from wavepp.model.attn import GQAttention, LatentAttention
from wavepp.model.common import RMSNorm, SwiGLU
from wavepp.model.config import ModelConfig
from wavepp.model.linear import GatedDeltaNet, GatedLinearAttention, KimiDeltaAttention
from wavepp.model.moe import SparseMoE
from wavepp.model.tp import NO_TP, TPGroup, check_tp, shard_weights


@attrs.frozen
class Layout:
    """What a family's layers look like beyond their mixer kinds."""

    mlp_name: str  # the MLP's checkpoint name
    routing: str | None  # how its experts route (wavepp.model.moe)
    norm_offset: bool = False  # norms scale by 1 + weight


LAYOUTS = {
    "llama": Layout("mlp", None),
    "kimi_linear": Layout("block_sparse_moe", "kimi"),
    "qwen3_next": Layout("mlp", "qwen", norm_offset=True),
    "minimax_m2": Layout("block_sparse_moe", "minimax"),
}


def _gqa(cfg: ModelConfig, tp: TPGroup, qk_norm: str | None = None,
         gated: bool = False) -> GQAttention:  # fmt: skip
    return GQAttention(cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                       cfg.rotary_dim, cfg.rope_theta, cfg.norm_eps, qk_norm, gated,
                       tp)  # fmt: skip


MIXERS = {  # mixer kind -> (checkpoint name, the layer from the config and the TP group)
    "gqa": ("self_attn", _gqa),
    "gattn": ("self_attn", lambda cfg, tp: _gqa(cfg, tp, qk_norm="head", gated=True)),
    "mmattn": ("self_attn", lambda cfg, tp: _gqa(cfg, tp, qk_norm="full")),
    "mla": ("self_attn", lambda cfg, tp: LatentAttention(
        cfg.d_model, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.nope_dim,
        cfg.rope_dim, cfg.v_dim, cfg.norm_eps, tp)),
    "gla": ("linear_attn", lambda cfg, tp: GatedLinearAttention(
        cfg.d_model, cfg.linear_heads, cfg.linear_k_dim, tp)),
    "kda": ("self_attn", lambda cfg, tp: KimiDeltaAttention(
        cfg.d_model, cfg.linear_heads, cfg.linear_k_dim, cfg.conv_kernel, cfg.norm_eps, tp)),
    "gdn": ("linear_attn", lambda cfg, tp: GatedDeltaNet(
        cfg.d_model, cfg.linear_k_heads, cfg.linear_heads, cfg.linear_k_dim,
        cfg.linear_v_dim, cfg.conv_kernel, cfg.norm_eps, tp)),
}  # fmt: skip


def _mlp(cfg: ModelConfig, kind: str, tp: TPGroup) -> nn.Module:
    if kind == "dense":  # column- then row-parallel: this rank's d_ff / T of the width
        return SwiGLU(cfg.d_model, cfg.d_ff // tp.size)
    return SparseMoE(LAYOUTS[cfg.family].routing, cfg.d_model, cfg.d_expert, cfg.num_experts,
                     cfg.top_k, cfg.shared_ff, cfg.norm_topk, cfg.routed_scaling,
                     cfg.num_groups, cfg.topk_groups, tp)  # fmt: skip


class DecoderLayer(nn.Module):
    """``x + mixer(norm(x))``, then ``x + ffn(norm(x))``; or one of the two halves, where
    a stage boundary falls inside the layer (``wavepp.plan.placement``)."""

    def __init__(self, cfg: ModelConfig, layer: int, mixer: bool = True, mlp: bool = True,
                 tp: TPGroup = NO_TP) -> None:  # fmt: skip
        super().__init__()
        layout = LAYOUTS[cfg.family]
        self.tp = tp
        self.has_mixer, self.has_ffn = mixer, mlp
        self.mixer_name, make = MIXERS[cfg.mixers[layer]]
        self.mlp_name = layout.mlp_name
        # registered in this order (norms, mixer, MLP): random_weights draws a seed's
        # tensors in it
        if mixer:
            self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps, layout.norm_offset)
        if mlp:
            self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps,
                                                    layout.norm_offset)  # fmt: skip
        if mixer:
            setattr(self, self.mixer_name, make(cfg, tp))
        if mlp:
            setattr(self, self.mlp_name, _mlp(cfg, cfg.mlps[layer], tp))

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_name)

    @property
    def ffn(self) -> nn.Module:  # "mlp" itself is a checkpoint name
        return getattr(self, self.mlp_name)


class StageModules(nn.Module):
    """The modules one stage holds: its layers, plus the embeddings (first stage; also the
    last with tied embeddings) and the final norm and head (last stage).

    Parameter names match the full checkpoint's (``model.layers.{i}...``), so its tensors
    load by name on every stage. ``layers``: whole layers, or a stage's units
    (``wavepp.plan.placement``: unit 2i is layer i's mixer, 2i + 1 its MLP) when a stage
    boundary falls inside a layer.

    ``tp``: the stage's tensor-parallel ranks; the layers hold this rank's share
    (``wavepp.model.tp``), their mixers and MLPs return partial sums to be reduced over
    ``tp``. Embeddings, the final norm and the head are whole on every rank.
    """

    def __init__(self, cfg: ModelConfig, layers: range, first: bool, last: bool,
                 units: range | None = None, tp: TPGroup = NO_TP) -> None:  # fmt: skip
        super().__init__()
        cfg.validate()
        check_tp(cfg, tp.size)
        self.cfg, self.tp = cfg, tp
        units = units if units is not None else range(2 * layers.start, 2 * layers.stop)
        self.layer_ids = list(range(units.start // 2, (units.stop + 1) // 2))
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({
            str(i): DecoderLayer(cfg, i, mixer=2 * i in units, mlp=2 * i + 1 in units, tp=tp)
            for i in self.layer_ids
        })  # fmt: skip
        if first or (last and cfg.tie_embeddings):
            self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if last:
            self.model.norm = RMSNorm(cfg.d_model, cfg.norm_eps, LAYOUTS[cfg.family].norm_offset)
            if not cfg.tie_embeddings:
                self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.first, self.last = first, last

    def layer(self, i: int) -> DecoderLayer:
        return self.model.layers[str(i)]

    def head(self, h: torch.Tensor) -> torch.Tensor:
        # h: [n, d_model] -> logits [n, vocab]
        h = self.model.norm(h)
        if self.cfg.tie_embeddings:
            return h @ self.model.embed_tokens.weight.T
        return self.lm_head(h)


def build_stage(cfg: ModelConfig, layers: range, first: bool, last: bool,
                weights: dict[str, torch.Tensor], device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32, units: range | None = None,
                tp: TPGroup = NO_TP) -> StageModules:  # fmt: skip
    """The stage's modules with their weights, on ``device`` in ``dtype``; ``units``: the
    stage's half-layer units, where a boundary falls inside a layer (``layers`` is then
    ignored). ``weights``: the full checkpoint's (or this stage's) tensors; with ``tp``
    over several ranks, this rank loads its shard of them (:func:`shard_weights`)."""
    modules = StageModules(cfg, layers, first, last, units, tp)
    wanted = modules.state_dict().keys()  # under TP: only this rank's experts
    missing = [k for k in wanted if k not in weights]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    state = {k: weights[k] for k in wanted}
    if tp.size > 1:
        state = shard_weights(cfg, state, tp.rank, tp.size)
    modules.load_state_dict(state)
    modules.to(device=device, dtype=dtype)
    for m in modules.modules():
        if hasattr(m, "prepare"):
            m.prepare()  # fused / stacked weights, from the loaded ones
    return modules.eval()


_LLAMA_DRAW = {"input_layernorm": 0, "self_attn": 1, "linear_attn": 1,
               "post_attention_layernorm": 2, "mlp": 3}  # fmt: skip


def _draw_order(cfg: ModelConfig, names: list[str]) -> list[str]:
    """The order a seed's weights are drawn in: the stage's, except that Llama-layout
    models draw each layer's mixer before its post-attention norm (so that a seed keeps
    naming the weights it always has)."""
    if cfg.family != "llama":
        return names

    def key(name: str) -> tuple[int, int, int]:
        parts = name.split(".")
        if parts[:2] != ["model", "layers"]:
            return (1, 0, 0)  # after the layers, in the stage's order
        return (0, int(parts[2]), _LLAMA_DRAW[parts[3]])

    return sorted(names, key=key)


def random_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """The full model's weights from a seed, the same on every rank whatever the split."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {k: v.shape for k, v in
              StageModules(cfg, range(cfg.num_layers), first=True, last=True).state_dict().items()}

    def randn(shape):
        return torch.randn(shape, generator=generator)

    def rand(shape):
        return torch.rand(shape, generator=generator)

    state = {}
    for name in _draw_order(cfg, list(shapes)):
        shape, leaf = shapes[name], name.rsplit(".", 1)[-1]
        if "norm" in name and leaf == "weight" and len(shape) == 1:
            offset = LAYOUTS[cfg.family].norm_offset and "linear_attn.norm" not in name
            state[name] = (0.0 if offset else 1.0) + 0.1 * randn(shape)
        elif name.endswith(".a_proj.bias"):  # gated linear attention: decays near exp(-1.3)
            state[name] = torch.full(shape, 1.0) + 0.5 * randn(shape)
        elif leaf == "A_log":  # decay rates in [1, 16], as the families initialize them
            state[name] = (1.0 + 15.0 * rand(shape)).log()
        elif leaf == "dt_bias":  # softplus^-1 of dt in [1e-3, 1e-1]
            dt = (math.log(1e-3) + (math.log(1e-1) - math.log(1e-3)) * rand(shape)).exp()
            state[name] = dt + torch.log(-torch.expm1(-dt))
        elif leaf == "e_score_correction_bias":
            state[name] = torch.zeros(shape)
        else:
            fan_in = math.prod(shape[1:]) if len(shape) > 1 else 1
            std = 1.0 if "embed_tokens" in name else fan_in**-0.5
            state[name] = std * randn(shape)
    return {name: state[name] for name in shapes}


@torch.inference_mode()
def reference_logits(cfg: ModelConfig, weights: dict[str, torch.Tensor], tokens) -> torch.Tensor:
    """Plain single-process full forward (token-by-token recurrences): last logits."""
    model = build_stage(cfg, range(cfg.num_layers), True, True, weights)
    x = model.model.embed_tokens(torch.as_tensor(tokens, dtype=torch.long))  # [n, d_model]
    for i in model.layer_ids:
        layer = model.layer(i)
        x = x + layer.mixer.full(layer.input_layernorm(x))
        x = x + layer.ffn(layer.post_attention_layernorm(x))
    return model.head(x[-1:])[0]
