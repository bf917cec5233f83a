"""The router's HTTP side: the Starlette app, and running it under uvicorn until SIGTERM.

Routes: ``POST /v1/prefill``, ``POST /v1/completions`` and ``POST /v1/chat/completions``
(forwarded, see :mod:`wavepp.route.router`; with decoders, completions and chats are
prefilled on a replica and decoded on a decoder, :mod:`wavepp.route.pd`),
``DELETE /v1/requests/{id}`` (to the replica the request is at), ``GET /health`` (200
while at least one replica is up; every replica's state — and decoder's —, the deadlines
met so far), ``GET /metrics`` (``wavepp_route_*``) and ``GET /v1/models`` (a replica's,
with the fleet's size: what ``wavepp.bench.load`` reads). A client that disconnects while its
request waits closes the router's connection to the replica, which cancels the request
there. A body must arrive within ``body_timeout_s`` (408 after it). SIGTERM drains: new
requests get 503, bodies still arriving a JSON 503, the ones in flight get
``drain_timeout_s``.
"""

from __future__ import annotations

import copy
import logging
import os
import time

import anyio
import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from wavepp.route.body import peek
from wavepp.route.pd import Disaggregated
from wavepp.route.replicas import MakeIndex, Subscribe, WatchOptions, log
from wavepp.route.router import Router
from wavepp.serve.api import ApiError
from wavepp.serve.app import DEFAULT_MAX_BODY_BYTES, RETRY_AFTER_S, read_body
from wavepp.serve.prom import CONTENT_TYPE
from wavepp.serve.server import SignalFreeUvicorn, bind, h11_with_header_timeout

logger = logging.getLogger("wavepp.route")

DRAIN_POLL_S = 0.05
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0  # a request's whole body, as the server's --body-timeout-s


class Bodies:
    """Request bodies being read: each within ``timeout_s``; a drain cuts them off."""

    def __init__(self, limit: int, timeout_s: float) -> None:
        self.limit, self.timeout_s = limit, timeout_s
        self.reading: set[anyio.CancelScope] = set()
        self.closing = False

    async def read(self, request: Request) -> bytes:
        with anyio.CancelScope(deadline=anyio.current_time() + self.timeout_s) as scope:
            self.reading.add(scope)
            try:
                return await read_body(request, self.limit)
            finally:
                self.reading.discard(scope)
        if self.closing:
            raise ApiError(503, "the router is shutting down; the body came too slowly",
                           "unavailable")  # fmt: skip
        raise ApiError(408, f"the request body did not arrive within {self.timeout_s:g} s "
                       "(--body-timeout-s)")  # fmt: skip

    def close(self) -> None:
        self.closing = True
        for scope in list(self.reading):
            scope.cancel()


