"""vLLM's P/D protocol on a real server at P = 2 (tiny-hybrid, loopback), with a fake
decoder that pulls each stage's band over a plain socket (``tests/helpers/puller.py``).

One server, one request per way a held cache can end: pulled and acknowledged (the bands
are the prompt's: stage 0's token ids, every layer once, the last stage's first token),
the decoder hanging up mid-pull or refusing the band, the lease running out, a cancel
after P answered, the client gone before P answered, a pull from the wrong model refused
while the band stays held. After each the next request works, /metrics counts it per
stage, and SIGTERM ends the run with the leak check balanced (exit 0). A second server
loses rank 1 while a decoder is pulling from it: the existing dead-rank path (every
client gets a JSON 503 naming rank 1). A third sits behind ``python -m wavepp.route
--decoder`` with a fake decoder that pulls. The timeouts are hang guards only.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest

from tests.helpers.fake_decoder import TOKENS, FakeDecoder, Served
from tests.helpers.puller import connect, exactly, pull, pull_frame
from tests.helpers.run import ROOT
from tests.helpers.serve import MODEL, start_server
from wavepp.handoff import wire
from wavepp.model import BUILTIN
from wavepp.runtime.handoff import fingerprint
from wavepp.serve.prom import parse_exposition, sample

pytestmark = pytest.mark.slow
FP = fingerprint("tiny-hybrid", BUILTIN["tiny-hybrid"], "float32")
LEASE_S = 5.0
PROXY = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
         "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip


def prompt(seed: int, n: int = 90) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


def prefill(client: httpx.Client, tokens: list[int], rid: str) -> dict:
    """What the proxy sends P, and P's answer (which must hold the cache)."""
    reply = client.post("/v1/completions", headers={"X-Request-Id": rid,
                                                    "Authorization": "Bearer None"},
                        json={"model": "m", "prompt": tokens, "max_tokens": 1, "stream": False,
                              "temperature": 0.8, "kv_transfer_params": PROXY})  # fmt: skip
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert answer["id"] == f"cmpl-{rid}" and "kv_transfer_params" in answer, answer
    return answer


def metrics(client: httpx.Client) -> dict[str, float]:
    return parse_exposition(client.get("/metrics").text)


def wait_for(client: httpx.Client, name: str, value: float, **labels: str) -> dict:
    deadline = time.monotonic() + 60  # hang guard
    while True:
        s = metrics(client)
        if (sample(s, name, **labels) or 0) >= value:
            return s
        assert time.monotonic() < deadline, (name, labels, {k: v for k, v in s.items()
                                                            if "pull" in k})  # fmt: skip
        time.sleep(0.2)


def check_bands(answer: dict, tokens: list[int], pulled: list) -> None:
    """The pulled bands are the prompt's cache: every layer once, stage 0's token ids,
    the last stage's first token."""
    layers = sorted(layer for band in pulled for layer in band.header.layers)
    assert layers == list(range(FP.num_layers))
    for s, band in enumerate(pulled):
        header = band.header
        assert (header.stage, header.num_stages, header.num_tokens) == (s, 2, len(tokens))
        assert header.fingerprint == FP and len(band.payload) == wire.band_bytes(header)
    first = pulled[0].header
    spec = next(t for t in first.tensors if t.name == "tokens")
    at = sum(t.nbytes for t in first.tensors[: first.tensors.index(spec)])
    ids = np.frombuffer(pulled[0].payload[at : at + spec.nbytes], dtype=np.int32)
    assert ids.tolist() == tokens
    assert pulled[1].header.first_token == answer["choices"][0]["token_ids"][0]


