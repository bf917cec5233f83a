"""The reference decode worker (``python -m wavepp.decode``) as a process: it takes a
request's bands on its Unix socket and decodes from them what ``generate()`` decodes from
the whole prompt; malformed bands, unknown requests and unsupported sampling are refused
with a reason, and the worker keeps serving."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import anyio
import pytest
import torch

from tests.helpers.handoff_bands import VOCAB, hf_prefill, make_model, split_bands
from tests.helpers.run import ROOT
from wavepp.handoff.client import DecodeError, decode, send_band
from wavepp.handoff.hf import from_transformers_cache
from wavepp.handoff.wire import Address, parse_address

READY = re.compile(r"listening on (unix:\S+) \(pid (\d+)\)")
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """(transformers model, worker address, worker process) on a tiny Llama."""
    root = tmp_path_factory.mktemp("decode")
    model, path = make_model("llama", root / "ckpt", seed=4)
    sock = root / "w.sock"
    log = open(root / "worker.log", "w")  # noqa: SIM115 (closed below)
    cmd = [sys.executable, "-m", "wavepp.decode", "--model", str(path),
           "--listen", f"unix:{sock}", "--threads", "1", "--max-band-mib", "16"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        deadline = time.monotonic() + 180  # a hang guard: loading transformers takes a while
        line = ""
        while time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
            if READY.search(line):
                break
        match = READY.search(line)
        assert match, f"no ready line; exit {proc.poll()}: {(root / 'worker.log').read_text()}"
        assert int(match[2]) == proc.pid and match[1] == f"unix:{sock}"
        yield model, parse_address(match[1]), proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    assert proc.returncode == 0, (root / "worker.log").read_text()
    assert not sock.exists()


def prompt(seed: int, length: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def bands_for(model, request_id: str, tokens: torch.Tensor, sizes: list[int]):
    cache, logits = hf_prefill(model, tokens)
    layers = from_transformers_cache(cache, model)
    first, top = int(logits.argmax()), float(logits.max())
    return split_bands(model, request_id, tokens, layers, first, top, sizes)


async def decode_all(address: Address, request_id: str, max_tokens: int, timeout_s: float = 30):
    chunks = [c async for c in decode(address, request_id, max_tokens, timeout_s)]
    return chunks, [t for c in chunks for t in c]


def test_decodes_what_generate_decodes(worker):
    model, address, _ = worker
    tokens = prompt(1, 53)
    bands = bands_for(model, "req-a", tokens, [3, 1])
    with torch.inference_mode():
        full = model.generate(tokens[None], attention_mask=torch.ones_like(tokens[None]),
                              max_new_tokens=NEW_TOKENS, do_sample=False)  # fmt: skip
    expected = full[0, tokens.shape[0] :].tolist()

    async def main():
        with anyio.fail_after(120):  # a hang guard
            # the decode request first: it waits for the bands, which arrive meanwhile
            async with anyio.create_task_group() as tg:
                result = {}

                async def client():
                    result["decoded"] = await decode_all(address, "req-a", NEW_TOKENS)

                tg.start_soon(client)
                await anyio.sleep(0.2)
                acks = [await send_band(address, h, p) for h, p in bands]
            return acks, result["decoded"]

    acks, (chunks, got) = anyio.run(main)
    assert all(a.ok for a in acks), acks
    assert got == expected
    assert chunks[0] == [expected[0]]  # the first token comes at once, then the stream
    assert len(chunks) > 1


def test_malformed_band_unknown_request_and_sampling_are_refused(worker):
    model, address, proc = worker
    ((header, payload),) = bands_for(model, "req-b", prompt(2, 44), [4])
    specs = list(header.tensors)
    specs[1] = type(specs[1])(specs[1].layer, specs[1].name, "float32", [44, 2, 15],
                              44 * 2 * 15 * 4)  # fmt: skip
    bad = type(header)(**{**{f: getattr(header, f) for f in header.__struct_fields__},
                          "tensors": specs})  # fmt: skip
    bad_payload = list(payload)
    bad_payload[1] = torch.zeros(44, 2, 15)

    async def main():
        with anyio.fail_after(120):  # a hang guard
            ack = await send_band(address, bad, bad_payload)
            with pytest.raises(DecodeError, match=r"'nope': no band arrived in 0\.5 s"):
                await decode_all(address, "nope", 4, timeout_s=0.5)
            with pytest.raises(DecodeError, match=r"temperature 0\.7 is not supported"):
                async for _ in decode(address, "req-b", 4, 5, temperature=0.7):
                    pass
            good = await send_band(address, header, payload)
            _, tokens = await decode_all(address, "req-b", 3)
            return ack, good, tokens

    ack, good, tokens = anyio.run(main)
    assert not ack.ok and ack.error == (
        "layer 0 (A) tensor 'k': the band has float32 [44, 2, 15], expected float32 "
        "[44, 2, 16] for 44 tokens"
    )
    assert good.ok and len(tokens) == 3 and proc.poll() is None
