"""The HTTP front end over a stand-in engine: routes, bad input, cancel, metrics, drain."""

from __future__ import annotations

import json

import anyio
import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.fake_engine import FakeEngine, expected_first_token
from wavepp.serve.api import parse_prefill
from wavepp.serve.app import ServeOptions, build_app
from wavepp.serve.prom import parse_exposition, sample
from wavepp.serve.server import serve

pytestmark = pytest.mark.anyio

VOCAB = 1000


@pytest.fixture
def anyio_backend():
    return "asyncio"


class Harness:
    def __init__(self, engine: FakeEngine, client: httpx.AsyncClient) -> None:
        self.engine = engine
        self.client = client


def _harness(options: ServeOptions | None = None, **engine_args):
    engine = FakeEngine(vocab_size=VOCAB, **engine_args)
    app = build_app(engine, options)
    transport = httpx.ASGITransport(app=app)
    return engine, httpx.AsyncClient(transport=transport, base_url="http://wavepp")


async def _with_engine(test, options: ServeOptions | None = None, **engine_args):
    engine, client = _harness(options, **engine_args)
    async with client, anyio.create_task_group() as tg:
        tg.start_soon(engine.run)
        try:
            await test(Harness(engine, client))
        finally:
            engine.drain()


async def test_prefill_answers_the_first_token_and_timings():
    async def test(h: Harness):
        tokens = list(range(1, 40))
        reply = await h.client.post("/v1/prefill", json={"tokens": tokens, "id": "a"})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["id"] == "a"
        assert body["status"] == "done"
        assert body["first_token"] == expected_first_token(tokens, VOCAB)
        assert body["num_tokens"] == 39
        t = body["timings"]
        assert t["submitted_at"] <= t["admitted_at"] <= t["done_at"]
        assert t["total_s"] >= t["queued_s"] >= 0
        # The same prompt again reuses its full blocks.
        again = (await h.client.post("/v1/prefill", json={"tokens": tokens})).json()
        assert again["cached_tokens"] == 32
        assert again["id"] != "a"

    await _with_engine(test)


async def test_completions_in_the_openai_shape():
    options = ServeOptions(
        model_name="tiny",
        tokenize=lambda text: [ord(c) for c in text],
        detokenize=lambda token: f"<{token}>",
    )

    async def test(h: Harness):
        reply = await h.client.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": "hello", "max_tokens": 1, "temperature": 0.0},
        )
        assert reply.status_code == 200, reply.text
        body = reply.json()
        token = expected_first_token([ord(c) for c in "hello"], VOCAB)
        assert body["object"] == "text_completion"
        assert body["model"] == "tiny"
        assert body["choices"][0]["text"] == f"<{token}>"
        assert body["choices"][0]["token"] == token
        assert body["usage"]["prompt_tokens"] == 5
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert body["wavepp"]["status"] == "done"
        ids = await h.client.post("/v1/completions", json={"prompt": [[5, 6, 7]]})
        assert ids.json()["choices"][0]["token"] == expected_first_token([5, 6, 7], VOCAB)
        text = await h.client.post("/v1/prefill", json={"text": "hello"})
        assert text.json()["first_token"] == token

    await _with_engine(test, options)


