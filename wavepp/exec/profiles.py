"""Device and model profiles for the simulated executor (DESIGN §6).

Device figures are datasheet peaks (dense bf16, no sparsity) with the efficiency a
prefill really gets: matrix units ≈ 80% of peak, attention lower. Model figures come
from the models' published ``config.json``.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class DeviceProfile:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bytes_s: float  # memory bandwidth, bytes/s
    gemm_efficiency: float  # share of peak a GEMM reaches
    attention_efficiency: float  # share of peak prefill attention reaches
    wave_overhead_s: float  # launch and synchronization per wave per stage


DEVICES: dict[str, DeviceProfile] = {
    "h100": DeviceProfile("h100", 989e12, 3.35e12, 0.80, 0.55, 0.0005),
    "h200": DeviceProfile("h200", 989e12, 4.8e12, 0.80, 0.55, 0.0005),
    "b200": DeviceProfile("b200", 2.25e15, 8.0e12, 0.80, 0.55, 0.0005),
}


@attrs.frozen
class ModelProfile:
    """Per-layer shapes of a decoder LM; ``pattern`` repeats over the layers (A / L)."""

    name: str
    num_layers: int
    pattern: str  # e.g. "A" (dense) or "LLLA" (three linear-attention layers, one attention)
    d_model: int
    num_heads: int  # attention query heads
    num_kv_heads: int
    head_dim: int
    attn_q_factor: int  # 2 when the query projection also yields an output gate
    mlp_active_params: int  # active MLP/MoE parameters per layer (per token)
    mlp_total_params: int  # all MLP/MoE parameters per layer (weights read per wave)
    linear_qk_dim: int  # L layers: total key (= query) width
    linear_v_dim: int  # L layers: total value width
    linear_heads: int  # L layers: value heads (each with a head_dim x head_dim state)
    linear_head_dim: int
    vocab: int
    bytes_per_param: int = 2  # bf16

    def kind(self, layer: int) -> str:
        return self.pattern[layer % len(self.pattern)]

    def attn_params(self) -> int:
        d, q = self.d_model, self.num_heads * self.head_dim
        return d * q * self.attn_q_factor + 2 * d * self.num_kv_heads * self.head_dim + q * d

    def linear_params(self) -> int:
        d = self.d_model
        qk, v = self.linear_qk_dim, self.linear_v_dim
        return d * (2 * qk + 2 * v + 2 * self.linear_heads) + v * d  # q,k,v,gate,a,b,out

    def mixer_params(self, layer: int) -> int:
        return self.attn_params() if self.kind(layer) == "A" else self.linear_params()


def _llama3_70b() -> ModelProfile:
    # meta-llama/Meta-Llama-3-70B config.json
    d, ff = 8192, 28672
    return ModelProfile(
        name="llama3-70b", num_layers=80, pattern="A", d_model=d, num_heads=64,
        num_kv_heads=8, head_dim=128, attn_q_factor=1, mlp_active_params=3 * d * ff,
        mlp_total_params=3 * d * ff, linear_qk_dim=0, linear_v_dim=0, linear_heads=0,
        linear_head_dim=0, vocab=128_256,
    )  # fmt: skip


def _qwen3_next_80b() -> ModelProfile:
    # Qwen/Qwen3-Next-80B-A3B-Instruct config.json: 48 layers, full_attention_interval 4,
    # gated attention (16 heads x 256, 2 KV heads), Gated DeltaNet (16 key heads, 32
    # value heads, 128 dims), MoE of 512 experts x 512, 10 routed + 1 shared per token.
    d, expert = 2048, 3 * 2048 * 512
    return ModelProfile(
        name="qwen3-next-80b", num_layers=48, pattern="LLLA", d_model=d, num_heads=16,
        num_kv_heads=2, head_dim=256, attn_q_factor=2, mlp_active_params=11 * expert + d * 512,
        mlp_total_params=513 * expert + d * 512, linear_qk_dim=16 * 128,
        linear_v_dim=32 * 128, linear_heads=32, linear_head_dim=128, vocab=151_936,
    )  # fmt: skip


MODELS: dict[str, ModelProfile] = {m.name: m for m in (_llama3_70b(), _qwen3_next_80b())}


def split_layers(num_layers: int, num_stages: int, counts: list[int] | None = None) -> list[range]:
    """Layers of each stage: even by default (earlier stages take the remainder)."""
    if counts is None:
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (1 if s < extra else 0) for s in range(num_stages)]
    if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 1:
        raise ValueError(
            f"layers per stage {counts} must be {num_stages} positive counts summing to "
            f"{num_layers}"
        )
    starts = [sum(counts[:s]) for s in range(num_stages)]
    return [range(start, start + n) for start, n in zip(starts, counts, strict=True)]
