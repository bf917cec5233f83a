"""Tensor parallelism inside a stage (``--tp 2``), run by ``torchrun -m wavepp.main``:
checkpoints of Llama and the three families saved by transformers, prompts that reuse a
cached prefix (for the hybrids, resuming from a request-end snapshot). First tokens equal
transformers' argmax at TP2 x PP2 (four ranks) and TP2 x PP1 (Llama's TP2 x PP1 is the
run compared with the same run at TP1, logit for logit; for every family the executor's
TP2 equals one rank's, wave by wave, in tests/parity/test_tp_shards.py). The server at
TP2 x PP2 answers with the reference's first tokens and drains on SIGTERM. (A TP rank
killed or stopped mid-run: tests/integration/test_tp_faults.py.)"""

import json
import re
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from tests.helpers.families import hf_last_logits
from tests.helpers.handoff_bands import make_model
from tests.helpers.run import ROOT
from wavepp.model import BUILTIN, random_weights, reference_logits

pytestmark = pytest.mark.slow


def write_prompts(tmp_path):
    """Three prompts, and a long one cancelled while it runs (its waves, its cancel and
    what it leaves in the pools reach every TP rank)."""
    rng = np.random.default_rng(4)
    doc = rng.integers(0, 300, 200).tolist()
    prompts = {"doc": doc, "turn": doc + rng.integers(0, 300, 60).tolist(),
               "solo": rng.integers(0, 300, 90).tolist()}  # fmt: skip
    rows = [{"id": "long", "tokens": rng.integers(0, 300, 4000).tolist()}]
    rows += [{"id": k, "tokens": v} for k, v in prompts.items()]
    rows += [{"cancel": "long", "after_s": 0.1}]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return prompts, requests


# Concurrency 1: "long" runs first (63 waves of 64 tokens; cancelled well before its
# end), then "turn" after "doc", reusing its cached blocks.
OPTIONS = ("--concurrency", "1", "--block-size", "16", "--budget", "64",
           "--snapshot-interval", "4")  # fmt: skip


@pytest.mark.parametrize("family,ranks", [("llama", 4), ("kimi_linear", 4), ("qwen3_next", 4),
                                          ("minimax_m2", 4), ("kimi_linear", 2),
                                          ("qwen3_next", 2), ("minimax_m2", 2)])  # fmt: skip
def test_tp2_first_tokens_equal_transformers(run_wavepp, tmp_path, family, ranks):
    model, path = make_model(family, tmp_path / family)
    prompts, requests = write_prompts(tmp_path)
    record, _ = run_wavepp(ranks, "--tp", "2", "--model", str(path), "--requests-file",
                           str(requests), *OPTIONS)  # fmt: skip
    assert record["config"]["tp"] == 2 and record["config"]["stages"] == ranks // 2
    results = {r["id"]: r for r in record["requests"]}
    for rid, tokens in prompts.items():
        expected = hf_last_logits(model, np.asarray(tokens))
        assert results[rid]["first_token"] == int(expected.argmax()), rid
        assert abs(results[rid]["top_logit"] - float(expected.max())) <= 1e-4, rid
    assert results["turn"]["cached_tokens"] == 192  # 12 full blocks of "doc"
    assert results["long"]["error"] == "cancelled"
    # balanced: no claim left, and every TP rank ran what its leader ran (the digests)
    assert all(leak["balanced"] for leak in record["leak_check"])


def test_tp2_equals_tp1_on_llama(run_wavepp, tmp_path):
    _, path = make_model("llama", tmp_path / "llama")
    _, requests = write_prompts(tmp_path)
    common = ("--model", str(path), "--requests-file", str(requests), *OPTIONS)
    tp2, _ = run_wavepp(2, "--tp", "2", *common)
    tp1, _ = run_wavepp(1, *common)
    one = {r["id"]: r for r in tp1["requests"]}
    for r in tp2["requests"]:
        if r["id"] == "long":
            continue  # cancelled
        assert r["first_token"] == one[r["id"]]["first_token"]
        assert abs(r["top_logit"] - one[r["id"]]["top_logit"]) <= 1e-4
        assert r["cached_tokens"] == one[r["id"]]["cached_tokens"]


def test_the_server_at_tp2_pp2_answers_and_drains(tmp_path):
    cfg = BUILTIN["tiny-hybrid"]
    weights = random_weights(cfg, 0)
    err = open(tmp_path / "server.err", "w")  # noqa: SIM115 (the child holds it)
    cmd = [sys.executable, "-m", "wavepp.serve.launch", "--nproc-per-node", "4", "--tp", "2",
           "--host", "127.0.0.1", "--port", "0", "--model", "tiny-hybrid", "--block-size",
           "16", "--no-progress", "--json", str(tmp_path / "server.json")]  # fmt: skip
    server = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline, match = time.monotonic() + 180, None
        while not match and time.monotonic() < deadline and server.poll() is None:
            time.sleep(0.5)
            match = re.search(r"listening on (http://\S+)", (tmp_path / "server.err").read_text())
        assert match, (tmp_path / "server.err").read_text()[-3000:]
        url = match.group(1)
        rng = np.random.default_rng(7)
        doc = rng.integers(0, cfg.vocab_size, 96).tolist()
        prompts = [doc, doc + rng.integers(0, cfg.vocab_size, 40).tolist(),
                   rng.integers(0, cfg.vocab_size, 50).tolist()]  # fmt: skip
        with httpx.Client(base_url=url, timeout=120) as client:
            for tokens in prompts:
                reply = client.post("/v1/completions", json={"prompt": tokens, "max_tokens": 1})
                assert reply.status_code == 200, reply.text
                expected = reference_logits(cfg, weights, np.asarray(tokens))
                assert reply.json()["wavepp"]["first_token"] == int(expected.argmax())
            assert client.get("/health").json()["status"] == "ok"
            # stage 1's figures ride on its leader's heartbeat (one a second)
            deadline = time.monotonic() + 30
            while 'stage="1"' not in client.get("/metrics").text:
                assert time.monotonic() < deadline, "no figures of stage 1 on /metrics"
                time.sleep(0.5)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()
            raise
    assert code == 0, (tmp_path / "server.err").read_text()[-3000:]
    final = json.loads((tmp_path / "server.json").read_text())
    assert final["config"]["tp"] == 2
    assert [leak["balanced"] for leak in final["leak_check"]] == [True, True]