BAD = [
    ("/v1/prefill", b"{not json", 400, "not valid JSON"),
    ("/v1/prefill", b"[1, 2]", 400, "invalid request body"),
    ("/v1/prefill", b'{"tokens": []}', 400, "empty prompt"),
    ("/v1/prefill", b'{"tokens": [1, 2, 1000]}', 400, "outside the vocabulary 0..999"),
    ("/v1/prefill", b'{"tokens": [1, -1]}', 400, "outside the vocabulary"),
    ("/v1/prefill", b'{"tokens": [1, 99999999999999999999999]}', 400, ""),
    ("/v1/prefill", b'{"tokens": [1, true]}', 400, "Expected `int`"),
    ("/v1/prefill", b'{"tokens": [1], "priority": "high"}', 400, "priority"),
    ("/v1/prefill", b'{"tokens": [1], "priority": 99999}', 400, "priority"),
    ("/v1/prefill", b'{"tokens": [1], "text": "a"}', 400, "exactly one"),
    ("/v1/prefill", b"{}", 400, "exactly one"),
    ("/v1/prefill", b'{"text": "abc"}', 400, "no tokenizer"),
    ("/v1/prefill", b'{"tokens": [1], "id": ""}', 400, "id"),
    ("/v1/prefill", b'{"tokens": [1], "id": "a\\nb"}', 400, "printable"),
    ("/v1/prefill", json.dumps({"tokens": [1] * 5000}).encode(), 400, "can never fit"),
    # Bodies over 256 KiB are decoded in a worker thread; same answers.
    ("/v1/prefill", json.dumps({"tokens": [1] * 100_000}).encode(), 400, "can never fit"),
    ("/v1/prefill", json.dumps({"tokens": [5000] * 100_000}).encode(), 400, "100,000 token"),
    ("/v1/prefill", b"[" * 100_000, 400, ""),
    # nested past msgspec's depth guard, in a typed field, an unknown one, a chat's message
    ("/v1/prefill", b'{"tokens": [1], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400,
     "too deeply"),
    ("/v1/completions", b'{"prompt": [1], "x": ' + b"[" * 99_999 + b"]" * 99_999 + b"}", 400,
     "too deeply"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": '
     + b"[" * 100_000 + b"]" * 100_000 + b"}]}", 400, "too deeply"),
    ("/v1/completions", b'{"prompt": [1, 2], "max_tokens": 16}', 400, "max_tokens 16"),
    ("/v1/completions", b'{"prompt": [1, 2], "stream": true}', 400, "stream"),
    ("/v1/completions", b'{"prompt": [[1], [2]]}', 400, "batched prompts (2)"),
    ("/v1/completions", b'{"prompt": [1.5]}', 400, "prompt must be"),
    ("/v1/completions", b'{"max_tokens": 1}', 400, "prompt"),
]


@pytest.mark.parametrize(("route", "raw", "status", "message"), BAD)
async def test_bad_input_gets_a_4xx_and_the_server_keeps_serving(route, raw, status, message):
    async def test(h: Harness):
        reply = await h.client.post(
            route, content=raw, headers={"content-type": "application/json"}
        )
        assert reply.status_code == status, reply.text
        error = reply.json()["error"]
        assert message in error["message"]
        assert error["code"] == status
        ok = await h.client.post("/v1/prefill", json={"tokens": [1, 2, 3]})
        assert ok.status_code == 200
        assert h.engine.counts["done"] == 1
        assert not h.engine.requests.keys() - {ok.json()["id"]}  # nothing else was submitted

    await _with_engine(test, capacity_tokens=4096)


async def test_body_over_the_limit_is_refused_before_it_is_read():
    async def test(h: Harness):
        big = json.dumps({"tokens": list(range(500))}).encode()
        reply = await h.client.post("/v1/prefill", content=big)
        assert reply.status_code == 413
        assert "over the limit of 1,000 bytes" in reply.json()["error"]["message"]

        async def chunks():  # no Content-Length: the streamed size decides
            for _ in range(10):
                yield b" " * 200

        streamed = await h.client.post("/v1/prefill", content=chunks())
        assert streamed.status_code == 413
        ok = await h.client.post("/v1/prefill", json={"tokens": [1, 2]})
        assert ok.status_code == 200

    await _with_engine(test, ServeOptions(max_body_bytes=1000))


async def test_duplicate_id_conflicts_and_cancel_by_id():
    async def test(h: Harness):
        h.engine.pause()  # "a" stays queued until we cancel it
        results = {}

        async def first():
            results["a"] = await h.client.post("/v1/prefill", json={"tokens": [1] * 50, "id": "a"})

        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            await wait_for(lambda: "a" in h.engine.requests)
            dup = await h.client.post("/v1/prefill", json={"tokens": [2], "id": "a"})
            assert dup.status_code == 409
            assert "duplicate" in dup.json()["error"]["message"]
            gone = await h.client.delete("/v1/requests/a")
            assert gone.status_code == 200
            assert gone.json() == {"id": "a", "cancelled": True}
        h.engine.resume()
        assert results["a"].status_code == 200
        assert results["a"].json()["status"] == "cancelled"
        again = await h.client.delete("/v1/requests/a")
        assert again.status_code == 404
        assert "already over" in again.json()["error"]["message"]
        unknown = await h.client.delete("/v1/requests/nobody")
        assert unknown.status_code == 404

    await _with_engine(test)


