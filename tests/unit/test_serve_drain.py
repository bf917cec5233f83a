"""A server a supervisor can trust, over the stand-in engine on a real socket: a drain
that ends whatever clients do, slow clients dropped, a fault answered as JSON 503, the
completions refusals, and the one id rule."""

from __future__ import annotations

import socket

import anyio
import httpx
import pytest

from tests.helpers.fake_engine import FakeEngine
from wavepp.ids import id_problem
from wavepp.serve.app import ServeOptions
from wavepp.serve.server import serve

pytestmark = pytest.mark.anyio
OPTIONS = ServeOptions(drain_timeout_s=1.0, header_timeout_s=0.5, body_timeout_s=30.0)


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def _serving(engine: FakeEngine, options: ServeOptions, test) -> None:
    ready = anyio.Event()
    where: list[int] = []

    def on_ready(host: str, port: int) -> None:
        where.append(port)
        ready.set()

    with anyio.fail_after(60):  # hang guard only
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run)
            served = anyio.Event()

            async def run_server() -> None:
                await serve(engine, "127.0.0.1", 0, options, on_ready=on_ready)
                served.set()

            tg.start_soon(run_server)
            await ready.wait()
            await test(where[0], served)
            engine.drain()
            engine.resume()


def _raw(port: int, data: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(data)
    return sock


def _closed(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


async def test_a_drain_ends_whatever_clients_do():
    engine = FakeEngine(vocab_size=1000)
    engine.pause()  # requests in flight never finish by themselves

    async def test(port: int, served: anyio.Event) -> None:
        url = f"http://127.0.0.1:{port}"
        head = b"POST /v1/prefill HTTP/1.1\r\nHost: x\r\nContent-Length: 20\r\n\r\n"
        stalled = _raw(port, head + b'{"to')
        slow = _raw(port, b"POST /v1/prefill HTTP/1.1\r\nHost: x\r\n")
        answers: list[httpx.Response] = []
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:

            async def ask(i: int) -> None:
                answers.append(await client.post("/v1/prefill",
                                                 json={"tokens": [1, 2, i], "id": f"r{i}"}))

            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(ask, i)
                while len(engine.requests) < 3:
                    await anyio.sleep(0.01)
                engine.drain()  # what SIGTERM does
                await anyio.sleep(0.1)
                health = await client.get("/health")
                assert health.status_code == 503 and health.json()["status"] == "draining"
                assert health.json()["error"] == "draining"
                late = await client.post("/v1/prefill", json={"tokens": [5]})
                assert late.status_code == 503 and late.headers["retry-after"]
                assert "draining" in late.json()["error"]["message"]
            with anyio.fail_after(30):
                await served.wait()  # serve returned: the stalled clients did not hold it
        assert sorted(r.json()["status"] for r in answers) == ["cancelled"] * 3
        assert all("drain timeout" in r.json()["error"] for r in answers)
        assert _closed(slow)
        stalled.settimeout(5)
        assert stalled.recv(4096).startswith(b"HTTP/1.1 503")  # answered, not waited for

    await _serving(engine, OPTIONS, test)


async def test_slow_headers_are_dropped_and_slow_bodies_get_408():
    engine = FakeEngine(vocab_size=1000)
    options = ServeOptions(header_timeout_s=0.3, body_timeout_s=0.5)

    async def test(port: int, served: anyio.Event) -> None:
        slow = _raw(port, b"GET /health HTTP/1.1\r\nHost")
        stalled = _raw(port, b"POST /v1/prefill HTTP/1.1\r\nHost: x\r\nContent-Length: 20\r\n\r\n{")
        await anyio.to_thread.run_sync(lambda: _closed(slow))
        stalled.settimeout(5)
        reply = await anyio.to_thread.run_sync(lambda: stalled.recv(4096))
        assert reply.startswith(b"HTTP/1.1 408")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            assert (await client.get("/health")).status_code == 200  # still serving

    await _serving(engine, options, test)


async def test_a_fault_answers_every_request_as_json_503_naming_the_rank():
    engine = FakeEngine(vocab_size=1000)
    engine.pause()

    async def test(port: int, served: anyio.Event) -> None:
        answers: list[httpx.Response] = []
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:

            async def ask(i: int) -> None:
                answers.append(await client.post("/v1/prefill", json={"tokens": [1, i]}))

            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(ask, i)
                while len(engine.requests) < 3:
                    await anyio.sleep(0.01)
                engine.fail("rank 1 sent no heartbeat for 10.0 s (dead or hung)")
            with anyio.fail_after(30):
                await served.wait()
        assert [r.status_code for r in answers] == [503] * 3
        for reply in answers:
            error = reply.json()["error"]
            assert "rank 1" in error["message"] and error["type"] == "unavailable"

    await _serving(engine, OPTIONS, test)


@pytest.mark.parametrize(
    "body, field",
    [({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -3}, "max_tokens"),
     ({"logprobs": 1}, "logprobs"), ({"temperature": 0.7}, "temperature"),
     ({"top_p": 0.5}, "top_p"), ({"stop": ["\n"]}, "stop"),
     ({"echo": True}, "echo"), ({"prompt": [1.5, 2.5]}, "integer")],
)  # fmt: skip
async def test_completions_refuse_what_a_prefill_does_not_do(body, field):
    from wavepp.serve.api import ApiError, parse_completion

    raw = httpx.Request("POST", "http://x", json={"prompt": [1, 2], **body}).content
    with pytest.raises(ApiError, match=field) as caught:
        parse_completion(raw, None)
    assert caught.value.status == 400
    ok = httpx.Request("POST", "http://x", json={"prompt": [1, 2], "temperature": 0,
                                                 "max_tokens": 1}).content  # fmt: skip
    assert parse_completion(ok, None)[0].tokens.tolist() == [1, 2]


def test_one_id_rule():
    assert id_problem("a-1.b_c") is None
    for bad in (None, 7, True, "", "a/b", "x" * 129, "tab\there"):
        assert id_problem(bad)


def test_requests_file_ids_are_strings_and_a_bom_is_skipped(tmp_path):
    from wavepp.workload.requests_file import read_requests_file

    path = tmp_path / "r.jsonl"
    path.write_bytes('\ufeff{"id": "a", "tokens": [1]}\n{"id": null, "tokens": [1]}\n'
                     '{"id": true, "tokens": [1]}\n{"id": 7, "tokens": [1]}\n'
                     '{"id": "7", "tokens": [1]}\n{"id": "x/y", "tokens": [1]}\n'.encode())
    specs, rejected, _ = read_requests_file(path, 100)
    assert [s.request_id for s in specs] == ["a", "7"]
    assert [r["line"] for r in rejected] == [2, 3, 4, 6]
    assert "must be a string" in rejected[0]["error"] and ":2:" in rejected[0]["error"]
