"""Weights on disk: Hugging Face directories and WavePP's own layout.

- A Hugging Face directory (``config.json`` + ``*.safetensors``) as ``save_pretrained``
  writes it, of any ``model_type`` in ``wavepp.model.registry.MODEL_TYPES`` (``llama``:
  SiLU MLP, default RoPE; ``kimi_linear``, ``qwen3_next``, ``minimax_m2``).
- WavePP's own layout, for its Llama-layout gated-linear-attention hybrids:
  ``wavepp_config.json`` (``llama_config``'s fields) + ``model.safetensors`` with
  Llama's names, ``linear_attn`` for L layers. ``python -m wavepp.model.checkpoint
  --model tiny-hybrid --seed 0 --out DIR`` writes one; ``--model tiny-kimi`` writes a
  Kimi Linear directory.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from wavepp.model.config import ModelConfig
from wavepp.model.registry import BUILTIN, config_from_hf, hf_config, llama_config, own_layout
from wavepp.model.stage import random_weights

OWN_CONFIG = "wavepp_config.json"


def load_checkpoint(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and the weights, each tensor read straight into ``dtype`` (the run's
    ``--dtype``: a bf16 run never holds a float32 copy of the checkpoint)."""
    root = Path(path)
    if (root / OWN_CONFIG).exists():
        cfg = llama_config(**json.loads((root / OWN_CONFIG).read_text()))
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
    path: str | Path, cfg: ModelConfig, weights: dict[str, torch.Tensor]
) -> None:
    """WavePP's layout for a Llama-layout config; a Hugging Face ``config.json`` (as
    ``save_pretrained`` writes it) for a Kimi Linear one."""
    if cfg.family == "llama":
        name, config = OWN_CONFIG, own_layout(cfg)
    elif (config := hf_config(cfg)) is not None:
        name = "config.json"
    else:
        raise ValueError(f"no checkpoint layout is written for {cfg.family} models")
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / name).write_text(json.dumps(config, indent=2) + "\n")
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