async def wait_for(condition, timeout: float = 10.0) -> None:
    with anyio.fail_after(timeout):
        while not condition():
            await anyio.sleep(0.01)


async def test_health_and_metrics():
    async def test(h: Harness):
        assert (await h.client.get("/health")).json() == {"status": "ok"}
        for i in range(3):
            await h.client.post("/v1/prefill", json={"tokens": [i + 1] * 40})
        await h.client.post("/v1/prefill", json={"tokens": []})
        text = (await h.client.get("/metrics")).text
        kinds = {f.name: f.type for f in text_string_to_metric_families(text)}
        assert kinds["wavepp_http_responses"] == "counter"  # wavepp_http_responses_total
        assert kinds["wavepp_engine_admission_round_seconds"] == "summary"
        assert all(name.startswith("wavepp_") for name in kinds)
        samples = parse_exposition(text)
        assert sample(samples, "wavepp_http_responses_total", route="/v1/prefill", code="400") == 1
        assert sample(samples, "wavepp_http_responses_total", route="/v1/prefill", code="200") == 3
        assert sample(samples, "wavepp_engine_requests", state="done") == 3
        assert sample(samples, "wavepp_engine_queue_depth") == 0
        assert sample(samples, "wavepp_engine_stages_utilization", stage="1") is not None
        assert sample(samples, "wavepp_engine_stages_pool_capacity", stage="0") == 4096
        assert sample(samples, "wavepp_table_size", table="requests") == 3
        assert sample(samples, "wavepp_table_size", table="serve_handles") == 0
        assert sample(samples, "wavepp_up") == 1
        h.engine.healthy = (False, "rank 1 sent no heartbeat for 10.0 s (dead or hung)")
        sick = await h.client.get("/health")
        assert sick.status_code == 503
        assert "rank 1 sent no heartbeat" in sick.json()["error"]
        assert sample(parse_exposition((await h.client.get("/metrics")).text), "wavepp_up") == 0

    await _with_engine(test)


async def test_the_autoscaling_gauges_follow_the_work_waiting():
    """Queued prompts, then the admitted batch's uncached tokens, then nothing: the tokens
    waiting, the oldest request's wait and the predicted time to drain move with them."""

    engine = FakeEngine(vocab_size=VOCAB, tokens_per_s=2000)
    app = build_app(engine)

    async def count_results() -> None:  # as wavepp.serve.server.serve feeds the metrics
        async for result in engine.results():
            app.state.front.metrics.observe(result)

    async def test(h: Harness):
        async def scrape() -> dict[str, float]:
            return parse_exposition((await h.client.get("/metrics")).text)

        async def prefill(tokens: list[int]) -> None:
            assert (await h.client.post("/v1/prefill", json={"tokens": tokens})).status_code == 200

        s = await scrape()
        assert sample(s, "wavepp_engine_tokens_waiting", state="queued") == 0
        assert sample(s, "wavepp_engine_queue_oldest_seconds") == 0
        assert sample(s, "wavepp_drain_seconds") == 0  # nothing waits
        h.engine.pause()
        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(prefill, [i + 1] * 100)
            await wait_for(lambda: len(h.engine.queue) == 3)
            s = await scrape()
            assert sample(s, "wavepp_engine_tokens_waiting", state="queued") == 300
            assert sample(s, "wavepp_engine_tokens_waiting", state="admitted") == 0
            assert sample(s, "wavepp_drain_seconds") is None  # work waits, no rate yet
            waited = sample(s, "wavepp_engine_queue_oldest_seconds")
            assert waited > 0
            await anyio.sleep(0.05)
            assert sample(await scrape(), "wavepp_engine_queue_oldest_seconds") > waited
            h.engine.resume()
            await wait_for(lambda: bool(h.engine.running))  # admitted, being computed
            s = await scrape()
            assert sample(s, "wavepp_engine_tokens_waiting", state="queued") == 0
            assert sample(s, "wavepp_engine_tokens_waiting", state="admitted") == 300
            assert sample(s, "wavepp_engine_queue_oldest_seconds") == 0
        s = await scrape()
        assert sample(s, "wavepp_engine_tokens_waiting", state="admitted") == 0
        assert sample(s, "wavepp_drain_seconds") == 0
        assert sample(s, "wavepp_computed_tokens_per_second") > 0
        h.engine.pause()  # new work waits: predicted at the recent prompt-token rate
        async with anyio.create_task_group() as tg:
            tg.start_soon(prefill, [7] * 200)
            await wait_for(lambda: len(h.engine.queue) == 1)
            s = await scrape()
            rate = sample(s, "wavepp_throughput_tokens_per_second")
            assert sample(s, "wavepp_drain_seconds") == pytest.approx(200 / rate, rel=0.01)
            h.engine.resume()

    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://wavepp")
    async with client, anyio.create_task_group() as tg:
        tg.start_soon(engine.run)
        tg.start_soon(count_results)
        try:
            await test(Harness(engine, client))
        finally:
            engine.drain()
            tg.cancel_scope.cancel()


