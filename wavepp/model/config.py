"""The configuration of a model of one of the families, read from a Hugging Face
``config.json`` (``model_type`` kimi_linear, qwen3_next, minimax_m2)."""

from __future__ import annotations

import attrs

FAMILIES = ("kimi_linear", "qwen3_next", "minimax_m2")
RECURRENT = ("kda", "gdn")  # mixer kinds with a recurrent state (DESIGN's L)


@attrs.frozen
class FamilyConfig:
    family: str  # one of FAMILIES
    vocab_size: int
    d_model: int
    num_layers: int
    mixers: tuple[str, ...]  # per layer: kda | mla (Kimi), gdn | gattn (Qwen3-Next), mmattn
    mlps: tuple[str, ...]  # per layer: dense | moe
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    # attention (gattn, mmattn) and MLA
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    rotary_dim: int = 0
    rope_theta: float = 10_000.0
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    nope_dim: int = 0
    rope_dim: int = 0
    v_dim: int = 0
    # delta-rule layers: heads (value heads for GDN), key heads, head dims, conv kernel
    linear_heads: int = 0
    linear_k_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    conv_kernel: int = 4
    # MLPs
    d_ff: int = 0
    num_experts: int = 0
    top_k: int = 0
    d_expert: int = 0
    shared_ff: int = 0
    norm_topk: bool = True
    routed_scaling: float = 1.0
    num_groups: int = 1
    topk_groups: int = 1

    @property
    def pattern(self) -> str:
        return "".join(self.kind(i) for i in range(self.num_layers))

    def kind(self, layer: int) -> str:
        """DESIGN's layer kind: ``L`` (recurrent state, snapshots) or ``A`` (paged)."""
        return "L" if self.mixers[layer] in RECURRENT else "A"

    def validate(self) -> None:
        if len(self.mixers) != self.num_layers or len(self.mlps) != self.num_layers:
            raise ValueError(
                f"{self.num_layers} layers but {len(self.mixers)} mixer kinds "
                f"and {len(self.mlps)} MLP kinds"
            )
        known = {"kda", "mla", "gdn", "gattn", "mmattn"}
        if set(self.mixers) - known:
            raise ValueError(
                f"unknown mixer kinds {sorted(set(self.mixers) - known)}; known: {sorted(known)}"
            )
        if set(self.mlps) - {"dense", "moe"}:
            raise ValueError(f"unknown MLP kinds {sorted(set(self.mlps) - {'dense', 'moe'})}")


def _layer_types(data: dict, n: int) -> list[str]:
    types = data.get("layer_types")
    if types is None or len(types) != n:
        raise ValueError(f"config.json needs layer_types for its {n} layers, got {types!r}")
    unknown = set(types) - {"linear_attention", "full_attention"}
    if unknown:
        raise ValueError(f"layer types {sorted(unknown)} are not supported")
    return types


def _rope(data: dict, head_dim: int) -> tuple[int, float]:
    rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ValueError(f"RoPE scaling {kind!r} is not supported")
    factor = rope.get("partial_rotary_factor", data.get("partial_rotary_factor", 1.0))
    rotary = data.get("rotary_dim") or int(head_dim * factor)
    return rotary, float(rope.get("rope_theta", data.get("rope_theta", 10_000.0)))


