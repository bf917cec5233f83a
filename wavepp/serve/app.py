"""The Starlette application over rank 0's engine.

Routes (all answers JSON except ``/metrics``; every refusal is a 4xx with
``{"error": {"message", "type", "code"}}`` and the server keeps serving):

- ``POST /v1/prefill``: ``{"tokens": [...]} | {"text": "..."}``, optional ``id`` and
  ``priority``; answers the result with its timings;
- ``POST /v1/completions`` and ``POST /v1/chat/completions``: the OpenAI shape with
  ``max_tokens`` ≤ 1 (more, and ``stream``, with ``--decode``); with
  ``kv_transfer_params.do_remote_decode`` (vLLM's P/D, ``wavepp.serve.pd``) the prompt's
  cache is held on the stages' band servers for a decoder to pull, and the answer
  carries the ``kv_transfer_params`` it pulls with;
- ``DELETE /v1/requests/{id}``: cancel a queued or running request;
- ``GET /health``, ``GET /metrics``, ``GET /v1/models``.

A request's id is the body's (``id``, ``request_id``), else the ``X-Request-Id`` header's
when it is a valid id not in use, else the engine's own; an OpenAI answer's ``id`` echoes
the header when there is one. A client that disconnects while its request waits cancels
it: the handler waits on the ASGI ``receive`` channel (which yields ``http.disconnect``
when the connection closes) next to the result, so nothing polls. Bodies are read up to
``max_body_bytes`` — ``Content-Length`` first, then the streamed size — before anything
is decoded — and within ``body_timeout_s`` (408 after it). A runtime fault (a rank dead
or hung) answers every request in flight and every new one with a JSON 503 naming the
cause.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import anyio
import attrs
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from wavepp.errors import RequestRejected
from wavepp.ids import id_problem
from wavepp.serve.allow import HandoffAllow
from wavepp.serve.api import (
    STATUS_CODE,
    ApiError,
    Submission,
    Tokenize,
    completion_body,
    parse_completion,
    parse_prefill,
    result_body,
)
from wavepp.serve.chat import ChatTemplate, parse_chat
from wavepp.serve.decoding import DecodeLeg, Decoding, log_failed_handoff
from wavepp.serve.pd import decoder_params
from wavepp.serve.prom import CONTENT_TYPE, ServerMetrics
from wavepp.serve.protocol import ServedEngine, ServedHandle, ServedResult

logger = logging.getLogger("wavepp.serve")

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
ROUTES = ("/v1/prefill", "/v1/completions", "/v1/chat/completions", "/health", "/metrics",
          "/v1/models")  # fmt: skip
NO_CHAT = "this server has no tokenizer, so no chat template (send token ids to /v1/completions)"
MAX_ECHOED_ID = 256  # characters of an X-Request-Id an answer's id echoes


@attrs.frozen
class ServeOptions:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # largest request body read, in bytes
    model_name: str = "wavepp"  # what /v1/models and completions call the model
    tokenize: Tokenize | None = None  # text -> token ids, when a tokenizer is loaded
    detokenize: Callable[[int], str] | None = None  # one token id -> its text
    max_in_flight: int = 0  # prefill requests awaiting their result at once (0: no limit)
    body_timeout_s: float = 30.0  # a request's whole body must arrive within this, seconds
    header_timeout_s: float = 10.0  # a request's headers must arrive within this, seconds
    drain_timeout_s: float = 25.0  # after SIGTERM, requests in flight get this long, seconds
    decode: str | None = None  # the decoder's address (--decode): max_tokens > 1, stream
    decode_timeout_s: float = 300.0  # a decode's whole stream, seconds
    decoder: Any = None  # the decoder's state (wavepp.serve.decode.Decoder): /health, /metrics
    simulated: bool = False  # the sim executor predicts the waves: every answer says so
    chat: ChatTemplate | None = None  # the model's chat template (/v1/chat/completions)
    no_chat: str = NO_CHAT  # without one: why, as the 400 says
    secret: bytes | None = attrs.field(default=None, repr=False)  # signs decode requests
    # where a /v1/prefill body may send its cache (--handoff-allow, the run's own targets)
    allow: HandoffAllow = attrs.field(factory=HandoffAllow)


RETRY_AFTER_S = 5  # what a 503 tells a client to wait before trying again


def _error(error: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if error.status == 503 else {}
    if error.status == 408:  # the rest of a slow body is not read: the connection closes
        headers["Connection"] = "close"
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to be over ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not (declared.isascii() and declared.isdigit()):
            raise ApiError(400, f"Content-Length {declared[:40]!r} is not a byte count")
        if len(declared) > 15 or int(declared) > limit:
            raise ApiError(
                413,
                f"request body of {declared[:20]} bytes is over the limit of "
                f"{limit:,} bytes (--max-body-bytes)",
            )
    parts, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(
                    413, f"request body is over the limit of {limit:,} bytes (--max-body-bytes)"
                )
            parts.append(chunk)
    except ClientDisconnect:
        raise ApiError(499, "the client disconnected while sending the body") from None
    return b"".join(parts)


BIG_BODY_BYTES = 256 * 1024


async def _off_loop_if_big(raw: bytes, parse, *args):
    """Decode (and tokenize) a big body in a worker thread, so rank 0's event loop —
    admission rounds, heartbeats, the other requests — is not held up by it."""
    if len(raw) < BIG_BODY_BYTES:
        return parse(*args)
    return await anyio.to_thread.run_sync(parse, *args)


def _rejection(error: RequestRejected) -> ApiError:
    """The engine refused a submission; its ``reason`` picks the status: 503 while
    draining (type ``draining``, what a router reads), 409 for an id in use, else 400."""
    if error.reason == "draining":
        return ApiError(503, f"the server is draining and takes no new requests ({error})",
                        "draining")  # fmt: skip
    return ApiError(409 if error.reason == "duplicate" else 400, str(error))


class Frontend:
    """The routes' state: the engine, the options and the server's own counters."""

    def __init__(self, engine: ServedEngine, options: ServeOptions) -> None:
        self.engine = engine
        self.options = options
        self.fault: str | None = None  # the runtime can no longer answer: why
        self.closing = False  # shutting down: bodies still arriving are not waited for
        self.in_flight = 0  # prefill requests submitted (or being submitted), not answered
        self.handles: dict[str, ServedHandle] = {}  # request id -> handle, of those submitted
        self._settled = anyio.Event()  # set (and replaced) each time ``handles`` empties
        self._reading: set[anyio.CancelScope] = set()  # handlers reading a body
        self._waiting: set[anyio.CancelScope] = set()  # handlers awaiting a result
        self.metrics = ServerMetrics(engine, lambda: self.in_flight, self.tables,
                                     simulated=options.simulated)  # fmt: skip
        self.decodes = DecodeLeg(options, engine.run_id, self._check_settled,
                                 self.metrics.disconnect_cancels.inc)  # fmt: skip
        if options.decoder is not None:
            self.metrics.registry.register(options.decoder)
        self.metrics.registry.register(self.decodes)

    # -- what the server does to every request in flight -----------------------------------

    def set_fault(self, reason: str) -> None:
        """The runtime failed: every handler answers 503 naming ``reason``, at once (a
        completion decoding too: the server is about to stop, and its decoder with it)."""
        if self.fault is None:
            self.fault = reason
            for scope in (*self._reading, *self._waiting):
                scope.cancel()
            self.decodes.cut(self._unavailable().message)

    def stop_reading(self) -> None:
        """Shutting down: bodies still arriving get 503 instead of being waited for."""
        self.closing = True
        for scope in self._reading:
            scope.cancel()

    def cancel_in_flight(self, reason: str) -> int:
        """Cancel every request in flight (the drain ran out of time); they answer
        ``cancelled`` with ``reason`` as their error. Returns how many."""
        return sum(1 for rid in list(self.handles) if self.engine.cancel(rid, reason=reason))

    async def settled(self) -> None:
        """Returns once no submitted request awaits its result and no completion decodes."""
        while self.handles or self.decodes.in_flight:
            await self._settled.wait()

    def _forget(self, request_id: str) -> None:
        self.handles.pop(request_id, None)
        self._check_settled()

    def _check_settled(self) -> None:
        if not self.handles and not self.decodes.in_flight:
            self._settled.set()
            self._settled = anyio.Event()

    def tables(self) -> dict[str, int]:
        """The server's own tables and their sizes (``wavepp_table_size``)."""
        return {"serve_handles": len(self.handles), "serve_body_reads": len(self._reading),
                "serve_result_waits": len(self._waiting),
                "serve_decodes": len(self.decodes.in_flight)}  # fmt: skip

    def _unavailable(self) -> ApiError:
        return ApiError(503, f"the server cannot answer: {self.fault}", "unavailable")

    async def read(self, request: Request) -> bytes:
        """The body within ``body_timeout_s``: 408 after it, 503 if the server stops first."""
        if self.fault:
            raise self._unavailable()
        with anyio.CancelScope(deadline=anyio.current_time() + self.options.body_timeout_s) \
                as scope:  # fmt: skip
            self._reading.add(scope)
            try:
                return await read_body(request, self.options.max_body_bytes)
            finally:
                self._reading.discard(scope)
        if self.fault:
            raise self._unavailable()
        if self.closing:
            raise ApiError(503, "the server is shutting down; the body came too slowly",
                           "unavailable")  # fmt: skip
        raise ApiError(408, f"the request body did not arrive within "
                       f"{self.options.body_timeout_s:g} s (--body-timeout-s)")  # fmt: skip

    # -- helpers -------------------------------------------------------------------------

    async def _run(self, request: Request, submission: Submission) -> ServedResult:
        """Submit, await the answer (cancelling on a disconnect), return it."""
        if self.fault:
            raise self._unavailable()
        limit = self.options.max_in_flight
        if limit and self.in_flight >= limit:
            raise ApiError(
                429,
                f"the server is busy: {self.in_flight} requests in "
                f"flight (--max-in-flight {limit}); retry later",
                "busy",
            )
        self.in_flight += 1  # before the first await: the limit holds under races
        try:
            handle = await self._submit(request, submission)
            self.handles[handle.request_id] = handle
            try:
                return await self._outcome(request, handle)
            finally:
                self._forget(handle.request_id)
        finally:
            self.in_flight -= 1

    async def _submit(self, request: Request, submission: Submission) -> ServedHandle:
        """The engine's handle: under the body's id, else the X-Request-Id header's when it
        is a valid id not in use, else one the engine names."""
        header = request.headers.get("x-request-id")
        tries = [submission.request_id]
        if submission.request_id is None and header is not None and id_problem(header) is None:
            tries = [header, None]
        for i, request_id in enumerate(tries):
            try:
                return await self.engine.submit(
                    submission.tokens, request_id=request_id, priority=submission.priority,
                    handoff=submission.handoff, deadline_s=submission.deadline_s)  # fmt: skip
            except RequestRejected as error:
                if error.reason != "duplicate" or i + 1 == len(tries):
                    raise _rejection(error) from None
        raise AssertionError("unreachable")

    async def _outcome(self, request: Request, handle: ServedHandle) -> ServedResult:
        """The handle's answer (its result, or a held prefill's: ``Handle.answer``);
        cancels the request if the client goes away first."""
        result = None

        async def watch_disconnect() -> None:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    if self.engine.cancel(handle.request_id):
                        self.metrics.disconnect_cancels.inc()
                    return

        try:
            with anyio.CancelScope() as scope:  # cancelled by set_fault
                self._waiting.add(scope)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(watch_disconnect)
                    result = await handle.answer()
                    tg.cancel_scope.cancel()
        finally:
            self._waiting.discard(scope)
            if result is None:  # cancelled: the server shuts down or the runtime failed
                self.engine.cancel(handle.request_id)
        if result is None:
            raise self._unavailable()
        return result

    def _answer(self, route: str, body: dict, status: int) -> JSONResponse:
        self.metrics.http_answer(route, status)
        return JSONResponse(body, status_code=status)

    async def _guarded(self, route: str, request: Request, work) -> Response:
        try:
            answer = await work(request)
        except ApiError as error:
            self.metrics.http_answer(route, error.status)
            response = _error(error)
            if error.status == 503 and (self.fault or self.closing or self.engine.draining):
                response.headers["Connection"] = "close"  # going away: no kept-alive reuse
            return response
        if isinstance(answer, Response):  # a stream: its status is sent first
            self.metrics.http_answer(route, answer.status_code)
            return answer
        body, status = answer
        return self._answer(route, body, status)

    # -- routes --------------------------------------------------------------------------

    async def prefill(self, request: Request) -> Response:
        async def work(request: Request) -> tuple[dict, int]:
            raw = await self.read(request)
            submission = await _off_loop_if_big(
                raw, parse_prefill, raw, self.options.tokenize
            )
            refused = self.options.allow.problem(submission.handoff)
            if refused:
                raise ApiError(403, refused, "forbidden")
            result = await self._run(request, submission)
            log_failed_handoff(result)
            answer = result_body(result, self.options.simulated)
            self._add_pull(answer, result, submission)
            return answer, STATUS_CODE.get(result.status, 500)

        return await self._guarded("/v1/prefill", request, work)

    async def completions(self, request: Request) -> Response:
        return await self._openai(request, "/v1/completions")

    async def chat_completions(self, request: Request) -> Response:
        return await self._openai(request, "/v1/chat/completions")

    def _parse(self, route: str, raw: bytes):
        o, servers = self.options, self.engine.band_servers
        if route == "/v1/completions":
            return parse_completion(raw, o.tokenize, o.decode, servers)
        return parse_chat(raw, o.chat, o.no_chat, o.decode, servers)

    async def _openai(self, request: Request, route: str) -> Response:
        """A completion or a chat: prefilled (and held for a decoder, vLLM's P/D), or
        decoded by ``--decode``'s decoder."""
        chat = route != "/v1/completions"

        async def work(request: Request) -> tuple[dict, int] | Response:
            raw = await self.read(request)
            submission, body = await _off_loop_if_big(raw, self._parse, route, raw)
            if submission.handoff is None or submission.for_decoder:
                return await answer(request, submission, body)
            down = self.options.decoder.down if self.options.decoder is not None else None
            if down:
                raise ApiError(503, f"the decoder cannot serve completions now: {down}",
                               "unavailable")  # fmt: skip
            slot = self.decodes.start()  # in flight for the drain from here to its last byte
            streaming = False
            try:
                reply = await answer(request, submission, body, slot)
                streaming = isinstance(reply, Response)
                return reply
            finally:
                if not streaming:  # a stream's slot goes when its last event is sent
                    self.decodes.out(slot)

        async def answer(request: Request, submission: Submission, body,
                         slot: Decoding | None = None) -> tuple[dict, int] | Response:  # fmt: skip
            result = await self._run(request, submission)
            answer_id = _echoed(request.headers.get("x-request-id"))
            if slot is not None and result.status == "done":
                return await self.decodes.answer(request, result, body, answer_id, chat, slot)
            answer = completion_body(result, body, self.options.detokenize,
                                     self.options.simulated, answer_id=answer_id,
                                     chat=chat)  # fmt: skip
            self._add_pull(answer, result, submission)
            if result.status in ("rejected", "failed"):
                kind = "invalid_request_error" if result.status == "rejected" else "server_error"
                answer["error"] = {"message": result.error, "type": kind}
            return answer, STATUS_CODE.get(result.status, 500)

        return await self._guarded(route, request, work)

    def _add_pull(self, answer: dict, result: ServedResult, submission: Submission) -> None:
        """A prefill held for a decoder: the ``kv_transfer_params`` it pulls with (left out
        when its cache is not held: the decoder then computes the prompt itself), and
        the fields the prefill left to the decoder."""
        if not submission.for_decoder:
            return
        params = decoder_params(result, submission.tokens.tolist(), self.engine.band_servers)
        if params is not None:
            answer["kv_transfer_params"] = params
        if submission.ignored:
            answer.get("wavepp", answer)["ignored"] = list(submission.ignored)

    async def cancel(self, request: Request) -> Response:
        request_id = request.path_params["request_id"]

        async def work(request: Request) -> tuple[dict, int]:
            if not self.engine.cancel(request_id):
                raise ApiError(
                    404,
                    f"no queued or running request {request_id[:128]!r} (unknown, or already over)",
                    "not_found",
                )
            return {"id": request_id, "cancelled": True}, 200

        return await self._guarded("/v1/requests", request, work)

    async def health(self, request: Request) -> Response:
        ok, why = self.engine.health()
        draining = self.engine.draining
        down = self.options.decoder.down if self.options.decoder is not None else None
        if ok and not draining and not self.fault and not down:
            return self._answer("/health", {"status": "ok"}, 200)
        status = ("failed" if self.fault else "unhealthy" if not ok else "draining" if draining
                  else "degraded")  # fmt: skip
        body = {"status": status,
                "error": self.fault or (why or status if not ok else down or status)}  # fmt: skip
        self.metrics.http_answer("/health", 503)
        return _error_shaped(body, 503)

    async def prometheus(self, request: Request) -> Response:
        self.metrics.http_answer("/metrics", 200)
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE)

    async def models(self, request: Request) -> Response:
        info = {
            "vocab_size": self.engine.vocab_size,
            "tokenizer": self.options.tokenize is not None,
            "block_size": self.engine.block_size,
            "simulated": self.options.simulated,
        }
        if self.engine.kv_events is not None:  # where a router subscribes (docs/fleet.md)
            info["kv_events"] = self.engine.kv_events
        body = {
            "object": "list",
            "data": [
                {
                    "id": self.options.model_name,
                    "object": "model",
                    "owned_by": "wavepp",
                    "wavepp": info,
                }
            ],
        }
        return self._answer("/v1/models", body, 200)


