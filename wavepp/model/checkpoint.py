"""Weights on disk: Hugging Face directories and WavePP's own layout.

- A Hugging Face directory (``config.json`` + ``*.safetensors``) as ``save_pretrained``
  writes it, of any ``model_type`` in ``wavepp.model.registry.MODEL_TYPES`` (``llama``:
  SiLU MLP, default RoPE; ``kimi_linear``, ``qwen3_next``, ``minimax_m2``).
- WavePP's own layout, for its Llama-layout gated-linear-attention hybrids:
  ``wavepp_config.json`` (``llama_config``'s fields) + ``model.safetensors`` with
  Llama's names, ``linear_attn`` for L layers. ``python -m wavepp.model.checkpoint
  --model tiny-hybrid --seed 0 --out DIR`` writes one; ``--model tiny-kimi`` writes a
  Kimi Linear directory.

A directory is input: its config's fields are checked (``wavepp.model.fields``), every
tensor the config needs is found in the safetensors headers with its shape and a float
dtype, and each tensor is checked finite as it loads; what is wrong is one
:class:`CheckpointError` naming the file and the field or tensor.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
from pathlib import Path

import attrs
import torch
from safetensors.torch import load_file, save_file

from wavepp.model.config import ModelConfig
from wavepp.model.fields import CheckpointError, checked_fields
from wavepp.model.footprint import footprint
from wavepp.model.registry import BUILTIN, config_from_hf, hf_config, llama_config, own_layout
from wavepp.model.stage import random_weights

OWN_CONFIG = "wavepp_config.json"
MAX_HEADER_BYTES = 100_000_000  # a safetensors header's bound (the format's own)
# bytes per element of each safetensors dtype; the float ones are what weights may be
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
                "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8,
                "F64": 8}  # fmt: skip
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def config_file(root: Path) -> Path:
    """The directory's config: WavePP's own layout, else Hugging Face's."""
    own = root / OWN_CONFIG
    return own if own.exists() else root / "config.json"


def read_config(path: str | Path) -> ModelConfig:
    """The directory's config, every field WavePP reads checked (``wavepp.model.fields``);
    :class:`CheckpointError` naming the file and the field otherwise."""
    root = Path(path)
    file = config_file(root)
    name = file.name
    if not file.exists():
        raise CheckpointError(f"{root}: neither {OWN_CONFIG} nor a Hugging Face config.json")
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{name}: cannot be read ({error})") from None
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{name}: not valid JSON: {error.msg} at line {error.lineno}, "
                              f"column {error.colno}") from None  # fmt: skip
    except RecursionError:
        raise CheckpointError(f"{name}: not valid JSON: nested too deeply") from None
    data = checked_fields(data, name)
    try:
        cfg = _own_config(data, name) if name == OWN_CONFIG else config_from_hf(data)
        cfg.validate()
    except KeyError as error:
        kind = data.get("model_type")
        raise CheckpointError(f"{name}: field {error.args[0]} is missing" + (
            f" (a {kind} config needs it)" if kind else "")) from None  # fmt: skip
    except (ValueError, TypeError) as error:
        raise CheckpointError(f"{name}: {error}") from None
    return cfg


def _own_config(data: dict, name: str) -> ModelConfig:
    fields = inspect.signature(llama_config).parameters
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise CheckpointError(f"{name}: field {unknown[0]} is not one of WavePP's layout "
                              f"({', '.join(fields)})")  # fmt: skip
    missing = [k for k, p in fields.items() if p.default is p.empty and k not in data]
    if missing:
        raise KeyError(missing[0])
    return llama_config(**data)


@attrs.frozen
class TensorHeader:
    file: str  # the safetensors file holding it
    dtype: str  # safetensors' name: F32, BF16, ...
    shape: tuple[int, ...]


