"""The router as a P/D proxy (``wavepp.route.pd``): stand-in replicas (httpx's
MockTransport) for the prefill leg, the fake decoder app (``tests/helpers/fake_decoder``)
for the decode leg — the proxy's shape to P, P's kv_transfer_params to D, one request id
on both legs, D's stream passed on, errors naming their leg, decoders chosen by load and
health."""

from __future__ import annotations

import json

import anyio
import httpx

from tests.helpers.fake_decoder import TOKENS, FakeDecoder
from tests.helpers.fake_fleet import Fleet, run
from wavepp.route.app import build_app
from wavepp.route.pd import Decoder, Disaggregated
from wavepp.route.replicas import WatchOptions
from wavepp.serve.prom import parse_exposition, sample

PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "prompt_token_ids": [1, 2, 3],
          "remote_prefill_cached_tokens": 8,
          "wavepp": {"version": 1, "request_id": "x", "stages": ["unix:/s0"], "num_tokens": 3,
                     "first_token": 5, "expires_in_s": 29.0}}  # fmt: skip


class Dispatch(httpx.AsyncBaseTransport):
    """Requests to each host go to its own transport."""

    def __init__(self, by_host: dict[str, httpx.AsyncBaseTransport]) -> None:
        self.by_host = by_host

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        transport = self.by_host.get(request.url.host)
        if transport is None:
            raise httpx.ConnectError(f"no host {request.url.host}", request=request)
        return await transport.handle_async_request(request)


class Rig:
    """Two stand-in replicas answering P's way, fake decoders ``d0``, ``d1``."""

    def __init__(self, decoders: int = 1) -> None:
        self.fleet = Fleet()
        self.prefills: list[tuple[dict, dict]] = []  # (body, headers) P got
        self.answer_params: dict | None = PARAMS
        self.fleet.behave = {n: self.prefill for n in ("r0", "r1")}
        self.fakes = [FakeDecoder() for _ in range(decoders)]
        hosts = {f"{r.name}.test": httpx.MockTransport(self.fleet.handler)
                 for r in self.fleet.replicas}  # fmt: skip
        hosts.update({f"d{i}.test": httpx.ASGITransport(app=fake.app)
                      for i, fake in enumerate(self.fakes)})  # fmt: skip
        router = self.fleet.router()
        router.client = httpx.AsyncClient(transport=Dispatch(hosts))
        self.router = router
        self.decoders = [Decoder(f"d{i}", f"http://d{i}.test") for i in range(decoders)]
        for d in self.decoders:
            d.state = "up"
        self.pd = Disaggregated(router, self.decoders)

    async def prefill(self, name: str, request: httpx.Request, body: dict) -> httpx.Response:
        self.prefills.append((body, dict(request.headers)))
        answer = {"id": f"cmpl-{request.headers.get('x-request-id')}", "choices": [
            {"index": 0, "text": "<5>", "finish_reason": "length"}],
            "wavepp": {"status": "done", "num_tokens": 3, "cached_tokens": 8}}  # fmt: skip
        if self.answer_params is not None:
            answer["kv_transfer_params"] = self.answer_params
        return httpx.Response(200, json=answer)

    def client(self) -> httpx.AsyncClient:
        app = build_app(self.router, pd=self.pd)
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://rt")


