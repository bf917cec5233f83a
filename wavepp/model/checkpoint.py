"""Weights on disk: Hugging Face directories and WavePP's own layout.

- A Hugging Face directory (``config.json`` + ``*.safetensors``) as ``save_pretrained``
  writes it, of a Llama-family model (``model_type`` llama, SiLU MLP, default RoPE: an
  ``A``-only ``ModelConfig``) or of one of the families in ``wavepp.model``
  (``kimi_linear``, ``qwen3_next``, ``minimax_m2``: a ``FamilyConfig``).
- WavePP's own layout, for its gated-linear-attention hybrids: ``wavepp_config.json``
  (the ``ModelConfig`` fields) + ``model.safetensors`` with the same names,
  ``linear_attn`` for L layers. ``python -m wavepp.model.checkpoint --model tiny-hybrid
  --seed 0 --out DIR`` writes one; ``--model tiny-kimi`` writes a Kimi Linear directory.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import attrs
import torch
from safetensors.torch import load_file, save_file

from wavepp.model import FAMILIES, FamilyConfig, config_from_family
from wavepp.model.builtin import BUILTIN, ModelConfig, random_weights
from wavepp.model.config import kimi_hf_config

OWN_CONFIG = "wavepp_config.json"
SUPPORTED = ("llama", *FAMILIES)  # Hugging Face model_type values that load


def config_from_hf(data: dict) -> ModelConfig | FamilyConfig:
    kind = data.get("model_type")
    if kind in FAMILIES:
        return config_from_family(data)
    if kind != "llama":
        names = data.get("architectures") or [kind]
        raise ValueError(
            f"checkpoint architecture {', '.join(map(str, names))} (model_type {kind!r}) is "
            f"not supported; supported model_type values: {', '.join(SUPPORTED)}"
        )
    if data.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {data['hidden_act']!r} is not SiLU")
    rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"RoPE scaling {rope!r} is not supported")
    if data.get("attention_bias") or data.get("mlp_bias"):
        raise ValueError("biased attention or MLP projections are not supported")
    heads = data["num_attention_heads"]
    return ModelConfig(
        vocab_size=data["vocab_size"],
        d_model=data["hidden_size"],
        num_layers=data["num_hidden_layers"],
        pattern="A",
        num_heads=heads,
        num_kv_heads=data.get("num_key_value_heads") or heads,
        head_dim=data.get("head_dim") or data["hidden_size"] // heads,
        d_ff=data["intermediate_size"],
        rope_theta=float(rope.get("rope_theta", data.get("rope_theta", 10_000.0))),
        norm_eps=float(data.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(data.get("tie_word_embeddings", False)),
    )


def load_checkpoint(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig | FamilyConfig, dict[str, torch.Tensor]]:
    """The config and the weights, each tensor read straight into ``dtype`` (the run's
    ``--dtype``: a bf16 run never holds a float32 copy of the checkpoint)."""
    root = Path(path)
    if (root / OWN_CONFIG).exists():
        cfg = ModelConfig(**json.loads((root / OWN_CONFIG).read_text()))
    elif (root / "config.json").exists():
        cfg = config_from_hf(json.loads((root / "config.json").read_text()))
    else:
        raise FileNotFoundError(f"{root} has neither {OWN_CONFIG} nor a Hugging Face config.json")
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {root}")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update({k: v.to(dtype) for k, v in load_file(str(file)).items()})
    cfg.validate()
    return cfg, weights


def write_checkpoint(
    path: str | Path, cfg: ModelConfig | FamilyConfig, weights: dict[str, torch.Tensor]
) -> None:
    """WavePP's layout for a ``ModelConfig``; a Hugging Face ``config.json`` (as
    ``save_pretrained`` writes it) for a Kimi Linear ``FamilyConfig``."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    if isinstance(cfg, FamilyConfig):
        (root / "config.json").write_text(json.dumps(kimi_hf_config(cfg), indent=2) + "\n")
    else:
        (root / OWN_CONFIG).write_text(json.dumps(attrs.asdict(cfg), indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in weights.items()}, str(root / "model.safetensors"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m wavepp.model.checkpoint",
        description="Write a built-in model with seeded random weights: tiny-kimi as a "
        "Hugging Face Kimi Linear directory, the others in WavePP's layout.",
    )
    parser.add_argument("--model", default="tiny-kimi", choices=sorted(BUILTIN))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="directory to write")
    args = parser.parse_args(argv)
    cfg = BUILTIN[args.model]
    write_checkpoint(args.out, cfg, random_weights(cfg, args.seed))
    print(f"wrote {args.model} (seed {args.seed}) to {args.out}")


if __name__ == "__main__":
    main()