def read_header(path: Path) -> dict[str, TensorHeader]:
    """A safetensors file's tensors as its header describes them, every entry checked
    against the file's size (a truncated file is found here, nothing else read)."""
    name = path.name
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            first = f.read(8)
            length = int.from_bytes(first, "little") if len(first) == 8 else None
            if length is None:
                raise CheckpointError(f"{name}: truncated: {size} bytes, not even the 8 that "
                                      "give its header's length")  # fmt: skip
            if length > MAX_HEADER_BYTES:
                raise CheckpointError(f"{name}: a header of {length:,} bytes (at most "
                                      f"{MAX_HEADER_BYTES:,}): not a safetensors file")  # fmt: skip
            if 8 + length > size:
                raise CheckpointError(f"{name}: truncated: its header needs {length:,} bytes, "
                                      f"the file holds {size - 8:,} after the first 8")  # fmt: skip
            raw = f.read(length)
    except OSError as error:
        raise CheckpointError(f"{name}: cannot be read ({error})") from None
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):
        header = None
    if not isinstance(header, dict):
        raise CheckpointError(f"{name}: its header is not a JSON object")
    data_bytes = size - 8 - length
    out = {}
    for tensor, entry in header.items():
        if tensor == "__metadata__":
            continue
        out[tensor] = _entry(name, tensor, entry, data_bytes)
    return out


def _entry(name: str, tensor: str, entry: object, data_bytes: int) -> TensorHeader:
    where = f"{name}: tensor {tensor[:200]}"
    ok = (isinstance(entry, dict) and entry.get("dtype") in _DTYPE_BYTES
          and isinstance(entry.get("shape"), list)
          and all(type(n) is int and n >= 0 for n in entry["shape"])
          and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2
          and all(type(n) is int and n >= 0 for n in entry["data_offsets"]))  # fmt: skip
    if not ok:
        raise CheckpointError(f"{where}: its header entry is not a dtype, a shape and two "
                              f"data offsets: {str(entry)[:120]}")  # fmt: skip
    begin, end = entry["data_offsets"]
    need = math.prod(entry["shape"]) * _DTYPE_BYTES[entry["dtype"]]
    if end - begin != need:
        raise CheckpointError(f"{where}: {end - begin:,} bytes for shape {entry['shape']} of "
                              f"{entry['dtype']}, which needs {need:,}")  # fmt: skip
    if end > data_bytes:
        raise CheckpointError(f"{name}: truncated: tensor {tensor[:200]} ends at byte {end:,} "
                              f"of the data, the file holds {data_bytes:,}")  # fmt: skip
    return TensorHeader(name, entry["dtype"], tuple(entry["shape"]))


def weight_files(path: str | Path) -> list[Path]:
    root = Path(path)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root}: no *.safetensors file")
    return files


def check_tensors(path: str | Path, expected: dict[str, tuple[int, ...]]) -> None:
    """Every tensor the config needs (``expected``: name -> shape) is in the directory's
    safetensors files, once, of a float dtype and that shape; read from their headers
    alone. :class:`CheckpointError` naming the file and the tensor otherwise."""
    files = weight_files(path)
    found: dict[str, TensorHeader] = {}
    for file in files:
        for tensor, header in read_header(file).items():
            if tensor in found:
                raise CheckpointError(f"{file.name}: tensor {tensor[:200]} is also in "
                                      f"{found[tensor].file}")  # fmt: skip
            found[tensor] = header
    where = files[0].name if len(files) == 1 else "*.safetensors"
    for tensor, shape in expected.items():
        header = found.get(tensor)
        if header is None:
            raise CheckpointError(f"{where}: tensor {tensor} is missing (the config needs it, "
                                  f"shape {list(shape)})")  # fmt: skip
        if header.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{header.file}: tensor {tensor}: dtype {header.dtype}; "
                                  f"weights are {', '.join(FLOAT_DTYPES)}")  # fmt: skip
        if header.shape != shape:
            raise CheckpointError(f"{header.file}: tensor {tensor}: shape {list(header.shape)}, "
                                  f"the config needs {list(shape)}")  # fmt: skip


def load_checkpoint(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and the weights, each tensor read straight into ``dtype`` (the run's
    ``--dtype``: a bf16 run never holds a float32 copy of the checkpoint), and checked
    finite as it loads. :class:`CheckpointError` (a ValueError) naming the file and the
    field or tensor for a directory that cannot run."""
    cfg = read_config(path)
    check_tensors(path, footprint(cfg).tensors)
    weights: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        for name, tensor in load_file(str(file)).items():
            tensor = tensor.to(dtype)
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise CheckpointError(f"{file.name}: tensor {name[:200]}: holds non-finite "
                                      f"values (NaN or inf) in "
                                      f"{str(dtype).removeprefix('torch.')}")  # fmt: skip
            weights[name] = tensor
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
