"""Where a ``ModelConfig`` comes from: a built-in name (``BUILTIN``), a Hugging Face
``config.json`` (its ``model_type`` looked up in ``MODEL_TYPES``) or WavePP's own
checkpoint layout (:func:`llama_config`'s fields); and the ``config.json`` WavePP writes
for one (:func:`hf_config`)."""

from __future__ import annotations

from collections.abc import Callable

from wavepp.model.config import ModelConfig

_LLAMA_MIXERS = {"A": "gqa", "L": "gla"}


def llama_config(vocab_size: int, d_model: int, num_layers: int, num_heads: int,
                 num_kv_heads: int, head_dim: int, d_ff: int, pattern: str = "A",
                 linear_heads: int = 0, linear_head_dim: int = 0, rope_theta: float = 10_000.0,
                 norm_eps: float = 1e-5, tie_embeddings: bool = False) -> ModelConfig:  # fmt: skip
    """A Llama-layout model: its layers' kinds repeat ``pattern``, ``A`` a Llama attention
    layer (GQA, RoPE on every head dim), ``L`` WavePP's gated linear attention
    (``linear_heads`` heads, each with a ``linear_head_dim``-square state). These are
    the fields of WavePP's own layout (:func:`own_layout`)."""
    if not pattern or set(pattern) - set(_LLAMA_MIXERS):
        raise ValueError(f"unknown layer kinds in pattern {pattern!r}; known: A, L")
    return ModelConfig(
        family="llama", vocab_size=vocab_size, d_model=d_model, num_layers=num_layers,
        mixers=[_LLAMA_MIXERS[pattern[i % len(pattern)]] for i in range(num_layers)],
        mlps=["dense"] * num_layers, norm_eps=norm_eps, tie_embeddings=tie_embeddings,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        rotary_dim=head_dim, rope_theta=rope_theta, linear_heads=linear_heads,
        linear_k_dim=linear_head_dim, linear_v_dim=linear_head_dim, d_ff=d_ff,
    )  # fmt: skip


def own_layout(cfg: ModelConfig) -> dict:
    """The ``wavepp_config.json`` of a Llama-layout config (what :func:`llama_config`
    reads back)."""
    if cfg.family != "llama":
        raise ValueError(f"WavePP's own layout holds Llama-layout models, not {cfg.family}")
    return {
        "vocab_size": cfg.vocab_size, "d_model": cfg.d_model, "num_layers": cfg.num_layers,
        "pattern": cfg.pattern, "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "d_ff": cfg.d_ff, "linear_heads": cfg.linear_heads,
        "linear_head_dim": cfg.linear_k_dim, "rope_theta": cfg.rope_theta,
        "norm_eps": cfg.norm_eps, "tie_embeddings": cfg.tie_embeddings,
    }  # fmt: skip


BUILTIN: dict[str, ModelConfig] = {
    # The embedded default: Kimi-Linear-shaped (KDA + MLA with a latent KV pool, MoE with
    # a shared expert), small enough for four ranks on two CPU cores.
    "tiny-kimi": ModelConfig(
        family="kimi_linear", vocab_size=512, d_model=128, num_layers=8,
        mixers=("kda", "kda", "kda", "mla") * 2, mlps=("dense",) + ("moe",) * 7,
        norm_eps=1e-5, num_heads=4, kv_lora_rank=64, nope_dim=32, rope_dim=16, v_dim=32,
        linear_heads=4, linear_k_dim=32, linear_v_dim=32, conv_kernel=4, d_ff=256,
        num_experts=8, top_k=2, d_expert=64, shared_ff=64, routed_scaling=2.0,
        num_groups=2, topk_groups=1,
    ),
    # The earlier default: gated linear attention + GQA, four ranks on two CPU cores.
    "tiny-hybrid": llama_config(
        vocab_size=512, d_model=128, num_layers=8, pattern="LLLA", num_heads=4,
        num_kv_heads=2, head_dim=32, d_ff=256, linear_heads=4, linear_head_dim=32,
    ),
    "tiny-llama": llama_config(
        vocab_size=512, d_model=128, num_layers=8, num_heads=4, num_kv_heads=2, head_dim=32,
        d_ff=256,
    ),
    # For the CPU benchmarks: big enough that the math, not the runtime, dominates.
    "small-llama": llama_config(
        vocab_size=4096, d_model=512, num_layers=8, num_heads=8, num_kv_heads=2,
        head_dim=64, d_ff=1536,
    ),
    "small-hybrid": llama_config(
        vocab_size=4096, d_model=512, num_layers=8, pattern="LLLA", num_heads=8,
        num_kv_heads=2, head_dim=64, d_ff=1536, linear_heads=8, linear_head_dim=64,
    ),
}  # fmt: skip


# -- Hugging Face config.json -----------------------------------------------------------


