"""Chained block hashes of token arrays (DESIGN §2).

``h_i = xxh3_64(tokens of block i, seed=h_{i-1})`` with ``h_{-1} = ROOT_SEED``. A hash
names a whole prefix, so equal hashes at any position mean equal prefixes. Only full
blocks are hashed. Tokens are hashed as little-endian int32 bytes.
"""

from collections.abc import Sequence

import numpy as np
import xxhash

from wavepp.state.ids import BlockHash

ROOT_SEED = 0x5741_5645_5050_0001  # "WAVEPP" + 1: the parent of block 0
_TOKEN_DTYPE = np.dtype("<i4")
_xxh3 = xxhash.xxh3_64_intdigest


def as_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a contiguous little-endian int32 array (no copy when already one)."""
    array = np.ascontiguousarray(tokens, dtype=_TOKEN_DTYPE)
    if array.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {array.shape}")
    return array


def block_hashes(tokens: Sequence[int] | np.ndarray, block_size: int) -> tuple[BlockHash, ...]:
    """Hashes of every full block of ``tokens``."""
    return extend_block_hashes((), tokens, block_size)


def extend_block_hashes(
    hashes: tuple[BlockHash, ...], tokens: Sequence[int] | np.ndarray, block_size: int
) -> tuple[BlockHash, ...]:
    """Hashes of ``tokens``' full blocks, reusing ``hashes`` of an earlier prefix of it.

    Only the blocks past ``len(hashes)`` are hashed, so extending a 200K-token prompt by
    4K tokens costs 64 block hashes, not 3,189. The caller vouches that ``hashes`` were
    computed from the same leading tokens.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    array = as_tokens(tokens)
    num_blocks = len(array) // block_size
    if len(hashes) > num_blocks:
        raise ValueError(
            f"{len(hashes)} known block hashes but the prompt has only {num_blocks} full blocks"
        )
    if len(hashes) == num_blocks:
        return hashes
    raw = memoryview(array.tobytes())
    step = block_size * _TOKEN_DTYPE.itemsize
    parent = hashes[-1] if hashes else ROOT_SEED
    out = list(hashes)
    append = out.append
    for offset in range(len(hashes) * step, num_blocks * step, step):
        parent = _xxh3(raw[offset : offset + step], seed=parent)
        append(parent)
    return tuple(out)  # type: ignore[arg-type]


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens, the partial last block included."""
    return -(-num_tokens // block_size)
