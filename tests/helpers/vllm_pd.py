"""The pieces of a real P/D deployment on loopback for the vLLM interop tests and
``benchmarks/pd.py``: a tiny Llama checkpoint with a tokenizer and a chat template that
WavePP and vLLM both read, ``vllm serve`` with ``WavePPConnector``, ``python -m
wavepp.route`` as the proxy, a relay that cuts or holds a band part way, and vLLM's
``/metrics`` read by name and labels."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.hf_llama import VOCAB, tiny_llama
from tests.helpers.run import ROOT
from wavepp.handoff import wire

VLLM_PYTHON = os.environ.get("WAVEPP_VLLM_PYTHON", "/tmp/vllm-venv/bin/python")
VLLM_BLOCK = 32  # vLLM CPU's block (a multiple of 32)
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
           "<|eot_id|>"]  # fmt: skip
# A Llama-3-style template, written for these tests: BOS, one header per message, the
# assistant's header as the generation prompt
TEMPLATE = (
    "{{- bos_token }}{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim"
    " + '<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def has_vllm() -> bool:
    """A venv at ``VLLM_PYTHON`` with vLLM and WavePP (found, not imported: fast)."""
    if not Path(VLLM_PYTHON).exists():
        return False
    find = ("import importlib.util as u, sys; "
            "sys.exit(not (u.find_spec('vllm') and u.find_spec('wavepp.vllm')))")  # fmt: skip
    probe = subprocess.run([VLLM_PYTHON, "-c", find], capture_output=True, timeout=60)
    return probe.returncode == 0


def chat_llama(path: Path, layers: int = 2, hidden: int = 128, heads: int = 4,
               kv_heads: int = 2, head_dim: int = 32, mlp: int = 256,
               max_positions: int = 512) -> None:  # fmt: skip
    """A random Llama of ``VOCAB`` tokens (``tiny_llama``'s by default, else of the shape
    given) with a byte-level tokenizer whose ``VOCAB`` ids are all tokens (256 bytes, 251
    two-letter merges, 5 special tokens: every id the model can emit detokenizes), BOS
    added to plain text, and ``TEMPLATE``."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    shape = (layers, hidden, heads, kv_heads, head_dim, mlp, max_positions)
    if shape == (2, 128, 4, 2, 32, 256, 512):
        tiny_llama(path)
    else:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=hidden, intermediate_size=mlp,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
            head_dim=head_dim, max_position_embeddings=max_positions, rms_norm_eps=1e-5,
            tie_word_embeddings=False, initializer_range=0.05, torch_dtype="float32")  # fmt: skip
        transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    letters = "abcdefghijklmnopqrstuvwxyz"
    pairs = [(a, b) for a in letters for b in letters][: VOCAB - len(vocab) - len(SPECIAL)]
    for a, b in pairs:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)
    bos = SPECIAL[0]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
        special_tokens=[(bos, tok.token_to_id(bos))])  # fmt: skip
    if tok.get_vocab_size() != VOCAB:
        raise AssertionError(f"the tokenizer has {tok.get_vocab_size()} ids, the model {VOCAB}")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": "<|eot_id|>",
        "model_max_length": max_positions, "chat_template": TEMPLATE}))  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connector_config(**extra) -> str:
    return json.dumps({"kv_connector": "WavePPConnector", "kv_connector_module_path": "wavepp.vllm",
                       "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": extra})  # fmt: skip


def start_vllm(tmp: Path, model: Path, *, connector: str | None, max_len: int = 512,
               kv_space_gib: int = 1, name: str = "vllm",
               extra_args: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:  # fmt: skip
    """``vllm serve`` (its OpenAI server module) on a free port of 127.0.0.1, greedy
    defaults from vLLM rather than the checkpoint, dev routes on (``/reset_prefix_cache``);
    ``connector``: a ``--kv-transfer-config`` JSON, or None. Returns once ``/health``
    answers 200 (a hang guard of 10 minutes: a start on 2 busy cores takes a minute)."""
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib), "VLLM_SERVER_DEV_MODE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "0-1", "PYTHONUNBUFFERED": "1"}  # fmt: skip
    cmd = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--block-size", str(VLLM_BLOCK), "--max-model-len",
           str(max_len), "--enforce-eager", "--seed", "0", "--max-num-seqs", "16",
           "--generation-config", "vllm", *extra_args]  # fmt: skip
    if connector is not None:
        cmd += ["--kv-transfer-config", connector]
    log = open(tmp / f"{name}.log", "w")  # noqa: SIM115 (the child holds it)
    proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600  # hang guard
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        time.sleep(1.0)
    stop(proc)
    raise AssertionError(f"vllm serve not up (exit {proc.poll()}):\n"
                         f"{(tmp / f'{name}.log').read_text()[-5000:]}")  # fmt: skip