def test_a_streamed_completion_goes_through_p_then_d_under_one_id():
    async def test():
        rig = Rig()
        body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 16, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": 0.5, "min_tokens": 2}
        headers = {"X-Request-Id": "abc-1", "Authorization": "Bearer k"}
        async with rig.client() as client, client.stream(
                "POST", "/v1/completions", json=body, headers=headers) as reply:  # fmt: skip
            assert reply.status_code == 200
            assert reply.headers["x-wavepp-decoder"] == "d0"
            events = [line[6:] async for line in reply.aiter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        texts = [json.loads(e)["choices"][0]["text"] for e in events[:-2]]
        assert texts == [f"<{t}>" for t in TOKENS]
        assert json.loads(events[-2])["usage"]["prompt_tokens_details"]["cached_tokens"] == 8
        ((p_body, p_headers),) = rig.prefills
        assert p_body["kv_transfer_params"] == {
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip
        assert (p_body["stream"], p_body["max_tokens"], p_body["request_id"]) == (False, 1,
                                                                                 "abc-1")
        assert "stream_options" not in p_body and "min_tokens" not in p_body
        assert p_body["temperature"] == 0.5  # the rest as the client sent it
        ((path, d_body, d_headers),) = rig.fakes[0].seen
        assert path == "/v1/completions"
        assert d_body == {**body, "kv_transfer_params": PARAMS}  # the client's, plus P's params
        assert p_headers["x-request-id"] == d_headers["x-request-id"] == "abc-1"
        assert p_headers["authorization"] == d_headers["authorization"] == "Bearer k"
        assert rig.router.in_flight == {} and rig.decoders[0].in_flight == 0

    run(test)


def test_a_whole_chat_answer_gets_the_prefills_cached_tokens_when_d_leaves_them_out():
    async def test():
        rig = Rig()
        rig.fakes[0].usage_details = False
        body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 8}
        async with rig.client() as client:
            reply = await client.post("/v1/chat/completions", json=body)
            metrics = parse_exposition((await client.get("/metrics")).text)
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert answer["choices"][0]["message"]["content"] == "".join(f"<{t}>" for t in TOKENS)
        assert answer["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}
        ((p_body, p_headers),) = rig.prefills
        assert p_body["max_completion_tokens"] == 1 and p_body["messages"] == body["messages"]
        rid = p_headers["x-request-id"]
        assert rid.startswith("route-") and answer["id"] == f"chatcmpl-{rid}"
        assert rig.fakes[0].seen[0][2]["x-request-id"] == rid
        assert sample(metrics, "wavepp_route_pd_legs_total", leg="prefill", code="200") == 1
        assert sample(metrics, "wavepp_route_pd_legs_total", leg="decode", code="200") == 1
        assert sample(metrics, "wavepp_route_pd_prefills_total", cache="held") == 1
        assert sample(metrics, "wavepp_route_decoder_answers_total", decoder="d0",
                      code="200") == 1  # fmt: skip

    run(test)


def test_without_a_held_cache_d_gets_the_clients_body_as_it_came():
    async def test():
        rig = Rig()
        rig.answer_params = None
        body = {"prompt": "hello", "max_tokens": 4}
        async with rig.client() as client:
            assert (await client.post("/v1/completions", json=body)).status_code == 200
            metrics = parse_exposition((await client.get("/metrics")).text)
        assert rig.fakes[0].seen[0][1] == body
        assert sample(metrics, "wavepp_route_pd_prefills_total", cache="none") == 1

    run(test)


def test_errors_name_the_leg_that_failed():
    async def test():
        rig = Rig()

        async def refuses(name, request, body):
            return httpx.Response(400, json={"error": {"message": "max_tokens must be 1",
                                                       "type": "invalid_request_error"}})

        async with rig.client() as client:
            rig.fakes[0].status = 500
            broken = await client.post("/v1/completions", json={"prompt": [1, 2]})
            rig.fleet.behave = {"r0": refuses, "r1": refuses}
            refused = await client.post("/v1/completions", json={"prompt": [1, 2]})
            rig.decoders[0].state = "out"
            rig.fleet.behave = {n: rig.prefill for n in ("r0", "r1")}
            nobody = await client.post("/v1/completions", json={"prompt": [1, 2]})
        assert broken.status_code == 500
        assert broken.json()["error"]["leg"] == "decode"
        assert "decoder d0 (http://d0.test) answered 500: the decoder broke" in broken.text
        assert refused.status_code == 400 and refused.json()["error"]["leg"] == "prefill"
        assert "answered 400: max_tokens must be 1" in refused.json()["error"]["message"]
        assert refused.json()["error"]["type"] == "invalid_request_error"
        assert nobody.status_code == 503 and nobody.json()["error"]["leg"] == "decode"
        assert "no decoder is up: d0 out" in nobody.text

    run(test)


def test_the_least_busy_healthy_decoder_is_chosen_and_an_unreachable_one_skipped():
    async def test():
        rig = Rig(decoders=3)
        rig.decoders[0].in_flight = 2  # busy
        rig.decoders[1].state = "out"  # failed its health checks
        rig.decoders[2].url = "http://gone.test"  # up, but unreachable
        async with rig.client() as client:
            reply = await client.post("/v1/completions", json={"prompt": [1, 2]})
            health = (await client.get("/health")).json()
        assert reply.status_code == 200 and len(rig.fakes[0].seen) == 1
        assert rig.decoders[2].state == "out" and "cannot reach it" in rig.decoders[2].reason
        assert [d["state"] for d in health["decoders"]] == ["up", "out", "out"]

    run(test)


def test_a_decoder_is_up_while_its_health_answers():
    async def test():
        fake = FakeDecoder()
        client = httpx.AsyncClient(transport=Dispatch({"d0.test": httpx.ASGITransport(
            app=fake.app)}))  # fmt: skip
        decoder = Decoder("d0", "http://d0.test")
        options = WatchOptions(health_interval_s=0.01, fail_after=2)
        async with client, anyio.create_task_group() as tg:
            tg.start_soon(decoder.watch, client, options)
            while decoder.state != "up":
                await anyio.sleep(0.01)
            fake.healthy = False
            while decoder.state != "out":
                await anyio.sleep(0.01)
            assert "answered 503" in decoder.reason
            fake.healthy = True
            while decoder.state != "up":
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()

    run(test)


def test_without_decoders_a_chat_goes_to_a_replica_as_it_came():
    async def test():
        fleet = Fleet()
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(fleet.router())),
                                     base_url="http://rt") as client:  # fmt: skip
            fleet.behave = {n: (lambda name, request, body: _echo(body)) for n in ("r0", "r1")}
            reply = await client.post("/v1/chat/completions", json=chat)
        assert reply.status_code == 200
        ((_, path, body),) = fleet.seen
        assert path == "/v1/chat/completions" and body["messages"] == chat["messages"]
        assert body["request_id"].startswith("route-")

    run(test)


async def _echo(body: dict) -> httpx.Response:
    return httpx.Response(200, json={"echo": body})