def config_from_family(data: dict) -> FamilyConfig:
    """A ``FamilyConfig`` from the dict of a Hugging Face ``config.json``."""
    family = data.get("model_type")
    if data.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {data['hidden_act']!r} is not SiLU")
    n = data["num_hidden_layers"]
    common = dict(
        family=family,
        vocab_size=data["vocab_size"],
        d_model=data["hidden_size"],
        num_layers=n,
        tie_embeddings=bool(data.get("tie_word_embeddings", False)),
    )
    if family == "kimi_linear":
        types = _layer_types(data, n)
        mlp_types = data.get("mlp_layer_types")
        if mlp_types is None or len(mlp_types) != n:
            raise ValueError(f"config.json needs mlp_layer_types for its {n} layers")
        linear = data.get("linear_attn_config") or {}
        return FamilyConfig(
            **common,
            mixers=tuple("kda" if t == "linear_attention" else "mla" for t in types),
            mlps=tuple("moe" if t == "sparse" else "dense" for t in mlp_types),
            norm_eps=float(data.get("rms_norm_eps", 1e-5)),
            num_heads=data["num_attention_heads"],
            q_lora_rank=data.get("q_lora_rank"),
            kv_lora_rank=data["kv_lora_rank"],
            nope_dim=data["qk_nope_head_dim"],
            rope_dim=data["qk_rope_head_dim"],
            v_dim=data["v_head_dim"],
            linear_heads=linear.get("num_heads", data.get("linear_num_heads")),
            linear_k_dim=linear.get("head_dim", data.get("linear_head_dim")),
            linear_v_dim=linear.get("head_dim", data.get("linear_head_dim")),
            conv_kernel=linear.get("short_conv_kernel_size", data.get("linear_conv_kernel_dim", 4)),
            d_ff=data["intermediate_size"],
            num_experts=data.get("num_experts", data.get("num_local_experts", 0)),
            top_k=data.get("num_experts_per_token", data.get("num_experts_per_tok", 0)),
            d_expert=data["moe_intermediate_size"],
            shared_ff=data["moe_intermediate_size"]
            * data.get("num_shared_experts", data.get("n_shared_experts", 1)),
            norm_topk=bool(data.get("moe_renormalize", data.get("norm_topk_prob", True))),
            routed_scaling=float(data.get("routed_scaling_factor", 1.0)),
            num_groups=data.get("num_expert_group", data.get("n_group", 1)) or 1,
            topk_groups=data.get("topk_group") or 1,
        )
    if family == "qwen3_next":
        types = _layer_types(data, n)
        head_dim = data.get("head_dim") or data["hidden_size"] // data["num_attention_heads"]
        rotary, theta = _rope(data, head_dim)
        step = data.get("decoder_sparse_step", 1)
        dense = set(data.get("mlp_only_layers") or [])
        experts = data.get("num_experts", 0)
        return FamilyConfig(
            **common,
            mixers=tuple("gdn" if t == "linear_attention" else "gattn" for t in types),
            mlps=tuple(
                "moe" if i not in dense and experts > 0 and (i + 1) % step == 0 else "dense"
                for i in range(n)
            ),
            norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            num_heads=data["num_attention_heads"],
            num_kv_heads=data["num_key_value_heads"],
            head_dim=head_dim,
            rotary_dim=rotary,
            rope_theta=theta,
            linear_heads=data["linear_num_value_heads"],
            linear_k_heads=data["linear_num_key_heads"],
            linear_k_dim=data["linear_key_head_dim"],
            linear_v_dim=data["linear_value_head_dim"],
            conv_kernel=data.get("linear_conv_kernel_dim", 4),
            d_ff=data["intermediate_size"],
            num_experts=experts,
            top_k=data.get("num_experts_per_tok", 0),
            d_expert=data.get("moe_intermediate_size", 0),
            shared_ff=data.get("shared_expert_intermediate_size", 0),
            norm_topk=bool(data.get("norm_topk_prob", True)),
        )
    if family == "minimax_m2":
        head_dim = data.get("head_dim") or data["hidden_size"] // data["num_attention_heads"]
        rotary, theta = _rope(data, head_dim)
        return FamilyConfig(
            **common,
            mixers=("mmattn",) * n,
            mlps=("moe",) * n,
            norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            num_heads=data["num_attention_heads"],
            num_kv_heads=data["num_key_value_heads"],
            head_dim=head_dim,
            rotary_dim=rotary,
            rope_theta=theta,
            num_experts=data["num_local_experts"],
            top_k=data["num_experts_per_tok"],
            d_expert=data["intermediate_size"],
        )
    raise ValueError(f"model_type {family!r} is not a family here; supported: {FAMILIES}")


def kimi_hf_config(cfg: FamilyConfig) -> dict:
    """The Hugging Face ``config.json`` of a Kimi Linear ``FamilyConfig`` (what
    :func:`config_from_family` reads back; ``transformers`` loads it too)."""
    if cfg.family != "kimi_linear":
        raise ValueError(f"only Kimi Linear configs are written; this one is {cfg.family}")
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "hidden_act": "silu",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.num_layers,
        "layer_types": ["linear_attention" if m == "kda" else "full_attention" for m in cfg.mixers],
        "mlp_layer_types": ["sparse" if m == "moe" else "dense" for m in cfg.mlps],
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_heads,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.nope_dim,
        "qk_rope_head_dim": cfg.rope_dim,
        "v_head_dim": cfg.v_dim,
        "linear_num_heads": cfg.linear_heads,
        "linear_head_dim": cfg.linear_k_dim,
        "linear_conv_kernel_dim": cfg.conv_kernel,
        "intermediate_size": cfg.d_ff,
        "moe_intermediate_size": cfg.d_expert,
        "num_experts": cfg.num_experts,
        "num_experts_per_token": cfg.top_k,
        "num_shared_experts": cfg.shared_ff // cfg.d_expert if cfg.d_expert else 0,
        "moe_renormalize": cfg.norm_topk,
        "routed_scaling_factor": cfg.routed_scaling,
        "num_expert_group": cfg.num_groups,
        "topk_group": cfg.topk_groups,
        "pad_token_id": 0,  # the defaults (Kimi's tokenizer) lie outside a small vocabulary
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
