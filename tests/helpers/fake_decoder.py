"""A fake decoder: a small Starlette app answering as a vLLM server with WavePP's
connector would (``/health``, ``/v1/completions``, ``/v1/chat/completions``). It records
every request (body and headers), checks what came in ``kv_transfer_params``, may pull
the prompt's bands from the stages it names (``tests/helpers/puller.py``), and answers
the tokens ``TOKENS`` — streamed as server-sent events ending in ``[DONE]``, or whole."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable

import anyio
import anyio.to_thread
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.helpers.puller import Pulled, pull
from wavepp.handoff.wire import Fingerprint

TOKENS = [11, 12, 13, 14]


class FakeDecoder:
    """``pull_with``: pull every stage's band with this fingerprint before answering.
    ``usage_details``: put ``prompt_tokens_details.cached_tokens`` in a whole answer's
    usage (vLLM does when asked; the router fills it in otherwise). ``status``: answer
    this HTTP status instead (an error)."""

    def __init__(self, pull_with: Fingerprint | None = None, usage_details: bool = True) -> None:
        self.pull_with = pull_with
        self.usage_details = usage_details
        self.status = 200
        self.healthy = True
        self.seen: list[tuple[str, dict, dict]] = []  # (path, body, headers)
        self.pulled: dict[str, list[Pulled]] = {}  # WavePP request id -> its bands
        self.app = Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/completions", self.generate, methods=["POST"]),
            Route("/v1/chat/completions", self.generate, methods=["POST"]),
        ])  # fmt: skip

    async def health(self, request: Request) -> Response:
        return Response(status_code=200 if self.healthy else 503)

    async def generate(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self.seen.append((request.url.path, body, dict(request.headers)))
        if self.status != 200:
            return JSONResponse({"error": {"message": "the decoder broke", "type": "x"}},
                                status_code=self.status)  # fmt: skip
        params = body.get("kv_transfer_params") or {}
        cached = params.get("remote_prefill_cached_tokens", 0)
        wavepp = params.get("wavepp")
        if self.pull_with is not None and wavepp:
            rid = wavepp["request_id"]
            self.pulled[rid] = [
                await anyio.to_thread.run_sync(pull, address, rid, s, self.pull_with)
                for s, address in enumerate(wavepp["stages"])]  # fmt: skip
        chat = request.url.path.endswith("/chat/completions")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{request.headers.get('x-request-id')}"
        usage = {"prompt_tokens": len(params.get("prompt_token_ids") or ()) or 5,
                 "completion_tokens": len(TOKENS), "total_tokens": 0}  # fmt: skip
        if self.usage_details:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        if body.get("stream"):
            return StreamingResponse(self._events(rid, chat, usage),
                                     media_type="text/event-stream")  # fmt: skip
        text = "".join(f"<{t}>" for t in TOKENS)
        choice = ({"message": {"role": "assistant", "content": text}} if chat
                  else {"text": text})  # fmt: skip
        return JSONResponse({"id": rid, "choices": [{"index": 0, **choice,
                                                     "finish_reason": "length"}],
                             "usage": usage})  # fmt: skip

    async def _events(self, rid: str, chat: bool, usage: dict):
        for token in TOKENS:
            part = {"delta": {"content": f"<{token}>"}} if chat else {"text": f"<{token}>"}
            yield f"data: {json.dumps({'id': rid, 'choices': [{'index': 0, **part}]})}\n\n"
            await anyio.sleep(0)
        yield f"data: {json.dumps({'id': rid, 'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"


class Served:
    """``with Served(app) as url:`` — the app under uvicorn on a free port of 127.0.0.1,
    in a thread."""

    def __init__(self, app: Callable) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0,
                                                    log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        while not self.server.started:
            self.thread.join(0.05)
            assert self.thread.is_alive(), "the fake decoder did not start"
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
