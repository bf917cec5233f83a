"""Element types by name: the one table of the names WavePP's options (``--dtype``), run
records and handoff tensors use, with each one's size in bytes. Torch-free: a torch or
numpy dtype converts by its name (``torch.bfloat16`` is ``"bfloat16"``)."""

from __future__ import annotations

ITEMSIZE: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "int32": 4}
FLOATS = ("float32", "bfloat16", "float16")  # what a model computes and caches in


def name_of(dtype: object) -> str:
    """The table's name of a torch or numpy dtype; ValueError for one it has not."""
    name = str(dtype).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise ValueError(f"dtype {dtype} is not one of {', '.join(ITEMSIZE)}")
    return name


def torch_dtype(name: str):
    """The torch dtype of a floating-point name of the table (``FLOATS``)."""
    if name not in FLOATS:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(FLOATS)}")
    import torch

    return getattr(torch, name)