def test_a_decoder_pulls_every_stage_and_every_end_of_a_held_cache_releases_it(tmp_path):
    proc, url, _ = start_server(tmp_path, [*MODEL, "--handoff-lease-s", str(LEASE_S),
                                           "--budget", "64", "--min-budget", "64"])  # fmt: skip
    try:
        with httpx.Client(base_url=url, timeout=120) as client:
            # pulled and acknowledged, stage by stage, straight from each stage
            tokens = prompt(1)
            answer = prefill(client, tokens, "pd-ok")
            params = answer["kv_transfer_params"]
            assert params["prompt_token_ids"] == tokens and params["do_remote_prefill"] is True
            wavepp = params["wavepp"]
            stages = wavepp["stages"]
            assert wavepp["request_id"] == "pd-ok" and len(stages) == 2
            assert all(a.startswith("unix:/") and a.endswith(f"h-stage{s}.sock")
                       for s, a in enumerate(stages))  # fmt: skip
            assert 0 < wavepp["expires_in_s"] <= LEASE_S
            assert answer["wavepp"]["ignored"] == ["temperature"]
            pulled = [pull(a, "pd-ok", s, FP) for s, a in enumerate(stages)]
            check_bands(answer, tokens, pulled)
            s = wait_for(client, "wavepp_pull_bytes_total", 1, stage="1")
            for stage in ("0", "1"):
                assert sample(s, "wavepp_pull_bytes_total", stage=stage) == len(
                    pulled[int(stage)].payload)
                assert sample(s, "wavepp_pull_ack_seconds_count", stage=stage) == 1
                assert sample(s, "wavepp_pull_gigabytes_per_second_count", stage=stage) == 1
            assert pull(stages[0], "pd-ok", 0, FP).refusal is not None  # released: gone

            # a decoder of another model is refused; the band stays held for the right one
            tokens = prompt(2)
            prefill(client, tokens, "pd-fp")
            other = msgspec.structs.replace(FP, num_kv_heads=8)
            refused = pull(stages[1], "pd-fp", 1, other).refusal
            assert refused.error == "fingerprint num_kv_heads: the decoder has 8, WavePP has 2"
            assert all(pull(a, "pd-fp", s, FP).header for s, a in enumerate(stages))

            # the decoder hangs up mid-pull (stage 1), or refuses the band (stage 0)
            prefill(client, prompt(3), "pd-gone")
            assert pull(stages[0], "pd-gone", 0, FP, ack="refuse").header is not None
            assert pull(stages[1], "pd-gone", 1, FP, ack="hang-up").header is not None
            s = wait_for(client, "wavepp_pull_failures_total", 1, stage="1",
                         reason="disconnected")  # fmt: skip
            assert sample(s, "wavepp_pull_aborts_total", stage="0", by="decoder") == 1

            # nobody pulls: the lease runs out on both stages, and a late pull is refused
            prefill(client, prompt(4), "pd-late")
            s = wait_for(client, "wavepp_pull_lease_expiries_total", 1, stage="1")
            assert sample(s, "wavepp_pull_lease_expiries_total", stage="0") == 1
            late = pull(stages[0], "pd-late", 0, FP).refusal
            assert "unknown or expired request 'pd-late'" in late.error

            # P answered, then the request is cancelled: both held bands are released
            prefill(client, prompt(5), "pd-cancel")
            assert client.delete("/v1/requests/pd-cancel").json()["cancelled"] is True
            s = wait_for(client, "wavepp_pull_aborts_total", 1, stage="1", by="wavepp")
            assert pull(stages[1], "pd-cancel", 1, FP).refusal is not None

            # the client gives up before P answers: cancelled, nothing held
            long = prompt(6, 6000)
            with pytest.raises(httpx.ReadTimeout):
                client.post("/v1/completions", timeout=0.3, json={
                    "prompt": long, "max_tokens": 1, "kv_transfer_params": PROXY})  # fmt: skip
            s = wait_for(client, "wavepp_disconnect_cancels_total", 1)
            assert sample(s, "wavepp_results_total", status="cancelled") == 1

            # after all that, the next request works and is pulled whole
            tokens = prompt(7)
            answer = prefill(client, tokens, "pd-next")
            check_bands(answer, tokens, [pull(a, "pd-next", s, FP)
                                         for s, a in enumerate(stages)])  # fmt: skip
            s = wait_for(client, "wavepp_pull_ack_seconds_count", 3, stage="1")  # ok, fp, next
            # the other stages' figures ride on their heartbeats
            s = wait_for(client, "wavepp_engine_stages_pulls_refused", 2, stage="1")
            assert sample(s, "wavepp_engine_stages_pull_parked", stage="0") == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
    err = (tmp_path / "server.err").read_text()
    assert code == 0, err[-3000:]
    record = json.loads((tmp_path / "server.json").read_text())
    assert all(stage["balanced"] for stage in record["leak_check"])
    # cancelled: once after P answered, once before
    assert record["handoff"] == {"done": 3, "refused": 1, "expired": 1, "cancelled": 2}
    assert not any(Path(a.removeprefix("unix:")).exists() for a in stages)


def test_a_stage_that_dies_mid_pull_is_the_dead_rank_path(tmp_path):
    proc, url, rank0 = start_server(tmp_path, [*MODEL, "--dead-after-s", "5"])
    try:
        with httpx.Client(base_url=url, timeout=120) as client:
            answer = prefill(client, prompt(8, 400), "pd-dies")
            stages = answer["kv_transfer_params"]["wavepp"]["stages"]
            torchrun = int(Path(f"/proc/{rank0}/stat").read_text().rsplit(")", 1)[1].split()[1])
            rank1 = next(int(p) for p in Path(f"/proc/{torchrun}/task/{torchrun}/children")
                         .read_text().split() if int(p) != rank0)  # fmt: skip
            with connect(stages[1]) as sock:  # the band starts to arrive, then its rank dies
                sock.sendall(pull_frame("pd-dies", 1, FP))
                assert exactly(sock, 4) == wire.BAND_MAGIC
                os.kill(rank1, signal.SIGKILL)
                with pytest.raises((EOFError, OSError)):
                    while True:  # what the stage sent before it died, then the end
                        exactly(sock, 1 << 16)
            deadline = time.monotonic() + 60  # hang guard
            while (reply := client.get("/health")).status_code == 200:
                assert time.monotonic() < deadline
                time.sleep(0.2)
            assert reply.status_code == 503 and "rank 1" in reply.text
    except httpx.HTTPError:
        pass  # the server may stop before the last probe
    finally:
        code = proc.wait(120)  # hang guard
    assert code != 0
    assert "rank 1" in (tmp_path / "server.err").read_text().strip().splitlines()[-1]


