"""The router over stand-in replicas (httpx's MockTransport): routing by a fed index, ids,
retries, failover, streams, /health, /metrics, /v1/models, and a replica's watcher."""

from __future__ import annotations

import functools

import anyio
import httpx
import pytest

from tests.helpers.fake_fleet import BLOCK, FakeIndex, Fleet, client_of, run
from wavepp.route.app import build_app
from wavepp.route.policies import ROUTE_POLICIES, RouteRequest
from wavepp.route.replicas import Replica, WatchOptions, events_endpoint
from wavepp.route.router import Router
from wavepp.serve.prom import parse_exposition, sample
from wavepp.state import block_hashes


def test_prefix_routes_to_the_replica_whose_index_holds_the_prompt():
    async def test():
        fleet = Fleet()
        tokens = list(range(1, 11))  # 2 full blocks of 4, probe limit (10 - 1) // 4 = 2
        fleet.replicas[1].index.held.update(block_hashes(tokens, BLOCK))
        async with client_of(fleet.router()) as client:
            reply = await client.post("/v1/prefill", json={"tokens": tokens, "id": "a"})
            assert reply.status_code == 200
            assert reply.headers["x-wavepp-replica"] == "r1"
            assert reply.headers["x-wavepp-predicted-cached-tokens"] == "8"
            assert reply.json()["id"] == "a"
            # a prompt sharing one block with r1's and nothing with r0's: still r1
            reply = await client.post("/v1/prefill", json={"tokens": [1, 2, 3, 4, 9, 9, 9, 9]})
            assert reply.headers["x-wavepp-replica"] == "r1"
            assert reply.headers["x-wavepp-predicted-cached-tokens"] == "4"
            metrics = parse_exposition((await client.get("/metrics")).text)
        labels = {"replica": "r1", "policy": "prefix"}
        assert sample(metrics, "wavepp_route_requests_total", **labels) == 2
        assert sample(metrics, "wavepp_route_predicted_cached_tokens_total", **labels) == 12

    run(test)


def test_a_turn_follows_its_answered_prompt_before_the_events_announce_it():
    async def test():
        fleet = Fleet()
        client = httpx.AsyncClient(transport=httpx.MockTransport(fleet.handler))
        router = Router(fleet.replicas, ROUTE_POLICIES["prefix"], "prefix", client, explain=True)
        doc = list(range(1, 21))  # five blocks of 4
        async with client_of(router) as http:
            reply = await http.post("/v1/prefill", json={"tokens": doc, "id": "a"})
            assert reply.headers["x-wavepp-replica"] == "r0"  # nothing cached: the first
            # r1 announces two of doc's blocks (another request); r0's events are late
            fleet.replicas[1].index.held.update(block_hashes(doc, BLOCK)[:2])
            reply = await http.post("/v1/prefill", json={"tokens": [*doc, 7, 8, 9], "id": "b"})
        # the router sent doc to r0 and had its answer: 20 tokens there, 8 at r1
        assert reply.headers["x-wavepp-replica"] == "r0"
        assert reply.headers["x-wavepp-predicted-cached-tokens"] == "0"  # the events' figure
        assert reply.headers["x-wavepp-route-views"] == "r0=0/-/0/20/0/0;r1=8/-/0/0/0/0"
        assert "x-wavepp-route-views" not in (await _plain(fleet, doc)).headers

    run(test)


async def _plain(fleet: Fleet, tokens: list[int]) -> httpx.Response:
    async with client_of(fleet.router()) as http:  # no --explain: no views header
        return await http.post("/v1/prefill", json={"tokens": tokens})


