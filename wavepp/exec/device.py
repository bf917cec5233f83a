"""Where a rank computes: its device, dtype and CPU threads (``--device``, ``--dtype``,
``--threads``)."""

from __future__ import annotations

import os

import torch

from wavepp.dtypes import torch_dtype
from wavepp.host import usable_cores

DEVICE_CHOICES = ("auto", "cpu", "cuda")


def pick_device(choice: str) -> torch.device:
    """``auto``: this rank's GPU (``LOCAL_RANK``) when CUDA is present, else the CPU."""
    if choice not in DEVICE_CHOICES:
        raise ValueError(f"device {choice!r} is not one of {', '.join(DEVICE_CHOICES)}")
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit(
            "wavepp: --device cuda, but torch sees no CUDA device (a CPU build of torch, "
            "or no GPU visible to this process)"
        )
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def pick_dtype(name: str) -> torch.dtype:
    """``--dtype``'s torch dtype (one of ``wavepp.dtypes.FLOATS``)."""
    return torch_dtype(name)


def default_threads() -> int:
    """The cores this process may use, divided among the ranks of this node."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, usable_cores() // max(1, local_ranks))


def set_threads(threads: int) -> int:
    """Intra-op threads of this rank (0: :func:`default_threads`); returns the count."""
    count = threads or default_threads()
    torch.set_num_threads(count)
    return count
