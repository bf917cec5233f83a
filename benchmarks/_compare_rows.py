"""The models, rows and FLOP counts of ``benchmarks.vllm_compare`` (pure: no torch at import).

A row is a set of prompts one timed call runs at once, with the calls that come before it
untimed: the shared prefixes written first (``seeds``), then a warm-up on the row's own
shapes (``warmup``: prompts of the measured length, their own tokens, over the same
prefixes). Both engines get the same three lists.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ModelShape:
    """A random-weight Llama both engines load from one Hugging Face directory."""

    num_layers: int
    d_model: int
    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int
    d_mlp: int  # the gated MLP's inner width (gate, up: d_model -> d_mlp; down back)
    vocab: int
    seed: int  # torch.manual_seed before the weights are drawn


MODELS = {
    # the 4-layer test Llama of the earlier runs
    "llama-4l": ModelShape(4, 256, 4, 2, 64, 1024, 32_000, 0),
    # a ~0.5B model's shapes (Qwen2.5-0.5B: 24 layers, hidden 896, 14 / 2 heads, MLP
    # 4,864) with a 32,000-token vocabulary: 415M parameters
    "llama-24l": ModelShape(24, 896, 14, 2, 64, 4864, 32_000, 0),
}


@dataclass(frozen=True)
class Row:
    """One row: ``num_prompts`` prompts of ``num_tokens``, the first ``shared`` share of
    each a prefix of ``num_prefixes`` (prompt i over prefix i mod num_prefixes)."""

    num_prompts: int
    num_tokens: int
    shared: float = 0.0
    num_prefixes: int = 0
    seed: int = 0

    @property
    def prefix_len(self) -> int:
        return int(self.num_tokens * self.shared)

    @property
    def num_warmup(self) -> int:
        """Warm-up prompts before the timed call: a quarter of the row, at least one."""
        return max(1, self.num_prompts // 4)


# Per model, sized so one call of the deep model takes a minute or two in fp32 on two
# cores; the 4-layer model keeps the earlier rows' sizes.
ROWS = {
    "llama-4l": {
        "cold-4k": Row(16, 4096, seed=1),
        "cold-16k": Row(8, 16_384, seed=6),
        "shared-8k": Row(16, 8192, 0.9, 4, seed=4),
        # the paper's regime: short new suffixes (256) on long cached prefixes (3,840)
        "short-suffix": Row(128, 4096, 0.9375, 4, seed=9),
    },
    "llama-24l": {
        "cold-4k": Row(2, 4096, seed=1),
        "cold-16k": Row(1, 16_384, seed=6),
        "shared-8k": Row(8, 8192, 0.9, 1, seed=4),
        "short-suffix": Row(32, 4096, 0.9375, 1, seed=9),
    },
}
# The settings sweep runs on this row only, never on a measured one: half cold, half shared.
TUNE_ROWS = {
    "llama-4l": Row(16, 6144, 0.5, 2, seed=20),
    "llama-24l": Row(4, 3072, 0.5, 1, seed=20),
}


@dataclass(frozen=True)
class Prompts:
    seeds: list[list[int]]  # the prefixes, written untimed first
    warmup: list[list[int]]  # untimed, the measured prompts' shapes
    measured: list[list[int]]  # timed

    def as_job(self) -> dict:
        return {"seeds": self.seeds, "warmup": self.warmup, "prompts": self.measured}


def prompts(row: Row, vocab: int) -> Prompts:
    """The row's token lists, the same for every engine and every repeat."""
    prefix_rng, suffix_rng, warm_rng = (np.random.default_rng([row.seed, i]) for i in range(3))

    def tokens(rng, n: int) -> list[int]:
        return rng.integers(3, vocab, n).tolist()

    if not row.shared:
        return Prompts([], [tokens(warm_rng, row.num_tokens) for _ in range(row.num_warmup)],
                       [tokens(suffix_rng, row.num_tokens) for _ in range(row.num_prompts)])
    seeds = [tokens(prefix_rng, row.prefix_len) for _ in range(row.num_prefixes)]
    suffix = row.num_tokens - row.prefix_len
    return Prompts(
        seeds,
        [seeds[i % len(seeds)] + tokens(warm_rng, suffix) for i in range(row.num_warmup)],
        [seeds[i % len(seeds)] + tokens(suffix_rng, suffix) for i in range(row.num_prompts)],
    )


def prefill_flops(m: ModelShape, cached: int, new: int, full_last_layer: bool = True) -> float:
    """FLOPs to prefill ``new`` tokens after ``cached`` ones and read one row of logits:
    2 per multiply-add of every matrix product (the projections, the MLP, the head for
    the last token only) and of attention's two products (each new token at position t
    against the t + 1 keys up to itself: the causal half, not the masked rectangle).
    Norms, rotary, SiLU and softmax are left out (a few per element: under 1% here). With
    ``full_last_layer=False`` the last layer runs its keys and values for every token and
    the rest for the last token only, as WavePP's rows-only last layer does."""
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    keys_values = 2 * m.d_model * 2 * kv  # k and v projections, a token
    per_token = keys_values + 2 * m.d_model * q * 2 + 3 * 2 * m.d_model * m.d_mlp  # + q, o, MLP
    key_sum = new * cached + new * (new + 1) // 2  # sum over new tokens of keys attended
    attention = 2 * 2 * q  # QK^T and PV, per (token, key)
    layer = per_token * new + attention * key_sum
    if full_last_layer:
        last = layer
    else:
        last = keys_values * new + (per_token - keys_values) + attention * (cached + new)
    head = 2 * m.d_model * m.vocab
    return float((m.num_layers - 1) * layer + last + head) if new else 0.0


def row_flops(m: ModelShape, lengths: list[int], cached: list[int],
              full_last_layer: bool = True) -> float:  # fmt: skip
    """Summed over a call's prompts: each one's length and the tokens its engine found
    cached (so an engine that misses is credited with the work it did)."""
    return sum(prefill_flops(m, c, n - c, full_last_layer)
               for n, c in zip(lengths, cached, strict=True))  # fmt: skip


def write_checkpoint(m: ModelShape, path) -> None:
    """The model as a Hugging Face directory (fp32 safetensors), drawn from ``m.seed``."""
    import torch
    import transformers

    torch.manual_seed(m.seed)
    config = transformers.LlamaConfig(
        vocab_size=m.vocab, hidden_size=m.d_model, intermediate_size=m.d_mlp,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim,
        max_position_embeddings=32_768, rms_norm_eps=1e-5, tie_word_embeddings=False,
        torch_dtype="float32",
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
