"""Completions that decode (``--decode``): the prompt prefilled on the pipeline, its cache
handed to the decoder, its tokens answered whole or streamed.

A completion that decodes is in flight from its submission to its last byte
(:class:`Decoding`), so a drain waits for it and, at its timeout, cuts it with a JSON 503
(a stream: an error event, then ``[DONE]``). A client that leaves stops its decode: the
connection to the worker closes, and the worker takes the request out wherever it is.
The decode request names the run (its bands' sender) and is signed with the shared
secret when there is one. What a client hears of a failed handoff is coarse
(``wavepp.serve.allow.client_handoff``); the log has the rest.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from wavepp.handoff.client import DecodeError, decode
from wavepp.serve.allow import client_handoff
from wavepp.serve.api import ApiError, completion_body, stream_event, wanted_tokens
from wavepp.serve.protocol import ServedResult

logger = logging.getLogger("wavepp.serve")


class Decoding:
    """A completion that decodes (``--decode``): in flight from its submission to its
    last byte, so a drain waits for it; ``stop`` ends its decode with the reason."""

    def __init__(self) -> None:
        self.started = False  # its prefill is done: it decodes
        self.cut: str | None = None  # why the server stopped it
        self.scope: anyio.CancelScope | None = None  # what it awaits now

    def stop(self, reason: str) -> None:
        self.cut = reason
        if self.scope is not None:
            self.scope.cancel()


class DecodeStream(StreamingResponse):
    """A decoded completion's event stream; ``on_close`` runs however it ends (sent,
    the client gone, never started)."""

    def __init__(self, content, on_close: Callable[[], None], **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class DecodeLeg:
    """The completions decoding on ``options.decode``'s decoder: the set in flight (for
    the drain), how each is answered, and ``wavepp_decodes_in_flight``. ``run_id``: the
    run whose bands the decoder holds; ``on_settled``: called when one leaves;
    ``on_disconnect``: a client left while its completion decoded."""

    def __init__(self, options: Any, run_id: str, on_settled: Callable[[], None],
                 on_disconnect: Callable[[], None]) -> None:  # fmt: skip
        self.options = options
        self.run_id = run_id
        self.on_settled, self.on_disconnect = on_settled, on_disconnect
        self.in_flight: set[Decoding] = set()  # completions that decode, to their last byte

    def start(self) -> Decoding:
        """A completion that will decode: in flight from now to its last byte."""
        slot = Decoding()
        self.in_flight.add(slot)
        return slot

    def out(self, slot: Decoding) -> None:
        self.in_flight.discard(slot)
        self.on_settled()

    def cut(self, reason: str) -> int:
        """Stop every completion still decoding (the drain ran out of time): each answers
        a JSON 503 with ``reason`` (a stream: an error event, then ``[DONE]``)."""
        for slot in self.in_flight:
            slot.stop(reason)
        return len(self.in_flight)

    def decoding_now(self) -> int:
        """Completions past their prefill, decoding."""
        return sum(1 for slot in self.in_flight if slot.started)

    def collect(self):
        """Prometheus: ``wavepp_decodes_in_flight``."""
        from prometheus_client.core import GaugeMetricFamily

        yield GaugeMetricFamily("wavepp_decodes_in_flight", "completions decoding now "
                                "(--decode): their prefill is done, their tokens not all sent",
                                value=float(self.decoding_now()))  # fmt: skip

    async def answer(self, request: Request, result: ServedResult, body,
                       answer_id: str | None, chat: bool,
                       slot: Decoding) -> tuple[dict, int] | Response:  # fmt: skip
        """The prompt was prefilled and its cache handed to the decoder: its tokens. A
        client that leaves stops its decode (the worker's connection closes)."""
        handoff = result.handoff or {}
        if handoff.get("status") != "done":
            log_failed_handoff(result)
            raise ApiError(502, "the prompt's cache did not reach the decoder: "
                           f"{client_handoff(handoff)['error']}", "decoder_error")
        stream = decode(self.options.decode, result.request_id, wanted_tokens(body),
                        self.options.decode_timeout_s, sender=self.run_id,
                        secret=self.options.secret)  # fmt: skip
        shape = {"answer_id": answer_id, "chat": chat}
        slot.started = True
        if body.stream:
            return DecodeStream(self._events(result, body, stream, shape, slot),
                                on_close=lambda: self.out(slot),
                                 media_type="text/event-stream")  # fmt: skip
        token_ids: list[int] = []
        failure: DecodeError | None = None
        gone = False

        async def watch_disconnect(scope: anyio.CancelScope) -> None:
            nonlocal gone
            while (await request.receive())["type"] != "http.disconnect":
                pass
            gone = True
            scope.cancel()

        with anyio.CancelScope() as scope:
            slot.scope = scope
            if slot.cut:
                scope.cancel()
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch_disconnect, scope)
                try:
                    async for chunk in stream:
                        token_ids += chunk
                except DecodeError as error:
                    failure = error
                finally:
                    await stream.aclose()  # the worker's connection closes: it stops
                tg.cancel_scope.cancel()
        slot.scope = None
        if gone:
            self.on_disconnect()
            raise ApiError(499, "the client disconnected while its completion decoded")
        if slot.cut:
            raise ApiError(503, slot.cut, "unavailable")
        if failure is not None:
            raise ApiError(502, str(failure), "decoder_error")
        return completion_body(result, body, self.options.detokenize, self.options.simulated,
                               token_ids, **shape), 200  # fmt: skip

    async def _events(self, result: ServedResult, body, stream, shape: dict,
                      slot: Decoding) -> AsyncIterator[str]:  # fmt: skip
        """Server-sent events as OpenAI clients read them: a chunk per batch of tokens,
        the last with its finish reason and the usage, then ``[DONE]``; a decoder's
        failure, or the drain's end, is an error event, then ``[DONE]``."""
        token_ids: list[int] = []
        detokenize, simulated = self.options.detokenize, self.options.simulated
        try:
            while not slot.cut:
                failure = chunk = None
                with anyio.CancelScope() as scope:  # the drain's cut (never across a yield)
                    slot.scope = scope
                    try:
                        chunk = await stream.__anext__()
                    except StopAsyncIteration:
                        pass
                    except DecodeError as error:
                        failure = ApiError(502, str(error), "decoder_error")
                slot.scope = None
                if slot.cut:
                    break
                if failure is not None:
                    yield f"data: {json.dumps(failure.body())}\n\ndata: [DONE]\n\n"
                    return
                if chunk is None:
                    break
                token_ids += chunk
                event = stream_event(completion_body(result, body, detokenize, simulated,
                                                     chunk, **shape))  # fmt: skip
                yield f"data: {json.dumps(event)}\n\n"
        finally:
            slot.scope = None
            with anyio.CancelScope(shield=True):
                await stream.aclose()  # the worker's connection closes: it stops
        if slot.cut:
            cut = ApiError(503, slot.cut, "unavailable").body()
            yield f"data: {json.dumps(cut)}\n\ndata: [DONE]\n\n"
            return
        final = completion_body(result, body, detokenize, simulated, token_ids, **shape)
        choice = final["choices"][0]
        choice["token_ids"] = []
        if "message" in choice:
            choice["delta"] = {"role": "assistant", "content": ""}
            del choice["message"]
            final["object"] = "chat.completion.chunk"
        else:
            choice["text"] = ""
        yield f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n"


def log_failed_handoff(result: ServedResult) -> None:
    """A failed handoff's whole summary, for the operator (a client gets it coarse)."""
    summary = getattr(result, "handoff", None) or {}
    if summary.get("status") == "failed":
        logger.warning("handoff of %r to %s failed: %s", result.request_id,
                       summary.get("target"), summary.get("error"))  # fmt: skip
