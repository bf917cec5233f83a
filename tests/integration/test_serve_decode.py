"""Prefill on the pipeline, decode elsewhere: the server at P = 2 with ``--decode auto``
(a reference decode worker for the built-in tiny-kimi, started by the server) answers
``/v1/completions`` with ``max_tokens`` 16 — streamed or not — with the tokens
transformers generates from the whole prompt; a prefill whose handoff cannot be
delivered still answers, saying why; SIGTERM to the launcher drains, stops the decoder
and exits 0."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import transformers

from tests.helpers.serve import start_server
from wavepp.model import BUILTIN, random_weights
from wavepp.model.checkpoint import write_checkpoint
from wavepp.serve.prom import parse_exposition, sample

pytestmark = pytest.mark.slow


def stream_tokens(client: httpx.Client, url: str, body: dict) -> tuple[list[int], dict]:
    tokens, last = [], {}
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        last = json.loads(event)
        tokens += last["choices"][0]["token_ids"]
    return tokens, last


def test_completions_decode_from_the_handed_off_cache(tmp_path):
    proc, url, _ = start_server(tmp_path, ["--model", "tiny-kimi", "--seed", "0",
                                           "--decode", "auto",
                                           "--handoff-allow", f"unix:{tmp_path}/*"])  # fmt: skip
    cfg = BUILTIN["tiny-kimi"]
    write_checkpoint(tmp_path / "kimi", cfg, random_weights(cfg, 0))
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "kimi").eval()
    rng = np.random.default_rng(5)
    doc = rng.integers(3, cfg.vocab_size, 48).tolist()
    prompts = [doc, doc + rng.integers(3, cfg.vocab_size, 21).tolist()]  # the second reuses
    try:
        with httpx.Client(timeout=120) as client:
            for i, prompt in enumerate(prompts):
                ids = torch.tensor([prompt])
                with torch.inference_mode():
                    want = model.generate(ids, attention_mask=torch.ones_like(ids),
                                          do_sample=False, max_new_tokens=16,
                                          min_new_tokens=16)[0, len(prompt):].tolist()  # fmt: skip
                answer = client.post(f"{url}/v1/completions",
                                     json={"prompt": prompt, "max_tokens": 16}).json()  # fmt: skip
                choice = answer["choices"][0]
                assert choice["token_ids"] == want, (i, answer)
                assert choice["finish_reason"] == "length"
                assert answer["usage"]["completion_tokens"] == 16
                assert answer["wavepp"]["handoff"]["status"] == "done"
                if i == 1:
                    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
                streamed, last = stream_tokens(client, url, {"prompt": prompt, "max_tokens": 16,
                                                             "stream": True})  # fmt: skip
                assert streamed == want
                assert last["choices"][0]["finish_reason"] == "length"
            # a handoff to nobody: the prefill answers, the handoff says that it failed
            # (and no more: the reason was a failed connect, the log says so)
            answer = client.post(f"{url}/v1/prefill", json={
                "tokens": doc, "handoff": f"unix:{tmp_path}/nobody.sock"}).json()  # fmt: skip
            assert answer["status"] == "done"
            assert answer["handoff"]["status"] == "failed"
            assert answer["handoff"]["reason"] == "failed"
            assert answer["handoff"]["stages"][0] == {"stage": 0, "ok": False,
                                                      "reason": "failed"}  # fmt: skip
            # an address the operator did not allow: refused before anything runs
            for where in ("tcp://127.0.0.1:9", "unix:/tmp/elsewhere.sock"):
                refused = client.post(f"{url}/v1/prefill", json={"tokens": doc, "handoff": where})
                assert refused.status_code == 403, refused.text
                assert "is not allowed" in refused.json()["error"]["message"]
            bad = client.post(f"{url}/v1/prefill", json={"tokens": doc, "handoff": "ftp://x"})
            assert bad.status_code == 400 and "handoff" in bad.json()["error"]["message"]
            metrics = parse_exposition(client.get(f"{url}/metrics").text)
            assert sample(metrics, "wavepp_engine_handoffs", outcome="done") == 4
            assert sample(metrics, "wavepp_engine_handoffs", outcome="connect") == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
    err = (tmp_path / "server.err").read_text()
    assert code == 0, err[-3000:]
    assert "decode worker listening on" in err
    record = json.loads((tmp_path / "server.json").read_text())
    assert record["handoff"] == {"done": 4, "connect": 1}


def _decode_worker(model: Path, listen: str) -> subprocess.Popen:
    worker = subprocess.Popen([sys.executable, "-m", "wavepp.decode", "--model", str(model),
                               "--listen", listen], stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert worker.stdout.readline().startswith("listening on")
    return worker


def _health(url: str) -> httpx.Response:
    return httpx.get(f"{url}/health", timeout=30)


def _until(what, guard_s: float = 120.0):
    deadline = time.monotonic() + guard_s  # a hang guard
    while not (got := what()):
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.3)
    return got


def test_a_decoder_outliving_a_restart_decodes_the_new_runs_equal_ids(tmp_path):
    """A decode worker shared across a server's restart (--decode ADDRESS): the new run
    names its requests as the old one did ("same"), and its bands are its own, not the
    old run's already complete ones. The server probes that worker: while it is gone
    /health says degraded (and why), and once it answers again completions decode."""
    cfg = BUILTIN["tiny-kimi"]
    write_checkpoint(tmp_path / "kimi", cfg, random_weights(cfg, 0))
    listen = f"unix:{tmp_path}/decode.sock"
    worker = _decode_worker(tmp_path / "kimi", listen)
    prompt = list(range(3, 40))
    body = {"prompt": prompt, "max_tokens": 4, "request_id": "same"}
    answers = []
    try:
        for run in ("first", "second"):
            (tmp_path / run).mkdir()
            proc, url, _ = start_server(tmp_path / run, ["--model", "tiny-kimi", "--seed", "0",
                                                         "--decode", listen], nproc=1)  # fmt: skip
            try:
                answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
                answers.append((answer.status_code, answer.json()))
                if run == "second":  # the worker goes, and comes back
                    worker.send_signal(signal.SIGTERM)
                    worker.wait(60)
                    down = _until(lambda: (h := _health(url)).status_code == 503 and h)  # noqa: B023
                    assert down.json()["status"] == "degraded"
                    assert f"the decode worker at {listen} does not answer" in down.json()["error"]
                    refused = httpx.post(f"{url}/v1/completions", json={**body, "request_id":
                                         "x"}, timeout=60)  # fmt: skip
                    assert refused.status_code == 503, refused.text
                    worker = _decode_worker(tmp_path / "kimi", listen)
                    _until(lambda: _health(url).status_code == 200)  # noqa: B023
                    again = httpx.post(f"{url}/v1/completions", json={**body, "request_id":
                                       "y"}, timeout=120)  # fmt: skip
                    answers.append((again.status_code, again.json()))
            finally:
                proc.send_signal(signal.SIGTERM)
                code = proc.wait(120)
                assert code == 0, (tmp_path / run / "server.err").read_text()[-3000:]
        assert [code for code, _ in answers] == [200, 200, 200], answers
        tokens = [a["choices"][0]["token_ids"] for _, a in answers]
        assert len(tokens[0]) == 4 and tokens[0] == tokens[1] == tokens[2]
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(60)