def test_the_router_names_a_request_without_id_and_keeps_the_body_otherwise():
    async def test():
        fleet = Fleet()
        async with client_of(fleet.router()) as client:
            body = {"prompt": [5, 6, 7], "max_tokens": 1, "deadline_s": 2.5, "handoff": True}
            reply = await client.post("/v1/completions", json=body)
            assert reply.status_code == 200
        (_, path, sent), = fleet.seen
        assert path == "/v1/completions"
        assert sent.pop("request_id").startswith("route-")
        assert 0 < sent.pop("deadline_s") <= body.pop("deadline_s")  # what is left of it
        assert sent == body
        assert reply.headers["x-wavepp-request-id"].startswith("route-")

    run(test)


def test_a_replica_that_refuses_the_connection_is_taken_out_and_the_request_retried():
    async def test():
        fleet = Fleet()

        async def refuse(name, request, body):
            raise httpx.ConnectError("connection refused", request=request)

        fleet.behave["r0"] = refuse
        router = fleet.router("round-robin")
        async with client_of(router) as client:
            reply = await client.post("/v1/prefill", json={"tokens": [1, 2, 3]})
            assert reply.status_code == 200
            assert reply.headers["x-wavepp-replica"] == "r1"
            assert reply.headers["x-wavepp-attempts"] == "2"
            health = (await client.get("/health")).json()
            metrics = parse_exposition((await client.get("/metrics")).text)
        ids = [body["id"] for _, _, body in fleet.seen]
        assert len(ids) == 2 and ids[0] == ids[1]  # the same id on both: one request
        assert health["status"] == "ok"
        states = {r["name"]: (r["state"], r["reason"]) for r in health["replicas"]}
        assert states["r0"][0] == "out" and "cannot connect" in states["r0"][1]
        assert states["r1"] == ("up", None)
        assert sample(metrics, "wavepp_route_retries_total", reason="connect") == 1
        assert sample(metrics, "wavepp_route_replicas_up") == 1

    run(test)


def test_no_replica_up_is_a_503_and_health_says_so():
    async def test():
        fleet = Fleet()
        for r in fleet.replicas:
            r.take_out("killed")
        async with client_of(fleet.router()) as client:
            reply = await client.post("/v1/prefill", json={"tokens": [1, 2, 3]})
            assert reply.status_code == 503
            assert "no replica is up" in reply.json()["error"]["message"]
            health = await client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "unavailable"
        assert not fleet.seen

    run(test)


def test_a_draining_replica_is_skipped_and_the_request_goes_elsewhere():
    async def test():
        fleet = Fleet()

        async def draining(name, request, body):
            return httpx.Response(503, json={"error": {"message": "the server is draining and "
                                  "takes no new requests", "type": "draining", "code": 503}})

        fleet.behave["r0"] = draining
        router = fleet.router("round-robin")
        async with client_of(router) as client:
            reply = await client.post("/v1/prefill", json={"tokens": [1, 2, 3], "id": "x"})
        assert reply.status_code == 200 and reply.headers["x-wavepp-replica"] == "r1"
        assert fleet.replicas[0].state == "draining"

    run(test)


def test_a_replica_taken_out_while_a_request_waits_gets_a_cancel_and_the_request_moves():
    async def test():
        fleet = Fleet()
        hang = anyio.Event()

        async def hangs(name, request, body):
            if request.method == "DELETE":
                return httpx.Response(200, json={"cancelled": True})
            hang.set()
            await anyio.sleep(3600)

        fleet.behave["r0"] = hangs
        router = fleet.router("round-robin")
        async with client_of(router) as client, anyio.create_task_group() as tg:
            replies = []

            async def send():
                replies.append(await client.post("/v1/prefill", json={"tokens": [1], "id": "q"}))

            tg.start_soon(send)
            await hang.wait()
            # the same id while it is in flight: refused by the router itself
            dup = await client.post("/v1/prefill", json={"tokens": [1], "id": "q"})
            assert dup.status_code == 409
            fleet.replicas[0].take_out("/health: ReadTimeout (3 probes in a row)")
        assert replies[0].status_code == 200 and replies[0].headers["x-wavepp-replica"] == "r1"
        paths = [(name, path) for name, path, _ in fleet.seen]
        assert paths == [("r0", "/v1/prefill"), ("r0", "/v1/requests/q"), ("r1", "/v1/prefill")]
        assert router.in_flight == {} and not fleet.replicas[0].flights

    run(test)