def _error(error: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if error.status == 503 else {}
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def build_app(router: Router, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              pd: Disaggregated | None = None,
              body_timeout_s: float = BODY_TIMEOUT_S) -> Starlette:  # fmt: skip
    """``pd``: the decoders' path for completions and chats (``--decoder``), if any."""
    metrics = router.metrics
    bodies = Bodies(max_body_bytes, body_timeout_s)

    async def forward(request: Request, route: str) -> Response:
        try:
            if router.draining:
                raise ApiError(503, "the router is draining and takes no new requests",
                               "unavailable")  # fmt: skip
            raw = await bodies.read(request)
            arrived = time.monotonic()  # a deadline counts from here (docs/fleet.md)
            answer: Response | None = None
            disaggregated = pd is not None and route != "/v1/prefill"

            async def watch_disconnect() -> None:
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                tg.cancel_scope.cancel()  # closes the replica's connection: it cancels

            async with anyio.create_task_group() as tg:
                tg.start_soon(watch_disconnect)
                try:
                    if disaggregated:
                        answer = await pd.forward(route, raw, request.headers, arrived)
                    else:
                        answer = await router.forward(route, peek(route, raw), arrived)
                except ApiError as error:  # raised here, not out of the task group
                    answer = refuse(error)
                tg.cancel_scope.cancel()
            return answer if answer is not None else Response(status_code=499)
        except ApiError as error:
            return refuse(error)

    def refuse(error: ApiError) -> Response:
        metrics.refused_with(error.status)
        return _error(error)

    async def prefill(request: Request) -> Response:
        return await forward(request, "/v1/prefill")

    async def completions(request: Request) -> Response:
        return await forward(request, "/v1/completions")

    async def chat_completions(request: Request) -> Response:
        return await forward(request, "/v1/chat/completions")

    async def cancel(request: Request) -> Response:
        try:
            code, raw = await router.cancel(request.path_params["request_id"])
        except ApiError as error:
            return _error(error)
        return Response(raw, status_code=code, media_type="application/json")

    async def health(request: Request) -> Response:
        replicas = [r.snapshot() for r in router.replicas]
        up = sum(1 for r in router.replicas if r.routable)
        status = "draining" if router.draining else "ok" if up else "unavailable"
        body = {"status": status, "policy": router.policy_name, "replicas_up": up,
                "replicas": replicas, "deadlines": metrics.attainment.snapshot()}  # fmt: skip
        if pd is not None:
            body["decoders"] = [d.snapshot() for d in pd.decoders]
        return JSONResponse(body, status_code=200 if up and not router.draining else 503)

    async def prometheus(request: Request) -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    async def models(request: Request) -> Response:
        known = [r for r in router.replicas if r.model_body is not None]
        if not known:
            return _error(ApiError(503, "no replica has answered /v1/models yet", "unavailable"))
        body = copy.deepcopy(known[0].model_body)
        up = sum(1 for r in router.replicas if r.routable)
        for model in body.get("data", []):
            if isinstance(model, dict) and isinstance(model.get("wavepp"), dict):
                model["wavepp"]["fleet"] = {"replicas": len(router.replicas), "replicas_up": up,
                                            "policy": router.policy_name}  # fmt: skip
        return JSONResponse(body)

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        message = "no such route" if status == 404 else "method not allowed on this route"
        return _error(ApiError(status, f"{message}: {request.method} {request.url.path}"))

    routes = [
        Route("/v1/prefill", prefill, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/requests/{request_id:str}", cancel, methods=["DELETE"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})
    app.state.router = router
    app.state.bodies = bodies
    return app


async def run_router(
    router: Router,
    host: str,
    port: int,
    *,
    watch: WatchOptions,
    make_index: MakeIndex | None,
    subscribe: Subscribe | None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    drain_timeout_s: float = 25.0,
    body_timeout_s: float = BODY_TIMEOUT_S,
    log_level: str = "warning",
    stop: anyio.Event | None = None,
    pd: Disaggregated | None = None,
) -> None:
    """Watch the replicas (and decoders) and serve until ``stop`` is set (SIGTERM sets
    it); then drain."""
    sock = bind(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    app = build_app(router, max_body_bytes, pd, body_timeout_s)
    config = uvicorn.Config(
        app, lifespan="off",
        http=h11_with_header_timeout(HEADER_TIMEOUT_S), ws="none", log_level=log_level,
        access_log=False, timeout_graceful_shutdown=2.0, server_header=False,
    )  # fmt: skip
    server = SignalFreeUvicorn(config)
    stop = stop or anyio.Event()

    async def drain() -> None:
        await stop.wait()
        router.draining = True
        app.state.bodies.close()  # a half-sent body gets a JSON 503, not a cut connection
        log(f"draining: new requests get 503; {len(router.in_flight)} in flight get up to "
            f"{drain_timeout_s:g} s")  # fmt: skip
        with anyio.move_on_after(drain_timeout_s):
            while router.in_flight:
                await anyio.sleep(DRAIN_POLL_S)
        server.should_exit = True

    async def announce() -> None:
        while not server.started:
            await anyio.sleep(0.05)
        decoders = "" if pd is None else ", decoders " + " ".join(
            f"{d.name}={d.url}" for d in pd.decoders)  # fmt: skip
        log(f"listening on http://{bound_host}:{bound_port} (pid {os.getpid()}), policy "
            f"{router.policy_name}, replicas " + " ".join(
                f"{r.name}={r.url}" for r in router.replicas) + decoders)  # fmt: skip

    try:
        async with anyio.create_task_group() as tg:
            for replica in router.replicas:
                tg.start_soon(replica.watch, router.client, watch, make_index, subscribe)
            for decoder in pd.decoders if pd is not None else ():
                tg.start_soon(decoder.watch, router.client, watch)
            tg.start_soon(drain)
            tg.start_soon(announce)
            await server.serve(sockets=[sock])
            tg.cancel_scope.cancel()
    finally:
        sock.close()
    log("stopped")


def http_client(max_connections: int = 1024) -> httpx.AsyncClient:
    """The router's client to the replicas: no overall timeout (a prefill takes what it
    takes; a silent replica is caught by its watcher), a bounded connect."""
    limits = httpx.Limits(max_connections=max_connections,
                          max_keepalive_connections=max_connections)  # fmt: skip
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None, connect=5.0))