def test_the_router_prefills_on_wavepp_and_decodes_on_a_decoder_that_pulls(tmp_path):
    """``python -m wavepp.route --decoder``: a client's completion — streamed or not —
    goes through the server's prefill, whose held cache the fake decoder pulls from both
    stages before streaming its tokens back; a chat the server cannot template fails
    naming the prefill leg."""
    proc, url, _ = start_server(tmp_path, [*MODEL, "--handoff-lease-s", "30"])
    decoder = FakeDecoder(pull_with=FP)
    router = None
    try:
        with Served(decoder.app) as decoder_url:
            err = open(tmp_path / "router.err", "w")  # noqa: SIM115 (the child holds it)
            router = subprocess.Popen(
                [sys.executable, "-m", "wavepp.route", "--replica", url, "--decoder",
                 decoder_url, "--port", "0", "--health-interval-s", "0.2"],
                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)  # fmt: skip
            front = _router_url(tmp_path / "router.err", router)
            with httpx.Client(base_url=front, timeout=120) as client:
                _wait_routable(client)
                tokens = prompt(9)
                body = {"model": "m", "prompt": tokens, "max_tokens": 4, "stream": True}
                with client.stream("POST", "/v1/completions", json=body,
                                   headers={"X-Request-Id": "via-router"}) as reply:
                    assert reply.status_code == 200, reply.read()
                    events = [line[6:] for line in reply.iter_lines()
                              if line.startswith("data: ")]  # fmt: skip
                assert events[-1] == "[DONE]"
                assert [json.loads(e)["choices"][0]["text"] for e in events[:-2]] == [
                    f"<{t}>" for t in TOKENS]
                path, sent, headers = decoder.seen[0]
                assert path == "/v1/completions"
                assert headers["x-request-id"] == "via-router"
                params = sent["kv_transfer_params"]
                assert params["prompt_token_ids"] == tokens
                bands = decoder.pulled[params["wavepp"]["request_id"]]
                answer = {"choices": [{"token_ids": [params["wavepp"]["first_token"]]}]}
                check_bands(answer, tokens, bands)
                whole = client.post("/v1/completions", json={**body, "stream": False})
                assert whole.status_code == 200
                assert whole.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 80
                chat = client.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
                assert chat.status_code == 400 and chat.json()["error"]["leg"] == "prefill"
                assert "no tokenizer" in chat.json()["error"]["message"]
                served = parse_exposition(httpx.get(f"{url}/metrics").text)
                assert sample(served, "wavepp_pull_bytes_total", stage="0") > 0
    finally:
        if router is not None:
            router.send_signal(signal.SIGTERM)
            assert router.wait(60) == 0
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
    assert code == 0, (tmp_path / "server.err").read_text()[-3000:]


def _router_url(err: Path, router: subprocess.Popen) -> str:
    deadline = time.monotonic() + 60  # hang guard
    while time.monotonic() < deadline:
        match = re.search(r"listening on (http://\S+) ", err.read_text())
        if match:
            return match.group(1)
        assert router.poll() is None, err.read_text()
        time.sleep(0.2)
    raise AssertionError(err.read_text())


def _wait_routable(client: httpx.Client) -> None:
    deadline = time.monotonic() + 60  # hang guard
    while True:
        health = client.get("/health").json()
        if health["replicas_up"] and health["decoders"][0]["state"] == "up":
            return
        assert time.monotonic() < deadline, health
        time.sleep(0.2)


def test_at_tp2_each_stages_leader_serves_its_whole_band(tmp_path):
    """With ``--tp 2`` a stage's band server is its first rank's; what a decoder pulls
    is the stage's whole band, the followers' shards put together."""
    proc, url, _ = start_server(tmp_path, [*MODEL, "--tp", "2"], nproc=4)
    try:
        with httpx.Client(base_url=url, timeout=120) as client:
            tokens = prompt(10, 70)
            answer = prefill(client, tokens, "pd-tp")
            stages = answer["kv_transfer_params"]["wavepp"]["stages"]
            assert len(stages) == 2
            pulled = [pull(a, "pd-tp", s, FP) for s, a in enumerate(stages)]
            check_bands(answer, tokens, pulled)
            wait_for(client, "wavepp_pull_ack_seconds_count", 1, stage="1")
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
    assert code == 0, (tmp_path / "server.err").read_text()[-3000:]
    record = json.loads((tmp_path / "server.json").read_text())
    assert record["handoff"] == {"done": 1}