def start_router(tmp: Path, replica: str, decoder: str) -> tuple[subprocess.Popen, str]:
    """``python -m wavepp.route --replica ... --decoder ...`` on a free port; returns once
    the replica and the decoder are both up (a hang guard of a minute)."""
    err = open(tmp / "router.err", "w")  # noqa: SIM115 (the child holds it)
    proc = subprocess.Popen([sys.executable, "-m", "wavepp.route", "--replica", replica,
                             "--decoder", decoder, "--port", "0", "--health-interval-s", "0.5"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)  # fmt: skip
    deadline = time.monotonic() + 60  # hang guard
    url = None
    while time.monotonic() < deadline and proc.poll() is None:
        text = (tmp / "router.err").read_text()
        if url is None and "listening on http://" in text:
            url = text.split("listening on ", 1)[1].split()[0]
        if url is not None:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                health = httpx.get(url + "/health", timeout=5).json()
                if health["replicas_up"] and health["decoders"][0]["state"] == "up":
                    return proc, url
        time.sleep(0.2)
    stop(proc)
    raise AssertionError(f"router not up:\n{(tmp / 'router.err').read_text()[-3000:]}")


def stop(proc: subprocess.Popen, timeout_s: float = 120) -> int:
    """SIGTERM, then SIGKILL after ``timeout_s``; the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
    return proc.returncode


def metrics(url: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of ``url``'s ``/metrics``: (name, labels, value)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return [(s.name, dict(s.labels), s.value)
            for family in text_string_to_metric_families(text) for s in family.samples]  # fmt: skip


def total(samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 with none)."""
    return sum(v for n, got, v in samples
               if n == name and all(got.get(k) == want for k, want in labels.items()))  # fmt: skip


def wait_metric(url: str, name: str, at_least: float, *, nudge: bool = False,
                **labels: str) -> list:  # fmt: skip
    """``url``'s samples once ``name`` (summed over ``labels``) reaches ``at_least`` (a
    hang guard of a minute: vLLM's front end counts a request shortly after answering).
    ``nudge``: each poll also asks vLLM for one token of a one-token prompt — the
    connector's figures of work that ended after a request's last engine step (a band
    released in the background) reach vLLM's front end with the next step only."""
    deadline = time.monotonic() + 60
    while True:
        if nudge:
            reply = httpx.post(url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": [7], "max_tokens": 1, "temperature": 0})  # fmt: skip
            assert reply.status_code == 200, reply.text
        samples = metrics(url)
        if total(samples, name, **labels) >= at_least:
            return samples
        if time.monotonic() > deadline:
            raise AssertionError(f"{name}{labels} stayed at {total(samples, name, **labels)}, "
                                 f"below {at_least}")  # fmt: skip
        time.sleep(0.2)


def rank_pids(rank0: int) -> list[int]:
    """The serving ranks' pids, rank 0's first (torchrun's children)."""
    torchrun = int(Path(f"/proc/{rank0}/stat").read_text().rsplit(")", 1)[1].split()[1])
    children = Path(f"/proc/{torchrun}/task/{torchrun}/children").read_text().split()
    return [rank0] + [int(p) for p in children if int(p) != rank0]


class Relay:
    """A Unix socket between a decoder and one stage's band server (``upstream``): the
    decoder's pull goes through, then the first ``after`` bytes of the band; then
    ``reached`` is set, the relay waits for :meth:`release` (at once unless ``hold``: the
    test kills the stage meanwhile) and closes both sides, passing on nothing more — the
    decoder sees the stage's connection end part way through the band, as when a stage
    dies before its band's end has left it; a stage still alive sees its decoder gone.
    One connection."""

    def __init__(self, path: Path, upstream: str, after: int, hold: bool = False) -> None:
        self.address = f"unix:{path}"
        self._path, self._upstream, self._after = path, upstream, after
        self.reached = threading.Event()
        self._go = threading.Event()
        if not hold:
            self._go.set()
        self.forwarded = 0  # band bytes the decoder got
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(path))
        self._sock.listen(1)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._go.set()

    def _run(self) -> None:
        with contextlib.suppress(OSError):
            down, _ = self._sock.accept()
            where = wire.parse_address(self._upstream)
            with down, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as up:
                down.settimeout(60)
                up.settimeout(60)
                up.connect(where.path)
                prefix = _exactly(down, wire.PULL_PREFIX_BYTES)
                up.sendall(prefix + _exactly(down, wire.pull_length(prefix)))
                while self.forwarded < self._after:
                    chunk = up.recv(min(1 << 16, self._after - self.forwarded))
                    if not chunk:
                        break
                    down.sendall(chunk)
                    self.forwarded += len(chunk)
                self.reached.set()
                self._go.wait(120)

    def close(self) -> None:
        self._go.set()
        self._sock.close()
        with contextlib.suppress(OSError):
            self._path.unlink()


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            raise EOFError(f"closed after {len(data)} of {n} bytes")
        data += part
    return bytes(data)


def texts_of(events: list[str]) -> tuple[str, list[int]]:
    """A stream's text and token ids, from its SSE ``data:`` payloads (``[DONE]`` last)."""
    text, ids = "", []
    for raw in events:
        if raw == "[DONE]":
            break
        choice = json.loads(raw)["choices"][0]
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        ids += choice.get("token_ids") or (choice.get("delta") or {}).get("token_ids") or []
    return text, ids


def answer_of(reply: Mapping) -> tuple[str, list[int]]:
    """A whole answer's text and token ids (completion or chat)."""
    choice = reply["choices"][0]
    text = choice.get("text")
    if text is None:
        text = choice["message"]["content"] or ""
    return text, list(choice.get("token_ids") or [])
