"""Model directories, good and broken: a tiny Llama as Hugging Face lays it out
(``config.json`` + ``model.safetensors``), each broken one made from it by one change,
with what its refusal must name; and a checkpoint whose logits turn NaN for prompts
holding one token id, and for no other."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from wavepp.model import BUILTIN, hf_config, random_weights
from wavepp.model.checkpoint import write_checkpoint

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
Q0 = "model.layers.0.self_attn.q_proj.weight"


def good_model(path: Path) -> Path:
    """tiny-llama (seed 0) as ``save_pretrained`` writes a Llama: config.json and one
    safetensors file."""
    cfg = BUILTIN["tiny-llama"]
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG).write_text(json.dumps(hf_config(cfg), indent=2))
    save_file(random_weights(cfg, 0), str(path / WEIGHTS))
    return path


def _edit_config(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        data = json.loads((path / CONFIG).read_text())
        change(data)
        (path / CONFIG).write_text(json.dumps(data))  # NaN and Infinity as JSON's literals

    return edit


def _edit_weights(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        weights = load_file(str(path / WEIGHTS))
        change(weights)
        save_file(weights, str(path / WEIGHTS))

    return edit


def _cut_config(path: Path) -> None:
    text = (path / CONFIG).read_text()
    (path / CONFIG).write_text(text[: len(text) // 2])


def _cut_weights(path: Path) -> None:
    data = (path / WEIGHTS).read_bytes()
    (path / WEIGHTS).write_bytes(data[: len(data) // 2])


# id -> (the change, what the one line names: the file, then the field or tensor)
BROKEN: dict[str, tuple[Callable[[Path], None], tuple[str, ...]]] = {
    "config-cut-mid-object": (_cut_config, (f"{CONFIG}: not valid JSON",)),
    "hidden-size-a-string": (_edit_config(lambda d: d.update(hidden_size="x")),
                             (f"{CONFIG}: field hidden_size", "'x'")),
    "hidden-size-negative": (_edit_config(lambda d: d.update(hidden_size=-128)),
                             (f"{CONFIG}: field hidden_size", "-128")),
    "field-missing": (_edit_config(lambda d: d.pop("intermediate_size")),
                      (f"{CONFIG}: field intermediate_size is missing",)),
    "unknown-architecture": (_edit_config(lambda d: d.update(model_type="gpt2",
                                                             architectures=["GPT2LMHeadModel"])),
                             (f"{CONFIG}:", "GPT2LMHeadModel", "model_type 'gpt2'")),
    "layers-absurd": (_edit_config(lambda d: d.update(num_hidden_layers=10**9)),
                      (f"{CONFIG}: field num_hidden_layers", "more than 4,096")),
    "norm-eps-nan": (_edit_config(lambda d: d.update(rms_norm_eps=float("nan"))),
                     (f"{CONFIG}: field rms_norm_eps", "nan")),
    "rope-theta-inf": (_edit_config(lambda d: d.update(rope_theta=float("inf"))),
                       (f"{CONFIG}: field rope_theta", "inf")),
    "hidden-size-1e9": (_edit_config(lambda d: d.update(hidden_size=1e9)),
                        (f"{CONFIG}: the run needs at least", "GB available")),
    "weights-cut": (_cut_weights, (f"{WEIGHTS}: truncated",)),
    "tensor-wrong-shape": (_edit_weights(lambda w: w.update({Q0: w[Q0][:64].contiguous()})),
                           (f"{WEIGHTS}: tensor {Q0}: shape [64, 128]", "needs [128, 128]")),
    "tensor-wrong-dtype": (_edit_weights(lambda w: w.update({Q0: w[Q0].to(torch.int32)})),
                           (f"{WEIGHTS}: tensor {Q0}: dtype I32",)),
    "tensor-missing": (_edit_weights(lambda w: w.pop("model.norm.weight")),
                       (f"{WEIGHTS}: tensor model.norm.weight is missing",)),
    "tensor-nan": (_edit_weights(lambda w: w[Q0].fill_(float("nan"))),
                   (f"{WEIGHTS}: tensor {Q0}: holds non-finite values",)),
}  # fmt: skip


def broken_model(path: Path, case: str) -> Path:
    good_model(path)
    BROKEN[case][0](path)
    return path


def nan_trap_model(path: Path, token: int) -> Path:
    """tiny-llama (seed 0, WavePP's layout) whose logits are NaN for any prompt holding
    ``token`` and finite for every other: only that token's embedding has a component
    along the residual stream's first dimension, no layer writes that dimension, and
    the first layer's query and key projections read it with weights of 1e20, so that
    the token's attention scores overflow."""
    cfg = BUILTIN["tiny-llama"]
    weights = random_weights(cfg, 0)
    embed = weights["model.embed_tokens.weight"]  # [vocab, d_model]
    embed[:, 0] = 0.0
    embed[token, 0] = 1.0
    for i in range(cfg.num_layers):
        weights[f"model.layers.{i}.self_attn.o_proj.weight"][0] = 0.0
        weights[f"model.layers.{i}.mlp.down_proj.weight"][0] = 0.0
    for name in ("q_proj", "k_proj"):
        weights[f"model.layers.0.self_attn.{name}.weight"][:, 0] = 1e20
    write_checkpoint(path, cfg, weights)
    return path
