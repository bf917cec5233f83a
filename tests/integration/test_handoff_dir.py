"""An offline run fills a folder for vLLM (``--handoff-format vllm-example``): each stage
writes its own layers' files, rank 0 renames every prompt's folders into place once all
stages are done, and the files hold transformers' own keys and values in vLLM's layout."""

from __future__ import annotations

import numpy as np
import pytest
import safetensors.torch
import torch

from tests.helpers.handoff_rig import run_pipeline, write_requests
from tests.helpers.hf_llama import BLOCK, VOCAB, prompt_cache, tiny_llama
from wavepp.handoff.vllm_example import folder_lengths, folder_name, kv_cache_tensor, layer_file

pytestmark = pytest.mark.slow


def test_an_offline_run_fills_vllms_folder_with_every_layer(tmp_path):
    model = tiny_llama(tmp_path / "llama")
    rng = np.random.default_rng(3)
    doc = rng.integers(3, VOCAB, 64).tolist()
    prompts = {"doc": doc, "turn": doc + rng.integers(3, VOCAB, 11).tolist(),
               "short": rng.integers(3, VOCAB, 40).tolist()}  # fmt: skip
    requests = write_requests(tmp_path / "requests.jsonl", prompts, True)
    storage = tmp_path / "kv"
    record = run_pipeline(2, str(tmp_path / "llama"), requests, tmp_path / "out.json",
                          "--concurrency", "1", "--handoff-format", "vllm-example",
                          "--handoff-dir", str(storage),
                          "--handoff-block-size", str(BLOCK))  # fmt: skip
    assert record["handoff"] == {"done": 3}
    expected = set()
    for rid, tokens in prompts.items():
        _, layers = prompt_cache(model, tokens)
        for n in folder_lengths(len(tokens), BLOCK):
            folder = storage / folder_name(tokens[:n], BLOCK)
            expected.add(folder.name)
            for i, (k, v) in enumerate(layers):
                got = safetensors.torch.load_file(str(folder / layer_file(i)))["kv_cache"]
                want = kv_cache_tensor(k[:n], v[:n], BLOCK)
                assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5), (rid, i)
    assert {p.name for p in storage.iterdir() if p.name != ".wavepp-staging"} == expected
    assert not any((storage / ".wavepp-staging").rglob("*.safetensors"))  # all moved or gone
