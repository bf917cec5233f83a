"""Running the app with uvicorn on rank 0's event loop, and stopping it on a drain.

:func:`serve` is the client coroutine ``wavepp.main.run_ranks`` runs next to the
runtime. It binds the socket itself (so a bad address fails at once, with the reason,
and ``--port 0`` can report the port it got), runs uvicorn without its signal handlers
(the entry point owns SIGTERM: it calls ``engine.drain()``), feeds the server's metrics
from ``engine.results()``, and once the engine drains stops listening, lets the
requests in flight answer, and returns.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import uvicorn

from wavepp.serve.app import ServeOptions, _is_draining, build_app
from wavepp.serve.prom import ServerMetrics

logger = logging.getLogger("wavepp.serve")

DRAIN_POLL_S = 0.2


class _Uvicorn(uvicorn.Server):
    """uvicorn without its SIGINT/SIGTERM handlers: the entry point decides what a signal does."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free port)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # proto IPPROTO_TCP, not 0: asyncio then sets TCP_NODELAY on every accepted
        # connection; without it a response's header and body segments wait on the
        # client's delayed ACK (≈ 40 ms a request on a kept-alive connection).
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
    except OSError as error:
        raise SystemExit(f"wavepp serve: cannot listen on {host}:{port}: {error}") from None
    return sock


def _log(message: str) -> None:
    print(f"[wavepp serve] {message}", file=sys.stderr, flush=True)


async def serve(
    engine: Any,
    host: str = "127.0.0.1",
    port: int = 8000,
    options: ServeOptions | None = None,
    *,
    on_ready: Callable[[str, int], Awaitable[None] | None] | None = None,
    log_level: str = "warning",
) -> None:
    """Serve until the engine drains; then stop listening and return once the requests in
    flight have answered. ``on_ready(host, port)`` is called when connections are
    accepted."""
    sock = bind(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    metrics = ServerMetrics()
    app = build_app(engine, options, metrics)
    config = uvicorn.Config(
        app,
        lifespan="off",
        http="h11",
        ws="none",
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=None,
        server_header=False,
    )
    server = _Uvicorn(config)

    async def count_results() -> None:
        async for result in engine.results():
            metrics.observe(result)

    async def stop_when_draining() -> None:
        while not _is_draining(engine):
            await anyio.sleep(DRAIN_POLL_S)
        _log("draining: no new requests; stopping once the requests in flight answer")
        server.should_exit = True

    async def announce() -> None:
        with anyio.move_on_after(60):
            while not server.started:
                await anyio.sleep(0.05)
        if server.started:
            _log(f"listening on http://{bound_host}:{bound_port} (pid {os.getpid()})")
            if on_ready is not None:
                maybe = on_ready(bound_host, bound_port)
                if maybe is not None:
                    await maybe

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(count_results)
            tg.start_soon(stop_when_draining)
            tg.start_soon(announce)
            try:
                await server.serve(sockets=[sock])
            except SystemExit as error:  # uvicorn exits on a failed start-up
                raise RuntimeError(f"wavepp serve: uvicorn failed to start ({error})") from None
            tg.cancel_scope.cancel()
    finally:
        sock.close()
        engine.drain()  # however the server stopped, the run ends once the engine drains
    _log("stopped")