def _echoed(header: str | None) -> str | None:
    """An X-Request-Id as an answer's id echoes it (a printable one of a sane length)."""
    if header is None or not header.isprintable() or len(header) > MAX_ECHOED_ID:
        return None
    return header


def _error_shaped(body: dict, status: int) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers={"Retry-After": str(RETRY_AFTER_S)})


def build_app(engine: ServedEngine, options: ServeOptions | None = None) -> Starlette:
    front = Frontend(engine, options or ServeOptions())

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        message = "no such route" if status == 404 else "method not allowed on this route"
        return _error(ApiError(status, f"{message}: {request.method} {request.url.path}"))

    async def crashed(request: Request, exc: Exception) -> Response:
        logger.exception("internal error on %s %s", request.method, request.url.path)
        route = request.url.path if request.url.path in ROUTES else "other"
        front.metrics.http_answer(route, 500)  # known routes only: labels stay few
        return _error(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error"))

    routes = [
        Route("/v1/prefill", front.prefill, methods=["POST"]),
        Route("/v1/completions", front.completions, methods=["POST"]),
        Route("/v1/chat/completions", front.chat_completions, methods=["POST"]),
        Route("/v1/requests/{request_id:str}", front.cancel, methods=["DELETE"]),
        Route("/health", front.health, methods=["GET"]),
        Route("/metrics", front.prometheus, methods=["GET"]),
        Route("/v1/models", front.models, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes, exception_handlers={404: not_found, 405: not_found, Exception: crashed}
    )
    app.state.front = front
    return app
