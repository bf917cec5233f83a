"""The one configuration type of every model WavePP computes: Llama (with WavePP's gated
linear-attention layers, the built-in hybrids), Kimi Linear, Qwen3-Next and MiniMax-M2.

``wavepp.model.registry`` makes one from a built-in name, a Hugging Face
``config.json`` or WavePP's own checkpoint layout."""

from __future__ import annotations

import attrs

FAMILIES = ("llama", "kimi_linear", "qwen3_next", "minimax_m2")
# Mixer kinds, per layer: gqa (Llama attention), gla (WavePP's gated linear attention),
# kda and mla (Kimi Linear), gdn and gattn (Qwen3-Next), mmattn (MiniMax-M2).
MIXERS = ("gqa", "gla", "kda", "mla", "gdn", "gattn", "mmattn")
RECURRENT = ("gla", "kda", "gdn")  # mixer kinds with a recurrent state (DESIGN's L)
GROUPED = ("gqa", "gattn", "mmattn")  # grouped-query attention: heads over KV heads
MLPS = ("dense", "moe")


@attrs.frozen
class ModelConfig:
    family: str  # one of FAMILIES: how layers are named and normalized, how experts route
    vocab_size: int
    d_model: int
    num_layers: int
    mixers: tuple[str, ...] = attrs.field(converter=tuple)  # per layer, one of MIXERS
    mlps: tuple[str, ...] = attrs.field(converter=tuple)  # per layer, one of MLPS
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    # attention (gqa, gattn, mmattn) and MLA; rotary_dim: the leading dims RoPE rotates
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
    # recurrent layers: heads (value heads for GDN), key heads, head dims, conv kernel
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
        """Every layer's kind, e.g. ``LLLALLLA``."""
        return "".join(self.kind(i) for i in range(self.num_layers))

    def kind(self, layer: int) -> str:
        """DESIGN's layer kind: ``L`` (recurrent state, snapshots) or ``A`` (paged)."""
        return "L" if self.mixers[layer] in RECURRENT else "A"

    def validate(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown family {self.family!r}; known: {', '.join(FAMILIES)}")
        if len(self.mixers) != self.num_layers or len(self.mlps) != self.num_layers:
            raise ValueError(
                f"{self.num_layers} layers but {len(self.mixers)} mixer kinds "
                f"and {len(self.mlps)} MLP kinds"
            )
        if set(self.mixers) - set(MIXERS):
            raise ValueError(f"unknown mixer kinds {sorted(set(self.mixers) - set(MIXERS))}; "
                             f"known: {', '.join(MIXERS)}")  # fmt: skip
        if set(self.mlps) - set(MLPS):
            raise ValueError(f"unknown MLP kinds {sorted(set(self.mlps) - set(MLPS))}")
        if set(self.mixers) & set(GROUPED):
            if not self.num_kv_heads or self.num_heads % self.num_kv_heads:
                raise ValueError(
                    f"{self.num_heads} heads do not group over {self.num_kv_heads} KV heads"
                )
            if self.rotary_dim > self.head_dim or self.rotary_dim % 2:
                raise ValueError(f"rotary_dim {self.rotary_dim} is not an even number of the "
                                 f"{self.head_dim} head dims")  # fmt: skip
        if set(self.mixers) & set(RECURRENT) and not (self.linear_heads and self.linear_k_dim):
            raise ValueError("recurrent layers need linear_heads and linear_k_dim")
