"""Running the app with uvicorn on rank 0's event loop, and stopping it on a drain.

:func:`serve` is the client coroutine ``wavepp.main.run_ranks`` runs next to the
runtime. It binds the socket itself (so a bad address fails at once, with the reason,
and ``--port 0`` can report the port it got), runs uvicorn without its signal handlers
(the entry point owns SIGTERM: it calls ``engine.drain()``) and feeds the server's
metrics from ``engine.results()``.

A drain ends whatever clients do. From the moment the engine drains, ``/health`` and new
requests answer 503 (``Retry-After``); the requests in flight get ``drain_timeout_s`` to
answer — a completion that decodes (``--decode``) is in flight until its last byte
is sent — then the rest are cancelled (their result says why; a decoding completion
answers a JSON 503, a stream an error event then ``[DONE]``); bodies still arriving are
cut off; the listener closes and :func:`serve` returns. A client that sends its headers
slowly is dropped after ``header_timeout_s``, one whose body is slow gets 408 after
``body_timeout_s``. When the engine reports a fault (a rank dead or hung), every
request in flight and every new one answers a JSON 503 naming it, then the server stops.
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
from uvicorn.protocols.http.h11_impl import H11Protocol

from wavepp.serve.app import ServeOptions, build_app
from wavepp.serve.protocol import ServedEngine

logger = logging.getLogger("wavepp.serve")

SHUTDOWN_GRACE_S = 2.0  # after the drain, what uvicorn waits for handlers before cancelling


def h11_with_header_timeout(seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol that closes a connection whose request headers have not
    arrived ``seconds`` after it opened (or after its previous response): uvicorn itself
    times out only idle kept-alive connections, not ones trickling headers in."""

    class _H11(H11Protocol):
        _header_timer: Any = None

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(seconds, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _awaiting_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self._awaiting_headers() and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._awaiting_headers():
                self._arm()
            super().data_received(data)
            if not self._awaiting_headers():
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return _H11


class SignalFreeUvicorn(uvicorn.Server):
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
    engine: ServedEngine,
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
    app = build_app(engine, options)
    front = app.state.front
    options = front.options
    config = uvicorn.Config(
        app,
        lifespan="off",
        http=h11_with_header_timeout(options.header_timeout_s),
        ws="none",
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        server_header=False,
    )
    server = SignalFreeUvicorn(config)

    async def count_results() -> None:
        async for result in engine.results():
            front.metrics.observe(result)

    stopping = anyio.Event()  # the engine drains or has failed

    async def follow_drain() -> None:
        """SIGTERM's handler calls ``engine.drain()``."""
        await engine.until_draining()
        stopping.set()

    async def follow_fault() -> None:
        """A rank dead or hung (the watchdog's finding, handed to the engine's loop)."""
        await engine.until_fault()
        front.set_fault(engine.fault() or "")  # every handler answers 503 naming it, at once
        stopping.set()

    async def stop_when_draining() -> None:
        await stopping.wait()
        if not engine.fault():
            decoding = front.decodes.decoding_now()
            _log(f"draining: new requests get 503; {len(front.handles) + decoding} in flight "
                 f"({decoding} decoding) get up to {options.drain_timeout_s:g} s "
                 "(--drain-timeout-s)")  # fmt: skip
        with anyio.move_on_after(options.drain_timeout_s):
            await front.settled()  # a fault answers them all at once (follow_fault)
        if (front.handles or front.decodes.in_flight) and not engine.fault():
            reason = (f"cancelled: the server drained and its drain timeout "
                      f"({options.drain_timeout_s:g} s, --drain-timeout-s) ran out")  # fmt: skip
            count = front.cancel_in_flight(reason)
            cut = front.decodes.cut(reason)
            front.metrics.drain_cancels.inc(count + cut)
            _log(f"drain timeout: cancelled {count} requests and {cut} completions still in flight")
        with anyio.move_on_after(SHUTDOWN_GRACE_S):  # their answers go out
            await front.settled()
        front.stop_reading()
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
            tg.start_soon(follow_drain)
            tg.start_soon(follow_fault)
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