def _silu(data: dict) -> None:
    if data.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {data['hidden_act']!r} is not SiLU")


def _layer_types(data: dict, n: int) -> list[str]:
    types = data.get("layer_types")
    if types is None or len(types) != n:
        raise ValueError(f"config.json needs layer_types for its {n} layers, got {types!r}")
    unknown = set(types) - {"linear_attention", "full_attention"}
    if unknown:
        raise ValueError(f"layer types {sorted(unknown)} are not supported")
    return types


def _rope(data: dict, head_dim: int) -> tuple[int, float]:
    """(rotary dims, theta) of default RoPE, possibly partial."""
    rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ValueError(f"RoPE scaling {kind!r} is not supported")
    factor = rope.get("partial_rotary_factor", data.get("partial_rotary_factor", 1.0))
    rotary = data.get("rotary_dim") or int(head_dim * factor)
    return rotary, float(rope.get("rope_theta", data.get("rope_theta", 10_000.0)))


def _common(data: dict) -> dict:
    return dict(
        family=data["model_type"],
        vocab_size=data["vocab_size"],
        d_model=data["hidden_size"],
        num_layers=data["num_hidden_layers"],
        tie_embeddings=bool(data.get("tie_word_embeddings", False)),
    )


def _llama(data: dict) -> ModelConfig:
    if data.get("attention_bias") or data.get("mlp_bias"):
        raise ValueError("biased attention or MLP projections are not supported")
    n, heads = data["num_hidden_layers"], data["num_attention_heads"]
    head_dim = data.get("head_dim") or data["hidden_size"] // heads
    rotary, theta = _rope(data, head_dim)
    if rotary != head_dim:
        raise ValueError(f"partial RoPE ({rotary} of {head_dim} dims) is not Llama's")
    return ModelConfig(
        **_common(data), mixers=("gqa",) * n, mlps=("dense",) * n,
        norm_eps=float(data.get("rms_norm_eps", 1e-6)), num_heads=heads,
        num_kv_heads=data.get("num_key_value_heads") or heads, head_dim=head_dim,
        rotary_dim=rotary, rope_theta=theta, d_ff=data["intermediate_size"],
    )  # fmt: skip


def _kimi_linear(data: dict) -> ModelConfig:
    n = data["num_hidden_layers"]
    types = _layer_types(data, n)
    mlp_types = data.get("mlp_layer_types")
    if mlp_types is None or len(mlp_types) != n:
        raise ValueError(f"config.json needs mlp_layer_types for its {n} layers")
    linear = data.get("linear_attn_config") or {}
    return ModelConfig(
        **_common(data),
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


def _qwen3_next(data: dict) -> ModelConfig:
    n = data["num_hidden_layers"]
    types = _layer_types(data, n)
    head_dim = data.get("head_dim") or data["hidden_size"] // data["num_attention_heads"]
    rotary, theta = _rope(data, head_dim)
    step = data.get("decoder_sparse_step", 1)
    dense = set(data.get("mlp_only_layers") or [])
    experts = data.get("num_experts", 0)
    return ModelConfig(
        **_common(data),
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


def _minimax_m2(data: dict) -> ModelConfig:
    n = data["num_hidden_layers"]
    head_dim = data.get("head_dim") or data["hidden_size"] // data["num_attention_heads"]
    rotary, theta = _rope(data, head_dim)
    return ModelConfig(
        **_common(data),
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


# Hugging Face model_type -> its config.json reader
MODEL_TYPES: dict[str, Callable[[dict], ModelConfig]] = {
    "llama": _llama,
    "kimi_linear": _kimi_linear,
    "qwen3_next": _qwen3_next,
    "minimax_m2": _minimax_m2,
}


def config_from_hf(data: dict) -> ModelConfig:
    """The config of a Hugging Face ``config.json`` dict."""
    kind = data.get("model_type")
    if kind not in MODEL_TYPES:
        names = data.get("architectures") or [kind]
        raise ValueError(
            f"checkpoint architecture {', '.join(map(str, names))} (model_type {kind!r}) is "
            f"not supported; supported model_type values: {', '.join(MODEL_TYPES)}"
        )
    _silu(data)
    return MODEL_TYPES[kind](data)


def hf_config(cfg: ModelConfig) -> dict | None:
    """The Hugging Face ``config.json`` of a Llama (attention layers only) or Kimi Linear
    config, as :func:`config_from_hf` reads it back and ``transformers`` loads it; None
    for the others (WavePP's gated-linear-attention hybrids, which no Hugging Face class
    decodes; Qwen3-Next and MiniMax-M2, which are only read)."""
    if cfg.family == "llama" and set(cfg.mixers) == {"gqa"}:
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
            "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "rope_theta": cfg.rope_theta,
            "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        }  # fmt: skip
    if cfg.family != "kimi_linear":
        return None
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