async def test_models_lists_the_vocabulary():
    async def test(h: Harness):
        body = (await h.client.get("/v1/models")).json()
        assert body["data"][0]["wavepp"]["vocab_size"] == VOCAB
        assert body["data"][0]["wavepp"]["block_size"] == 16
        missing = await h.client.get("/v1/nothing")
        assert missing.status_code == 404
        assert "no such route" in missing.json()["error"]["message"]
        wrong = await h.client.get("/v1/prefill")
        assert wrong.status_code == 405

    await _with_engine(test)


async def _live_server(engine: FakeEngine, test, options: ServeOptions | None = None):
    """The real uvicorn server on a free port, the engine running next to it."""
    ready = anyio.Event()
    where = {}

    def on_ready(host: str, port: int) -> None:
        where["url"] = f"http://{host}:{port}"
        ready.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.run)
        tg.start_soon(lambda: serve(engine, "127.0.0.1", 0, options, on_ready=on_ready))
        with anyio.fail_after(30):
            await ready.wait()
        async with httpx.AsyncClient(base_url=where["url"], timeout=30) as client:
            await test(client)
        engine.drain()


async def test_disconnect_cancels_on_a_real_server():
    engine = FakeEngine(vocab_size=VOCAB, tokens_per_s=20.0)  # 50 tokens: 2.5 s

    async def test(client: httpx.AsyncClient):
        with anyio.move_on_after(0.1):  # give up mid-request: the connection closes
            await client.post("/v1/prefill", json={"tokens": [1] * 50, "id": "gone"})
        await wait_for(lambda: "gone" in engine.requests and engine.requests["gone"].result)
        assert engine.requests["gone"].result.status == "cancelled"
        assert engine.requests["gone"].admitted_at is not None  # it was running
        engine.tokens_per_s = 50_000.0
        kept = await client.post("/v1/prefill", json={"tokens": [2] * 20, "id": "kept"})
        assert kept.json()["status"] == "done"
        samples = parse_exposition((await client.get("/metrics")).text)
        assert sample(samples, "wavepp_disconnect_cancels_total") == 1
        assert sample(samples, "wavepp_results_total", status="cancelled") == 1
        assert sample(samples, "wavepp_results_total", status="done") == 1

    with anyio.fail_after(60):
        await _live_server(engine, test)


async def test_drain_answers_the_requests_in_flight_then_stops():
    engine = FakeEngine(vocab_size=VOCAB, tokens_per_s=400.0)
    answers = []

    async def test(client: httpx.AsyncClient):
        async def one(i: int):
            reply = await client.post("/v1/prefill", json={"tokens": [i + 1] * 40})
            answers.append(reply.json()["status"])

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(one, i)
            await wait_for(lambda: len(engine.requests) == 4)
            engine.drain()
            refused = await client.post("/v1/prefill", json={"tokens": [9]})
            assert refused.status_code == 503
            assert "draining" in refused.json()["error"]["message"]
            health = await client.get("/health")
            assert health.status_code == 503
            assert health.json()["status"] == "draining"

    with anyio.fail_after(60):
        await _live_server(engine, test)
    assert answers == ["done"] * 4
    assert engine.counts["done"] == 4
    assert not engine.queue
    assert not engine.running


def test_token_arrays_are_int32():
    sub = parse_prefill(b'{"tokens": [1, 2, 3], "priority": -3}', None)
    assert sub.tokens.dtype == np.int32
    assert sub.tokens.tolist() == [1, 2, 3]
    assert sub.priority == -3
    assert sub.request_id is None


