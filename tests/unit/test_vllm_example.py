"""vLLM ExampleConnector layout (wavepp.handoff.vllm_example), without vLLM: folder names,
the kv_cache tensor's layout, atomic writes. tests/integration/test_vllm_handoff.py runs
the real vLLM 0.32 on these files."""

import hashlib
import struct

import pytest
import safetensors.torch
import torch

from wavepp.handoff import vllm_example
from wavepp.handoff.vllm_example import (
    folder_lengths,
    folder_name,
    kv_cache_tensor,
    layer_file,
    write_layer,
)


def test_folder_name_is_md5_of_the_block_aligned_tokens_as_int64():
    by_hand = hashlib.md5(struct.pack("<4q", 5, 6, 7, 8)).hexdigest()
    assert by_hand == "b060da61cfcb65ece211a0e1fa6e1f00"  # vLLM 0.32's own for [5, 6, 7, 8]
    assert folder_name([5, 6, 7, 8, 9, 10], 4) == by_hand  # 9, 10: past the last block
    assert folder_name([5, 6, 7, 8], 4) == by_hand
    # vLLM 0.32's _generate_foldername_debug(torch.tensor(range(100, 170))[:64], [])
    assert folder_name(list(range(100, 170)), 32) == "e9522fcde4e77460324837a18dfeae64"
    assert folder_name(torch.arange(100, 170, dtype=torch.int32), 32) == (
        "e9522fcde4e77460324837a18dfeae64"
    )  # any integer dtype hashes as int64


def test_folder_lengths_cover_what_vllm_looks_up_and_loads():
    def reads(prompt: int, block: int) -> set[int]:  # example_connector.py lines 297, 50
        return {n for n in ((prompt - 2) // block * block, (prompt - 1) // block * block)
                if n > 0}  # fmt: skip

    for tokens in range(1, 200):
        for block in (4, 32):
            given = set(folder_lengths(tokens, block))
            # vLLM given the prompt alone (tokens) or with its first token (tokens + 1)
            assert reads(tokens, block) | reads(tokens + 1, block) == given, (tokens, block)
    assert folder_lengths(75, 32) == (64,)
    assert folder_lengths(64, 32) == (64, 32)
    assert folder_lengths(65, 32) == (64, 32)
    assert folder_lengths(31, 32) == ()


def test_layer_file_names_vllm_llama_attention_layers():
    assert layer_file(0) == "model.layers.0.self_attn.attn.safetensors"
    assert layer_file(17) == "model.layers.17.self_attn.attn.safetensors"
    with pytest.raises(ValueError, match="negative"):
        layer_file(-1)


def test_kv_cache_tensor_shape_and_cpu_page_layout():
    tokens, heads, head_dim, block = 11, 2, 3, 4
    k = torch.randn(tokens, heads, head_dim)
    v = torch.randn(tokens, heads, head_dim)
    out = kv_cache_tensor(k, v, block)
    assert out.shape == (8, heads, 2 * head_dim) and out.dtype == k.dtype
    assert out.is_contiguous()
    # What vLLM's injection and CPU kernel make of it: rows of a (block, head) page of
    # [B, 2D] elements; the page holds keys as [D, B], then values as [B, D].
    pages = out.reshape(2, block, heads, 2 * head_dim).transpose(1, 2).reshape(2, heads, -1)
    for b in range(2):
        for h in range(heads):
            keys = pages[b, h, : block * head_dim].reshape(head_dim, block)
            values = pages[b, h, block * head_dim :].reshape(block, head_dim)
            assert torch.equal(keys, k[b * block : (b + 1) * block, h].T)
            assert torch.equal(values, v[b * block : (b + 1) * block, h])


def test_kv_cache_tensor_refuses_mismatched_rows():
    with pytest.raises(ValueError, match="must both be"):
        kv_cache_tensor(torch.zeros(8, 2, 4), torch.zeros(8, 2, 5), 4)
    with pytest.raises(ValueError, match="must both be"):
        kv_cache_tensor(torch.zeros(8, 8), torch.zeros(8, 8), 4)
    with pytest.raises(ValueError, match="positive"):
        kv_cache_tensor(torch.zeros(8, 2, 4), torch.zeros(8, 2, 4), 0)


def test_write_layer_creates_the_folder_and_leaves_no_temporary_file(tmp_path):
    k, v = torch.randn(10, 2, 4), torch.randn(10, 2, 4)
    folder = tmp_path / "kv" / folder_name(list(range(10)), 4)
    path = write_layer(folder, 3, k, v, 4)
    assert path == folder / "model.layers.3.self_attn.attn.safetensors"
    assert [p.name for p in folder.iterdir()] == [path.name]
    loaded = safetensors.torch.load_file(path)
    assert list(loaded) == ["kv_cache"]
    assert torch.equal(loaded["kv_cache"], kv_cache_tensor(k, v, 4))
    with pytest.raises(ValueError, match="less than one block"):
        write_layer(folder, 0, k[:3], v[:3], 4)


def test_a_failed_write_keeps_the_old_file_whole(tmp_path, monkeypatch):
    k, v = torch.randn(8, 2, 4), torch.randn(8, 2, 4)
    path = write_layer(tmp_path, 0, k, v, 4)
    before = path.read_bytes()

    def half_then_fail(tensors, filename):
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(vllm_example.safetensors.torch, "save_file", half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        write_layer(tmp_path, 0, -k, -v, 4)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