def test_an_id_goes_to_each_replica_once_and_a_replicas_409_is_the_last_word():
    async def test():
        fleet = Fleet()
        answered: dict[str, set[str]] = {"r0": {"taken"}, "r1": set()}  # r0 ran "taken" once

        async def remembers(name, request, body):
            if body["id"] in answered[name]:
                return httpx.Response(409, json={"error": {"message": "duplicate id",
                                                           "type": "x", "code": 409}})
            answered[name].add(body["id"])
            return await fleet.done(name, request, body)

        fleet.behave = {"r0": remembers, "r1": remembers}
        router = fleet.router("least-load")
        async with client_of(router) as client:
            first = await client.post("/v1/prefill", json={"tokens": [1, 2], "id": "taken"})
            second = await client.post("/v1/prefill", json={"tokens": [1, 2], "id": "taken"})
        assert first.status_code == 409 and first.headers["x-wavepp-replica"] == "r0"
        assert second.status_code == 200  # refused, it ran nowhere: r1, not asked, runs it
        assert second.headers["x-wavepp-replica"] == "r1"

    run(test)


def test_an_id_the_fleet_has_answered_is_refused_and_runs_nowhere_again():
    async def test():
        fleet = Fleet()
        router = fleet.router("round-robin")
        async with client_of(router) as client:
            first = await client.post("/v1/prefill", json={"tokens": [1, 2], "id": "once"})
            again = [await client.post("/v1/prefill", json={"tokens": [3], "id": "once"})
                     for _ in range(3)]  # fmt: skip
            other = await client.post("/v1/prefill", json={"tokens": [1, 2], "id": "other"})
        assert first.status_code == 200 and other.status_code == 200
        for reply in again:
            assert reply.status_code == 409, reply.text
            assert "has been answered" in reply.json()["error"]["message"]
        assert [body["id"] for _, path, body in fleet.seen if path == "/v1/prefill"] == [
            "once", "other"]

    run(test)


def test_a_deeply_nested_body_is_a_400_from_the_router_and_reaches_no_replica():
    async def test():
        fleet = Fleet()
        deep = b"[" * 100_000 + b"]" * 100_000
        async with client_of(fleet.router()) as client:
            replies = [await client.post(route, content=b'{"tokens": [1], "x": ' + deep + b"}")
                       for route in ("/v1/prefill", "/v1/completions", "/v1/chat/completions")]
            fine = await client.post("/v1/prefill", json={"tokens": [1, 2]})
        for reply in replies:
            assert reply.status_code == 400, reply.text
            assert "nested too deeply" in reply.json()["error"]["message"]
        assert fine.status_code == 200 and len(fleet.seen) == 1

    run(test)


