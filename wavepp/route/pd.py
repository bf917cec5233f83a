"""Prefill on a WavePP replica, decode on a vLLM decoder: the router as a P/D proxy
(``python -m wavepp.route --decoder URL``; ``docs/handoff.md``).

A completion or chat request from a client goes two legs under one request id (the
client's ``X-Request-Id`` when it is a valid id, else its body's ``request_id``, else one
the router names), sent as ``X-Request-Id`` on both:

1. **prefill**: to the WavePP replica the routing policy picks (prefix-aware, retried on
   another replica as any request is: :class:`~wavepp.route.router.Router`), in vLLM's
   proxy shape — ``kv_transfer_params: {"do_remote_decode": true, ...}``, ``stream:
   false``, ``max_tokens: 1`` (``max_completion_tokens: 1`` when present), without
   ``stream_options``, ``min_tokens`` or ``min_completion_tokens``;
2. **decode**: the client's own body, its ``kv_transfer_params`` replaced by the
   replica's answer's (when the replica held no cache, the body goes as it came and the
   decoder computes the prompt), to the decoder with the fewest requests in flight among
   those whose ``/health`` answers; its answer goes back to the client as it comes (a
   stream with its ``[DONE]``), a whole answer's ``usage`` given the prefill's cached
   tokens when the decoder left them out.

A leg that fails answers the client with the API's JSON error naming the leg
(``error.leg``: ``prefill`` or ``decode``). The client's ``Authorization`` header goes
on both legs.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping, Sequence

import anyio
import attrs
import httpx
import msgspec
from starlette.responses import JSONResponse, Response, StreamingResponse

from wavepp.ids import id_problem
from wavepp.route.body import new_request_id, peek
from wavepp.route.replicas import WatchOptions, log
from wavepp.route.router import Router, read_capped
from wavepp.serve.api import TOO_DEEP
from wavepp.serve.errors import ApiError

# what vLLM's toy proxy sends P (BRIEF §6): the keys a NIXL prefiller expects, unset
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
                  "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                  "remote_port": None}  # fmt: skip
DROPPED_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")
DECODER_STATES = ("starting", "up", "out")


class Decoder:
    """One decoder (a vLLM server): up while its ``/health`` answers 200."""

    def __init__(self, name: str, url: str) -> None:
        self.name = name
        self.url = url.rstrip("/")
        self.state = "starting"
        self.reason: str | None = None
        self.in_flight = 0
        self.failures = 0

    def snapshot(self) -> dict:
        return {"name": self.name, "url": self.url, "state": self.state, "reason": self.reason,
                "in_flight": self.in_flight}  # fmt: skip

    def take_out(self, reason: str) -> None:
        if self.state != "out":
            log(f"decoder {self.name} {self.url} out: {reason}")
        self.state, self.reason = "out", reason

    async def watch(self, client: httpx.AsyncClient, options: WatchOptions) -> None:
        """Probe ``/health`` now and every ``health_interval_s``: up on a 200, out after
        ``fail_after`` failures in a row."""
        while True:
            try:
                reply = await client.get(self.url + "/health", timeout=options.health_timeout_s)
                why = None if reply.status_code == 200 else f"/health answered {reply.status_code}"
            except httpx.HTTPError as error:
                why = f"/health: {type(error).__name__}: {error}".rstrip(": ")
            if why is None:
                if self.state != "up":
                    log(f"decoder {self.name} {self.url} up")
                self.state, self.reason, self.failures = "up", None, 0
            else:
                self.failures += 1
                if self.failures >= options.fail_after or self.state == "starting":
                    self.take_out(why)
            await anyio.sleep(options.health_interval_s)


def leg_error(leg: str, status: int, message: str, kind: str = "server_error") -> JSONResponse:
    """The API's JSON error, naming the leg that failed."""
    body = {"error": {"message": message, "type": kind, "code": status, "leg": leg}}
    return JSONResponse(body, status_code=status)