async def test_a_higher_class_overtakes_the_queue():
    # Room for one prompt at a time: requests queue, and the class decides who goes next.
    async def test(h: Harness):
        order = []

        async def send(rid: str, priority: int, token: int):
            body = {"tokens": [token] * 90, "id": rid, "priority": priority}
            reply = await h.client.post("/v1/prefill", json=body)
            assert reply.status_code == 200
            order.append(rid)

        h.engine.pause()
        async with anyio.create_task_group() as tg:
            arrivals = [("low-a", 0), ("low-b", 0), ("high", 5), ("mid", 1), ("low-c", 0)]
            for token, (rid, priority) in enumerate(arrivals, 1):
                tg.start_soon(send, rid, priority, token)
                await wait_for(lambda rid=rid: rid in h.engine.requests)
            h.engine.resume()
        assert order == ["high", "mid", "low-a", "low-b", "low-c"]

    await _with_engine(test, capacity_tokens=100)


def test_text_prompts_through_a_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from wavepp.serve.__main__ import _tokenizer_path, tokenizer_functions

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "again": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    path = _tokenizer_path(None, str(tmp_path))
    assert path == tmp_path / "tokenizer.json"
    assert _tokenizer_path(None, "tiny-hybrid") is None
    with pytest.raises(SystemExit, match="no such file"):
        _tokenizer_path(str(tmp_path / "missing.json"), None)
    tokenize, detokenize, _, _ = tokenizer_functions(path)
    assert tokenize("hello world again") == [1, 2, 3]
    assert detokenize(2) == "world"
    assert parse_prefill(b'{"text": "world hello"}', tokenize).tokens.tolist() == [2, 1]


async def test_over_max_in_flight_gets_429_and_counts_recover():
    async def test(h: Harness):
        h.engine.pause()
        replies = []

        async def send(i: int):
            replies.append(await h.client.post("/v1/prefill", json={"tokens": [i + 1] * 5}))

        async with anyio.create_task_group() as tg:
            for i in range(2):
                tg.start_soon(send, i)
            await wait_for(lambda: len(h.engine.requests) == 2)
            busy = await h.client.post("/v1/prefill", json={"tokens": [7]})
            assert busy.status_code == 429
            assert "2 requests in flight (--max-in-flight 2)" in busy.json()["error"]["message"]
            samples = parse_exposition((await h.client.get("/metrics")).text)
            assert sample(samples, "wavepp_http_in_flight") == 2
            h.engine.resume()
        assert [r.status_code for r in replies] == [200, 200]
        assert (await h.client.post("/v1/prefill", json={"tokens": [7]})).status_code == 200
        samples = parse_exposition((await h.client.get("/metrics")).text)
        assert sample(samples, "wavepp_http_in_flight") == 0
        assert len(h.engine.requests) == 3  # the refused one never reached the engine

    await _with_engine(test, ServeOptions(max_in_flight=2))


def test_listening_socket_lets_asyncio_disable_nagle():
    # asyncio sets TCP_NODELAY on accepted connections only when the socket's proto is
    # IPPROTO_TCP; with proto 0 every kept-alive answer waited ≈ 40 ms on delayed ACKs.
    import socket

    from wavepp.serve.server import bind

    sock = bind("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        with pytest.raises(SystemExit, match=r"cannot listen on 127\.0\.0\.1"):
            bind("127.0.0.1", sock.getsockname()[1])
    finally:
        sock.close()


@pytest.mark.parametrize("simulated", [True, False])
async def test_every_answer_says_whether_the_waves_are_simulated(simulated):
    async def test(h: Harness):
        models = (await h.client.get("/v1/models")).json()
        assert models["data"][0]["wavepp"]["simulated"] is simulated
        prefill = (await h.client.post("/v1/prefill", json={"tokens": [1, 2, 3]})).json()
        assert prefill["simulated"] is simulated
        completion = (await h.client.post("/v1/completions", json={"prompt": [1, 2, 3]})).json()
        assert completion["wavepp"]["simulated"] is simulated
        metrics = parse_exposition((await h.client.get("/metrics")).text)
        assert sample(metrics, "wavepp_simulated") == float(simulated)

    await _with_engine(test, ServeOptions(simulated=simulated))