def test_a_stream_is_relayed_as_it_arrives():
    async def test():
        fleet = Fleet()
        events = [b'data: {"choices": [{"token_ids": [1]}]}\n\n', b"data: [DONE]\n\n"]

        async def streams(name, request, body):
            async def chunks():
                for event in events:
                    yield event

            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  content=chunks())

        fleet.behave = {"r0": streams, "r1": streams}
        router = fleet.router()
        async with client_of(router) as client:
            body = {"prompt": [1, 2, 3], "max_tokens": 4, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as reply:
                got = [chunk async for chunk in reply.aiter_bytes()]
        assert b"".join(got) == b"".join(events)
        assert router.in_flight == {}

    run(test)


def test_models_names_the_fleet_and_bad_bodies_reach_a_replica_untouched():
    async def test():
        fleet = Fleet()

        async def refuses(name, request, body):
            return httpx.Response(400, json={"error": {"message": "nope", "code": 400}})

        async with client_of(fleet.router()) as client:
            models = (await client.get("/v1/models")).json()
            fleet.behave = {"r0": refuses, "r1": refuses}
            reply = await client.post("/v1/prefill", content=b'{"tokens": [1, "two"]}')
        info = models["data"][0]["wavepp"]
        assert info["block_size"] == BLOCK
        assert info["fleet"] == {"replicas": 2, "replicas_up": 2, "policy": "prefix"}
        assert reply.status_code == 400 and reply.json()["error"]["message"] == "nope"

    run(test)


def test_the_watcher_learns_subscribes_takes_out_and_brings_back():
    async def test():
        health = {"code": 200}
        subscribed = []

        async def handler(request: httpx.Request) -> httpx.Response:
            if request.url.path == "/v1/models":
                return httpx.Response(200, json={"data": [{"id": "m", "wavepp": {
                    "block_size": 16, "kv_events": {"endpoint": "tcp://*:5557",
                                                    "replay": "tcp://*:5558", "topic": ""}}}]})
            if health["code"] is None:
                raise httpx.ConnectError("refused", request=request)
            return httpx.Response(health["code"], json={"status": "ok"})

        class Feed:
            connected = True
            last_seq = 3

        def subscribe(endpoint, replay, index, topic):
            subscribed.append((endpoint, replay, topic))
            return Feed()

        replica = Replica("r0", "http://10.1.2.3:8001")
        options = WatchOptions(health_interval_s=0.01, fail_after=2)
        client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        async with anyio.create_task_group() as tg:
            tg.start_soon(replica.watch, client, options, FakeIndex, subscribe)
            while replica.state != "up":
                await anyio.sleep(0.01)
            assert subscribed == [("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558", "")]
            assert replica.block_size == 16 and replica.snapshot()["events"]["last_seq"] == 3
            health["code"] = None
            while replica.state != "out":
                await anyio.sleep(0.01)
            assert "/health: ConnectError" in replica.reason
            # taken out: its index emptied and its subscription dropped (no impostor that
            # binds the freed port feeds it)
            assert replica.index.cleared == 1 and replica._feed_scope is None
            health["code"] = 200
            while len(subscribed) < 2:
                await anyio.sleep(0.01)
            assert replica.state == "up" and subscribed[1] == subscribed[0]  # subscribed anew
            assert replica.index.cleared == 2
            tg.cancel_scope.cancel()

    run(test)


@pytest.mark.parametrize(("endpoint", "url", "want"), [
    ("tcp://*:5557", "http://h:1", "tcp://h:5557"),
    ("tcp://0.0.0.0:5557", "http://[::1]:1", "tcp://[::1]:5557"),
    ("tcp://10.0.0.2:5557", "http://h:1", "tcp://10.0.0.2:5557"),
])  # fmt: skip
def test_events_endpoint_reaches_a_wildcard_at_the_replicas_host(endpoint, url, want):
    assert events_endpoint(endpoint, url) == want


def test_fleet_figures_are_what_the_load_generator_reports_of_a_router():
    from wavepp.route.prom import fleet_figures

    async def test():
        fleet = Fleet()
        tokens = list(range(1, 11))
        fleet.replicas[0].index.held.update(block_hashes(tokens, BLOCK))

        async def cached(name, request, body):
            n = len(body["tokens"])
            return httpx.Response(200, json={"id": body["id"], "status": "done",
                                             "num_tokens": n, "cached_tokens": 8 if n > 8 else 0})

        fleet.behave["r0"] = cached
        async with client_of(fleet.router()) as client:
            before = parse_exposition((await client.get("/metrics")).text)
            await client.post("/v1/prefill", json={"tokens": tokens})
            await client.post("/v1/prefill", json={"tokens": [50, 51, 52]})
            after = parse_exposition((await client.get("/metrics")).text)
        figures = fleet_figures(before, after)
        assert figures["prompt_tokens"] == 13 and figures["cached_tokens"] == 8
        assert figures["predicted_cached_tokens"] == 8 and figures["predicted_exact"] == 2
        assert figures["replicas"]["r0"]["requests"] == 2  # the cold one too: ties go to r0
        assert figures["reused_share"] == 8 / 13 and figures["retries"] == 0
        assert fleet_figures({}, {"wavepp_prompt_tokens_total": 5.0}) is None  # one server

    run(test)


def _met(verdicts: dict[str, bool]):
    """A replica's answer, with the engine's verdict when the request had a deadline."""

    async def answer(name, request, body):
        result = {"id": body["id"], "status": "done", "num_tokens": 3, "cached_tokens": 0}
        if "deadline_s" in body:
            result |= {"deadline_s": body["deadline_s"], "deadline_met": verdicts[name]}
        return httpx.Response(200, json=result)

    return answer


async def _draining_after(seconds: float, name, request, body) -> httpx.Response:
    await anyio.sleep(seconds)
    return httpx.Response(503, json={"error": {"message": "the server is draining",
                                               "type": "draining", "code": 503}})


def test_a_policy_sees_the_requests_priority_and_what_is_left_of_its_deadline():
    async def test():
        fleet = Fleet()
        asked: list[RouteRequest] = []

        def policy(request: RouteRequest, replicas) -> int:
            asked.append(request)
            return 0

        client = httpx.AsyncClient(transport=httpx.MockTransport(fleet.handler))
        router = Router(fleet.replicas, policy, "tests:policy", client)
        async with client_of(router) as client:
            await client.post("/v1/prefill", json={"tokens": [1, 2], "priority": 5,
                                                   "deadline_s": 30})
            await client.post("/v1/completions", json={"prompt": [1, 2], "priority": -3})
            # not a deadline the server takes: no deadline for the policy, sent untouched
            await client.post("/v1/prefill", json={"tokens": [1, 2], "deadline_s": -1})
        assert [(r.priority, r.num_tokens) for r in asked] == [(5, 2), (-3, 2), (0, 2)]
        assert 0 < asked[0].deadline_s <= 30 and asked[1].deadline_s is None
        assert asked[2].deadline_s is None and fleet.seen[2][2]["deadline_s"] == -1
        # the replica is given no more than the policy saw left
        assert 0 < fleet.seen[0][2]["deadline_s"] <= asked[0].deadline_s

    run(test)


def test_a_retry_carries_the_deadline_less_the_time_spent_on_the_failed_replica():
    async def test():
        fleet = Fleet()
        fleet.behave["r0"] = functools.partial(_draining_after, 0.3)
        async with client_of(fleet.router("round-robin")) as client:
            reply = await client.post("/v1/prefill", json={"tokens": [1, 2, 3], "id": "d",
                                                           "deadline_s": 30})
        assert reply.status_code == 200 and reply.headers["x-wavepp-replica"] == "r1"
        (_, _, first), (_, _, retry) = fleet.seen
        assert first["deadline_s"] <= 30  # less the router's own time before the send
        assert 0 < retry["deadline_s"] <= first["deadline_s"] - 0.3

    run(test)


def test_past_its_deadline_a_request_is_not_sent_again_and_the_client_gets_a_504():
    async def test():
        fleet = Fleet()

        async def draining_past_the_deadline(name, request, body):
            return await _draining_after(body["deadline_s"] + 0.01, name, request, body)

        fleet.behave["r0"] = draining_past_the_deadline
        async with client_of(fleet.router("round-robin")) as client:
            reply = await client.post("/v1/prefill", json={"tokens": [1, 2, 3], "id": "late",
                                                           "deadline_s": 2})
            metrics = parse_exposition((await client.get("/metrics")).text)
            health = (await client.get("/health")).json()
        assert reply.status_code == 504
        error = reply.json()["error"]
        assert error["type"] == "deadline_exceeded" and error["code"] == 504
        assert "deadline_s 2 " in error["message"] and "r0 (http://r0.test)" in error["message"]
        assert [name for name, _, _ in fleet.seen] == ["r0"]  # r1 never got work it could not meet
        assert sample(metrics, "wavepp_route_deadlines_expired_total") == 1
        assert sample(metrics, "wavepp_route_refused_total", code="504") == 1
        assert sample(metrics, "wavepp_route_slo_attainment") == 0
        assert health["deadlines"] == {"answered": 0, "met": 0, "expired": 1,
                                       "slo_attainment": 0.0}

    run(test)


def test_metrics_count_the_deadlines_each_replica_met_and_the_fleets_attainment():
    from wavepp.route.prom import fleet_figures

    async def test():
        fleet = Fleet()
        verdicts = {"r0": True, "r1": False}
        fleet.behave = {name: _met(verdicts) for name in verdicts}
        async with client_of(fleet.router("round-robin")) as client:
            before = parse_exposition((await client.get("/metrics")).text)
            assert sample(before, "wavepp_route_slo_attainment") is None  # no deadline yet
            for _ in range(3):  # r0, r1, r0
                await client.post("/v1/prefill", json={"tokens": [1, 2, 3], "deadline_s": 9})
            await client.post("/v1/prefill", json={"tokens": [1, 2, 3]})  # none: not counted
            after = parse_exposition((await client.get("/metrics")).text)
            health = (await client.get("/health")).json()
        for replica, timed, met in (("r0", 2, 2), ("r1", 1, 0)):
            labels = {"replica": replica, "policy": "round-robin"}
            assert sample(after, "wavepp_route_with_deadline_total", **labels) == timed
            assert sample(after, "wavepp_route_deadlines_met_total", **labels) == met
        assert sample(after, "wavepp_route_slo_attainment") == 2 / 3
        assert health["deadlines"] == {"answered": 3, "met": 2, "expired": 0,
                                       "slo_attainment": 2 / 3}
        figures = fleet_figures(before, after)
        assert figures["with_deadline"] == 3 and figures["deadlines_met"] == 2
        assert figures["replicas"]["r1"]["deadlines_met"] == 0
        assert figures["slo_attainment"] == 2 / 3 and figures["deadlines_expired"] == 0

    run(test)


async def _trickle(stop: anyio.Event):
    yield b'{"tokens": [1, '
    await stop.wait()  # the rest never comes
    yield b"2]}"


def test_a_body_that_does_not_arrive_in_time_gets_a_json_408_and_reaches_no_replica():
    async def test():
        fleet = Fleet()
        app = build_app(fleet.router(), body_timeout_s=0.3)
        stop = anyio.Event()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            with anyio.fail_after(30):  # a hang guard, not a timing
                reply = await client.post("/v1/prefill", content=_trickle(stop))
            stop.set()
        assert reply.status_code == 408, reply.text
        assert "--body-timeout-s" in reply.json()["error"]["message"]
        assert fleet.seen == []

    run(test)


def test_a_drain_answers_a_half_sent_body_with_a_json_503():
    async def test():
        fleet = Fleet()
        router = fleet.router()
        app = build_app(router, body_timeout_s=60)
        stop = anyio.Event()
        transport = httpx.ASGITransport(app=app)
        replies = []
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:

            async def send():
                replies.append(await client.post("/v1/prefill", content=_trickle(stop)))

            with anyio.fail_after(30):  # a hang guard
                async with anyio.create_task_group() as tg:
                    tg.start_soon(send)
                    while not app.state.bodies.reading:
                        await anyio.sleep(0.01)
                    router.draining = True  # what the drain does first
                    app.state.bodies.close()
                late = await client.post("/v1/prefill", json={"tokens": [1]})
            stop.set()
        (reply,) = replies
        assert reply.status_code == 503, reply.text
        assert reply.json()["error"]["type"] == "unavailable"
        assert "shutting down" in reply.json()["error"]["message"]
        assert late.status_code == 503 and "draining" in late.json()["error"]["message"]
        assert fleet.seen == []

    run(test)