class Disaggregated:
    """The router's P/D path over its replicas (prefill) and ``decoders``."""

    def __init__(self, router: Router, decoders: Sequence[Decoder]) -> None:
        self.router = router
        self.decoders = list(decoders)
        self.metrics = router.metrics
        self.metrics.watch_decoders(self.decoders)

    def choose(self) -> Decoder | None:
        up = [d for d in self.decoders if d.state == "up"]
        return min(up, key=lambda d: d.in_flight) if up else None

    async def forward(self, route: str, raw: bytes, headers: Mapping[str, str],
                      arrived: float) -> Response:  # fmt: skip
        """One client request's two legs (``headers``: the client's)."""
        try:
            client_body = msgspec.json.decode(raw)
        except msgspec.DecodeError as error:
            raise ApiError(400, f"request body is not valid JSON: {error}") from None
        except RecursionError:
            raise ApiError(400, TOO_DEEP) from None
        if not isinstance(client_body, dict):
            raise ApiError(400, "request body must be a JSON object")
        rid = _request_id(headers, client_body)
        sent = {"x-request-id": rid}
        if "authorization" in headers:
            sent["authorization"] = headers["authorization"]
        prefill = self._prefill_body(client_body, rid)
        p = peek(route, msgspec.json.encode(prefill))
        answer = await self.router.forward(route, attrs.evolve(p, headers=sent), arrived)
        if answer.status_code >= 400:
            self.metrics.pd_leg("prefill", answer.status_code)
            return _prefill_failed(answer)
        try:
            params = json.loads(bytes(answer.body)).get("kv_transfer_params")
        except (ValueError, AttributeError):
            params = None
        self.metrics.pd_leg("prefill", answer.status_code, held=bool(params))
        decode_body = dict(client_body)
        if params:
            decode_body["kv_transfer_params"] = params
        return await self._decode(route, decode_body, sent, rid, params or {})

    @staticmethod
    def _prefill_body(body: dict, rid: str) -> dict:
        out = {k: v for k, v in body.items() if k not in DROPPED_FOR_PREFILL}
        out.update(kv_transfer_params=dict(PREFILL_PARAMS), stream=False, max_tokens=1,
                   request_id=rid)  # fmt: skip
        if "max_completion_tokens" in body:
            out["max_completion_tokens"] = 1
        return out

    async def _decode(self, route: str, body: dict, headers: dict, rid: str,
                      params: dict) -> Response:  # fmt: skip
        tried: list[str] = []
        self.router.in_flight[rid] = None  # a drain waits for the decode leg too
        handed_on = False
        try:
            while (decoder := self.choose()) is not None and decoder.name not in tried:
                tried.append(decoder.name)
                request = self.router.client.build_request(
                    "POST", decoder.url + route, content=msgspec.json.encode(body),
                    headers={"content-type": "application/json", **headers})  # fmt: skip
                decoder.in_flight += 1
                try:
                    upstream = await self.router.client.send(request, stream=True)
                except httpx.TransportError as error:
                    decoder.in_flight -= 1
                    decoder.take_out(f"cannot reach it: {type(error).__name__}")
                    continue
                if body.get("stream") is True and upstream.status_code == 200:
                    handed_on = True
                    return self._relay(decoder, upstream, rid)
                try:
                    raw = await read_capped(upstream, "a decoder")
                except ApiError as error:
                    return leg_error("decode", error.status, error.message)
                except httpx.TransportError as error:
                    self.metrics.pd_leg("decode", 502, decoder=decoder.name)
                    return leg_error("decode", 502, f"decoder {decoder.name} ({decoder.url}) "
                                     f"lost the connection: {type(error).__name__}")  # fmt: skip
                finally:
                    decoder.in_flight -= 1
                    await upstream.aclose()
                self.metrics.pd_leg("decode", upstream.status_code, decoder=decoder.name)
                if upstream.status_code >= 400:
                    return leg_error("decode", upstream.status_code,
                                     f"decoder {decoder.name} ({decoder.url}) answered "
                                     f"{upstream.status_code}: {_message(raw)}",
                                     _kind(raw))  # fmt: skip
                return Response(_with_cached_tokens(raw, params), status_code=200,
                                media_type=upstream.headers.get("content-type"))  # fmt: skip
            return leg_error("decode", 503, "no decoder is up: " + "; ".join(
                f"{d.name} {d.state}" + (f" ({d.reason})" if d.reason else "")
                for d in self.decoders), "unavailable")  # fmt: skip
        finally:
            if not handed_on:
                self.router.in_flight.pop(rid, None)

    def _relay(self, decoder: Decoder, upstream: httpx.Response, rid: str) -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            except httpx.TransportError as error:
                failure = {"error": {"message": f"decoder {decoder.name} ({decoder.url}) "
                                     f"lost the stream: {type(error).__name__}",
                                     "type": "server_error", "code": 502, "leg": "decode"}}
                yield b"data: " + msgspec.json.encode(failure) + b"\n\n"
            finally:
                with anyio.CancelScope(shield=True):
                    await upstream.aclose()
                decoder.in_flight -= 1
                self.router.in_flight.pop(rid, None)
                self.metrics.pd_leg("decode", upstream.status_code, decoder=decoder.name)

        return StreamingResponse(chunks(), status_code=200, media_type="text/event-stream",
                                 headers={"x-wavepp-decoder": decoder.name})  # fmt: skip


def _request_id(headers: Mapping[str, str], body: dict) -> str:
    for candidate in (headers.get("x-request-id"), body.get("request_id")):
        if isinstance(candidate, str) and id_problem(candidate) is None:
            return candidate
    return new_request_id()


def _message(raw: bytes) -> str:
    try:
        error = json.loads(raw)["error"]
        return str(error["message"] if isinstance(error, dict) else error)[:2000]
    except (ValueError, KeyError, TypeError):
        return raw[:500].decode(errors="replace")


def _kind(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"]["type"])
    except (ValueError, KeyError, TypeError):
        return "server_error"


def _prefill_failed(answer: Response) -> JSONResponse:
    raw = bytes(answer.body)
    replica = answer.headers.get("x-wavepp-replica", "no replica")
    return leg_error("prefill", answer.status_code, f"prefill at {replica} answered "
                     f"{answer.status_code}: {_message(raw)}", _kind(raw))  # fmt: skip


def _with_cached_tokens(raw: bytes, params: dict) -> bytes:
    """A whole answer whose ``usage`` lacks the cached tokens: the prefill's."""
    cached = params.get("remote_prefill_cached_tokens")
    if not isinstance(cached, int):
        return raw
    try:
        answer = json.loads(raw)
    except ValueError:
        return raw
    usage = answer.get("usage") if isinstance(answer, dict) else None
    if not isinstance(usage, dict) or (usage.get("prompt_tokens_details") or {}).get(
            "cached_tokens") is not None:  # fmt: skip
        return raw
    usage["prompt_tokens_details"] = {**(usage.get("prompt_tokens_details") or {}),
                                      "cached_tokens": cached}  # fmt: skip
    return json.dumps(answer).encode()
