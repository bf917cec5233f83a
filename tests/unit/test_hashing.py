import numpy as np
import pytest
import xxhash

from wavepp.state import ROOT_SEED, block_hashes, extend_block_hashes, num_blocks_for


def _raw(tokens: list[int]) -> bytes:
    return np.asarray(tokens, dtype="<i4").tobytes()


def test_hashes_chain_on_the_parent():
    tokens = list(range(10))  # block 4: two full blocks and a partial one
    h = block_hashes(tokens, 4)
    assert len(h) == 2
    h0 = xxhash.xxh3_64_intdigest(_raw([0, 1, 2, 3]), seed=ROOT_SEED)
    h1 = xxhash.xxh3_64_intdigest(_raw([4, 5, 6, 7]), seed=h0)
    assert h == (h0, h1)


def test_equal_blocks_after_different_prefixes_hash_differently():
    a = block_hashes([1, 1, 7, 7], 2)
    b = block_hashes([2, 2, 7, 7], 2)
    assert a[1] != b[1]
    assert block_hashes([1, 1, 7, 7, 5], 2) == a  # the partial block is not hashed


def test_extend_hashes_only_new_blocks():
    tokens = np.arange(64 * 10, dtype=np.int32)
    first = block_hashes(tokens[: 64 * 6 + 5], 64)
    extended = extend_block_hashes(first, tokens, 64)
    assert extended == block_hashes(tokens, 64)
    assert extended[:6] == first
    # A wrong "known prefix" is trusted, which proves the known blocks are not rehashed.
    fake = (1, 2, 3, 4, 5, 6)
    assert extend_block_hashes(fake, tokens, 64)[:6] == fake


def test_bad_arguments_say_why():
    with pytest.raises(ValueError, match="block_size must be positive"):
        block_hashes([1, 2], 0)
    with pytest.raises(ValueError, match="7 known block hashes but the prompt has only 1"):
        extend_block_hashes(tuple(range(7)), [1, 2, 3], 2)
    assert num_blocks_for(129, 64) == 3
    assert num_blocks_for(128, 64) == 2
