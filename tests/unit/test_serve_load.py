"""The load generator against a live server over the stand-in engine."""

from __future__ import annotations

import json

import anyio
import numpy as np
import pytest

from tests.helpers.fake_engine import FakeEngine, expected_first_token
from wavepp.bench.load import amain, parser, table, validate
from wavepp.serve.app import ServeOptions
from wavepp.serve.server import serve
from wavepp.workload import read_requests_file

pytestmark = pytest.mark.anyio

VOCAB = 1000


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def run_load(engine: FakeEngine, argv: list[str], simulated: bool = False) -> dict:
    ready, where = anyio.Event(), {}

    def on_ready(host: str, port: int) -> None:
        where["url"] = f"http://{host}:{port}"
        ready.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.run)
        options = ServeOptions(simulated=simulated)
        tg.start_soon(lambda: serve(engine, "127.0.0.1", 0, options, on_ready=on_ready))
        with anyio.fail_after(30):
            await ready.wait()
        args = parser().parse_args(["--url", where["url"], "--no-progress", *argv])
        validate(args)
        with anyio.fail_after(120):
            record = await amain(args)
        engine.drain()
    return record


async def test_closed_loop_with_disconnects(tmp_path):
    engine = FakeEngine(vocab_size=VOCAB, tokens_per_s=300)
    dump = tmp_path / "prompts.jsonl"
    record = await run_load(engine, [
        "--workload", "seeded", "--requests", "40", "--prompt-tokens", "64",
        "--concurrency", "4", "--cancel-fraction", "0.5", "--seed", "3",
        "--dump-requests", str(dump), "--id-prefix", "t-",
    ])  # fmt: skip
    measured = [r for r in record["requests"] if not r["warmup"]]
    assert len(measured) == 40 and record["warmup_requests"] == 10
    picked = [r for r in measured if r["to_cancel"]]
    assert len(picked) == 20 == record["picked_to_cancel"]
    assert all(r["status"] == "done" for r in measured if not r["to_cancel"])
    abandoned = [r for r in picked if r["status"] == "disconnected"]
    assert abandoned, "no request was abandoned before its answer"
    # Every abandoned request that reached the engine ends there, cancelled or (if it was
    # quicker) done; one abandoned while its body was sent never reached it.
    reached = [engine.requests[k] for r in abandoned if (k := "t-" + r["id"]) in engine.requests]
    assert reached and all(request.result is not None for request in reached)
    assert any(request.result.status == "cancelled" for request in reached)
    assert engine.counts["queued"] == engine.counts["running"] == 0
    # The dumped prompts are what was sent: first tokens match the engine's rule.
    specs, rejected, _ = read_requests_file(dump, VOCAB)
    assert not rejected and len(specs) == 50
    tokens = {s.request_id: s.tokens for s in specs}
    for r in record["requests"]:
        if r["status"] == "done":
            assert r["first_token"] == expected_first_token(tokens[r["id"]], VOCAB)
    warm = [json.loads(line) for line in dump.read_text().splitlines()[:10]]
    assert all(line["warmup"] for line in warm)
    # Seeded prefixes are reused after the warm-up (48 of 64 tokens in full blocks).
    assert record["reused_share"] > 0.5
    assert record["good_hit_rate"] == 1.0
    assert record["server_reused_share"] is not None
    assert record["throughput_tok_s"] > 0
    assert record["time_to_result_p50_s"] <= record["time_to_result_p99_s"]
    assert 0 <= record["http_overhead_p50_s"] < record["time_to_result_p50_s"]
    assert "time to result" in table(record)


async def test_open_loop_trace_keeps_the_timestamps(tmp_path):
    path = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 150 * i, "input_length": 600, "hash_ids": [1, 2 + i]} for i in range(5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    engine = FakeEngine(vocab_size=VOCAB, capacity_tokens=8192)
    record = await run_load(engine, ["--trace", str(path), "--open-loop", "--concurrency", "2"])
    sent = sorted(r["sent_at"] for r in record["requests"])
    offsets = np.diff(sent)
    assert len(sent) == 5 and all(r["status"] == "done" for r in record["requests"])
    assert np.all(offsets > 0.1), offsets  # 150 ms apart, give or take scheduling
    # hash id 1 is shared: each later request reuses its first 512 tokens.
    assert [r["cached_tokens"] for r in record["requests"]] == [0, 512, 512, 512, 512]


def test_bad_options_say_why():
    for argv, message in [
        (["--workload", "cold", "--concurrency", "0"], "--concurrency must be ≥ 1"),
        (["--workload", "cold", "--concurrency", "1", "--open-loop"], "--open-loop replays"),
        (["--workload", "cold", "--concurrency", "1", "--cancel-fraction", "2"], "[0, 1]"),
    ]:
        args = parser().parse_args(["--url", "http://127.0.0.1:1", *argv])
        with pytest.raises(SystemExit, match=message.replace("[", r"\[").replace("]", r"\]")):
            validate(args)


async def test_openai_endpoint_gives_the_same_answers():
    engine = FakeEngine(vocab_size=VOCAB, tokens_per_s=50_000)
    record = await run_load(engine, [
        "--workload", "cold", "--requests", "6", "--prompt-tokens", "40", "--concurrency", "3",
        "--endpoint", "completions", "--id-prefix", "c-",
    ])  # fmt: skip
    assert [r["status"] for r in record["requests"]] == ["done"] * 6
    for r in record["requests"]:
        tokens = engine.requests["c-" + r["id"]].tokens
        assert r["first_token"] == expected_first_token(tokens, VOCAB)


@pytest.mark.parametrize("workload", ["cold", "seeded", "mixed", "short-suffix", "conversation"])
def test_every_workload_of_the_main_job_builds(workload):
    from wavepp.bench.load import build_specs

    args = parser().parse_args(["--url", "http://x", "--workload", workload, "--requests", "12",
                                "--concurrency", "1",
                                "--prompt-tokens", "64"])  # fmt: skip
    specs = build_specs(args, VOCAB, 16)
    assert specs and all(s.tokens.max() < VOCAB for s in specs)
    if workload != "cold":
        assert any(s.expected_reuse > 0 for s in specs)


@pytest.mark.parametrize("simulated", [True, False])
async def test_the_record_says_whether_the_server_is_simulated(simulated):
    # The sim executor's server says so in /v1/models and in every answer; the load
    # generator's record and table carry it on.
    engine = FakeEngine(vocab_size=VOCAB, tokens_per_s=1000)
    record = await run_load(engine, ["--workload", "cold", "--requests", "4",
                                     "--prompt-tokens", "32", "--concurrency", "2"],
                            simulated)  # fmt: skip
    assert record["simulated"] is simulated
    assert ("SIMULATED" in table(record).splitlines()[0]) is simulated
