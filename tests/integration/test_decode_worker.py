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
    proc.log_path = root / "worker.log"  # what the worker logs, for the tests to read
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


def expected_tokens(model, tokens: torch.Tensor, new_tokens: int) -> list[int]:
    with torch.inference_mode():
        full = model.generate(tokens[None], attention_mask=torch.ones_like(tokens[None]),
                              max_new_tokens=new_tokens, do_sample=False)  # fmt: skip
    return full[0, tokens.shape[0] :].tolist()


def test_concurrent_generations_are_batched_and_each_decodes_like_generate(worker):
    """Five decodes of different prompt lengths and lengths at once, joining at different
    steps: each gets what generate() gives its prompt alone, and a short one started
    after a long one ends while the long one is still decoding (continuous batching:
    one at a time, the short one would wait for the long one's last token)."""
    model, address, _ = worker
    shapes = [(61, 120), (7, 5), (33, 17), (18, 9), (45, 12)]  # (prompt tokens, max_tokens)
    prompts = [prompt(100 + i, n) for i, (n, _) in enumerate(shapes)]
    want = [expected_tokens(model, p, m) for p, (_, m) in zip(prompts, shapes, strict=True)]
    assert len(want[0]) > 2 * max(len(w) for w in want[1:]), "pick a longer-running prompt"
    bands = [bands_for(model, f"cb-{i}", p, [2, 2]) for i, p in enumerate(prompts)]

    async def main():
        got: dict[int, list[int]] = {i: [] for i in range(len(shapes))}
        long_seen_when_short_done: list[int] = []
        with anyio.fail_after(180):  # a hang guard
            for b in bands:
                for h, p in b:
                    assert (await send_band(address, h, p)).ok

            async def client(i: int) -> None:
                async for chunk in decode(address, f"cb-{i}", shapes[i][1], 30):
                    got[i] += chunk
                    if i == 0 and len(got[0]) == 3:  # the long one runs: the rest start
                        for j in range(1, len(shapes)):
                            tg.start_soon(client, j)
                if i == 1:
                    long_seen_when_short_done.append(len(got[0]))

            async with anyio.create_task_group() as tg:
                tg.start_soon(client, 0)
        return got, long_seen_when_short_done

    got, seen = anyio.run(main)
    for i in range(len(shapes)):
        assert got[i] == want[i], (i, shapes[i])
    assert seen and seen[0] < len(want[0]), seen


def test_a_client_that_leaves_stops_its_request_wherever_it_is(worker):
    """A client that closes its connection while its request waits for its cache, or
    while it decodes, stops it there (the worker says so); the worker serves on."""
    model, address, proc = worker
    tokens = prompt(7, 30)
    bands = bands_for(model, "gone-b", tokens, [4])

    async def leave_after(request_id: str, chunks: int) -> None:
        seen = 0
        stream = decode(address, request_id, 4096, 600)
        async for _ in stream:
            seen += 1
            if seen >= chunks:
                break
        await stream.aclose()  # the connection closes

    async def main():
        with anyio.fail_after(120):  # a hang guard
            # waiting for a cache that never comes (for up to 600 s): the close stops it
            with anyio.move_on_after(0.5):
                await leave_after("gone-a", 1)
            for h, p in bands:
                assert (await send_band(address, h, p)).ok
            await leave_after("gone-b", 2)  # decoding 4096 tokens: it leaves after two
            return await decode_all(address, "gone-c", 1, timeout_s=0.2)

    with pytest.raises(DecodeError, match="no band arrived"):  # the worker still answers
        anyio.run(main)
    wanted = [r"'gone-a': the client closed its connection",
              r"'gone-b': the client went away after \d+ of 4096 tokens: stopped"]  # fmt: skip
    deadline = time.monotonic() + 60  # a hang guard: the worker logs as it stops them
    text = proc.log_path.read_text()
    while time.monotonic() < deadline and not all(re.search(w, text) for w in wanted):
        time.sleep(0.2)
        text = proc.log_path.read_text()
    for w in wanted:
        assert re.search(w, text), text[-3000:]
    assert proc.poll() is None
