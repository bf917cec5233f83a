"""The HTTP bodies: decoding untrusted JSON into a submission, and results into JSON.

Pure functions, no I/O, no torch. A body is decoded by ``msgspec`` into typed records
(so ``true`` is not a token id and a string is not a priority) and then checked against
the server's limits; every refusal is an :class:`ApiError` with the HTTP status and a
message that says what and why.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Annotated, Any

import attrs
import msgspec
import numpy as np

from wavepp.handoff.wire import PULL_TARGET
from wavepp.ids import MAX_ID_CHARS, id_problem
from wavepp.runtime.handoff import BandServers
from wavepp.serve.allow import client_handoff
from wavepp.serve.errors import ApiError as ApiError  # re-exported
from wavepp.serve.pd import KvTransferParams, check_shape, remote_decode
from wavepp.workload import MAX_DEADLINE_S

PRIORITY_RANGE = (-1000, 1000)

RequestIdText = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]
Priority = Annotated[int, msgspec.Meta(ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])]
Deadline = Annotated[float, msgspec.Meta(gt=0, le=MAX_DEADLINE_S)]
"""``deadline_s``: the result is due this many seconds after the server submitted the
request to the engine (the result's ``timings.submitted_at``)."""


class PrefillBody(msgspec.Struct):
    """``POST /v1/prefill``: exactly one of ``tokens`` and ``text``."""

    tokens: list[int] | None = None
    text: str | None = None
    id: RequestIdText | None = None
    priority: Priority = 0
    handoff: str | bool | None = None  # hand the cache on: an address, or true (the default)
    deadline_s: Deadline | None = None


class OpenAIBody(msgspec.Struct, kw_only=True):
    """What ``/v1/completions`` and ``/v1/chat/completions`` bodies share (OpenAI shape);
    unknown fields are ignored."""

    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # chat's name for it; a P/D proxy sets it to 1
    stream: bool = False
    n: int = 1
    priority: Priority = 0
    request_id: RequestIdText | None = None
    deadline_s: Deadline | None = None
    user: str | None = None
    seed: int | None = None  # nothing to seed: the first token is the greedy one
    stream_options: dict | None = None  # the decoder's (usage is always in the answer)
    # vLLM's P/D: do_remote_decode asks for the cache held for a decoder (wavepp.serve.pd)
    kv_transfer_params: KvTransferParams | None = None
    # What a prefill cannot do: refused when set to anything but the neutral value (with
    # kv_transfer_params.do_remote_decode: the decoder's to honour, listed as ignored).
    logprobs: Any = None
    temperature: Any = None
    top_p: Any = None
    stop: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    min_tokens: Any = None


class CompletionBody(OpenAIBody, kw_only=True):
    """``POST /v1/completions``."""

    prompt: str | list  # text, token ids, or a batch of one of either
    best_of: Any = None
    suffix: Any = None
    echo: Any = None


NEUTRAL = {"logprobs": (None,), "temperature": (None, 0, 0.0), "top_p": (None, 1, 1.0),
           "best_of": (None, 1), "stop": (None, [], ""), "suffix": (None, ""),
           "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
           "logit_bias": (None, {}), "echo": (None, False), "min_tokens": (None, 0, 1)}  # fmt: skip
"""Completion fields a prefill server does not do, and the values that ask nothing of it."""
# fields a prefill for a decoder leaves to it, besides those above, when they are set
DECODER_FIELDS = ("seed", "stream_options")


@attrs.frozen
class Submission:
    """What the server submits to the engine for one HTTP request."""

    tokens: np.ndarray  # int32 token ids, as sent (the engine's intake checks them)
    request_id: str | None  # the client's id, or None to let the engine name it
    priority: int  # class: higher is admitted first, FCFS inside a class
    handoff: str | bool | None = None  # where its cache goes (docs/handoff.md); None: nowhere
    deadline_s: float | None = None  # result due this many seconds after submission; None: none
    # OpenAI requests: the fields this prefill ignores as a decoder's to honour (vLLM's
    # P/D), said in the answer
    ignored: tuple[str, ...] = ()

    @property
    def for_decoder(self) -> bool:
        """Its cache is held on the band servers for a decoder to pull (vLLM's P/D)."""
        return self.handoff == PULL_TARGET


Tokenize = Callable[[str], list[int]]

TOO_DEEP = "request body is not valid JSON: nested too deeply"


def decode_body(raw: bytes, kind: type) -> Any:
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as error:
        raise ApiError(400, f"invalid request body: {error}") from None
    except msgspec.DecodeError as error:
        raise ApiError(400, f"request body is not valid JSON: {error}") from None
    except RecursionError:  # msgspec's own depth guard, for an untyped field's value
        raise ApiError(400, TOO_DEEP) from None


def check_id(request_id: str | None) -> str | None:
    problem = None if request_id is None else id_problem(request_id)
    if problem:
        raise ApiError(400, problem)
    return request_id


def token_array(tokens: list[int]) -> np.ndarray:
    """The body's ids as int32 (JSON allows any integer). Whether they are a prompt the
    model can run — not empty, inside its vocabulary, short enough — is the engine's
    intake's to say, once, for every caller (its RequestRejected says which kind)."""
    try:
        ids = np.asarray(tokens, dtype=np.int64)
    except OverflowError:
        raise ApiError(400, "token ids must be 32-bit integers") from None
    if ids.size and (ids.min() < -(2**31) or ids.max() >= 2**31):
        raise ApiError(400, "token ids must be 32-bit integers")
    return ids.astype(np.int32)


def _text_tokens(text: str, tokenize: Tokenize | None) -> list[int]:
    if tokenize is None:
        raise ApiError(
            400,
            "this server has no tokenizer (no tokenizer.json in the checkpoint directory); "
            "send token ids",
        )
    if not text:
        raise ApiError(400, "empty prompt: the text is empty")
    return tokenize(text)


def parse_prefill(raw: bytes, tokenize: Tokenize | None) -> Submission:
    body: PrefillBody = decode_body(raw, PrefillBody)
    if (body.tokens is None) == (body.text is None):
        raise ApiError(400, 'send exactly one of "tokens" (a list of token ids) and "text"')
    tokens = body.tokens if body.tokens is not None else _text_tokens(body.text, tokenize)
    if body.handoff is False:
        body.handoff = None
    return Submission(token_array(tokens), check_id(body.id), body.priority,
                      body.handoff, body.deadline_s)  # fmt: skip


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _prompt_tokens(prompt: str | list, tokenize: Tokenize | None) -> list[int]:
    if isinstance(prompt, str):
        return _text_tokens(prompt, tokenize)
    if _is_ids(prompt):
        return prompt
    if any(isinstance(t, float | bool) for t in prompt):
        raise ApiError(400, "prompt must be integer token ids: got a non-integer")
    if len(prompt) != 1:
        raise ApiError(400, f"batched prompts ({len(prompt)}) are not supported: send one")
    (single,) = prompt
    if isinstance(single, str):
        return _text_tokens(single, tokenize)
    if _is_ids(single):
        return single
    raise ApiError(400, "prompt must be text, a list of token ids, or a list of one of those")


def parse_completion(
    raw: bytes, tokenize: Tokenize | None, decode: str | None = None,
    servers: BandServers | None = None,
) -> tuple[Submission, CompletionBody]:  # fmt: skip
    """``decode``: the server's decoder address (``--decode``), which makes ``max_tokens``
    above 1 and ``stream`` possible; the prompt's cache is then handed to it. ``servers``:
    where the stages serve bands to decoders, for vLLM's P/D (``wavepp.serve.pd``)."""
    body: CompletionBody = decode_body(raw, CompletionBody)
    handoff, ignored = openai_handoff(body, NEUTRAL, decode, servers)
    tokens = _prompt_tokens(body.prompt, tokenize)
    submission = Submission(token_array(tokens), check_id(body.request_id), body.priority,
                            handoff, body.deadline_s, ignored)  # fmt: skip
    return submission, body


def _neutral(value: Any, neutral: tuple) -> bool:
    return value is None or any(value == n and type(value) is type(n) for n in neutral
                                if n is not None)  # fmt: skip


def openai_handoff(body: Any, neutral: dict[str, tuple], decode: str | None,
                   servers: BandServers | None) -> tuple[str | None, tuple[str, ...]]:  # fmt: skip
    """Where an OpenAI body's prompt cache goes — held for a decoder to pull (vLLM's P/D,
    ``kv_transfer_params.do_remote_decode``), to ``--decode``'s decoder, or nowhere — and
    the fields the prefill ignores as the decoder's to honour; ApiError(400) for what
    this server cannot do. ``neutral``: the body's sampling fields and their neutral
    values."""
    max_tokens = body.max_tokens if body.max_tokens is not None else body.max_completion_tokens
    if remote_decode(body.kv_transfer_params, servers):
        check_shape(body.stream, body.max_tokens, body.max_completion_tokens)
        ignored = [f for f, values in neutral.items() if not _neutral(getattr(body, f), values)]
        ignored += [f for f in DECODER_FIELDS if getattr(body, f) is not None]
        return PULL_TARGET, tuple(ignored + ["n"] * (body.n != 1))
    check_max_tokens(max_tokens, decode is not None)
    for field, values in neutral.items():
        value = getattr(body, field)
        if not _neutral(value, values):
            raise ApiError(400, f"{field} {value!r:.60} is not supported: a prefill server "
                           "returns the greedy first token only (leave it out)")  # fmt: skip
    if body.stream and decode is None:
        raise ApiError(400, "stream is not supported without a decoder: a prefill returns "
                       "one token (start the server with --decode ADDRESS or auto)")
    if body.n != 1:
        raise ApiError(400, f"n {body.n} is not supported: one completion per request")
    decoding = decode is not None and ((max_tokens or 1) > 1 or body.stream)
    return (decode if decoding else None), ()


MAX_DECODE_TOKENS = 4096  # the decode protocol's bound on max_tokens


def check_max_tokens(max_tokens: int | None, decoding: bool = False) -> None:
    """The one place that says which ``max_tokens`` this server does: 1 (or left out), and
    up to MAX_DECODE_TOKENS with a decoder (``--decode``)."""
    if max_tokens is None or max_tokens == 1:
        return
    if max_tokens < 1:
        raise ApiError(400, f"max_tokens must be ≥ 1, got {max_tokens}")
    if not decoding:
        raise ApiError(400, f"max_tokens {max_tokens} needs a decoder: this server prefills "
                       "and returns the first token only (max_tokens 1); start it with "
                       "--decode ADDRESS or --decode auto")  # fmt: skip
    if max_tokens > MAX_DECODE_TOKENS:
        raise ApiError(400, f"max_tokens {max_tokens} is over {MAX_DECODE_TOKENS}")


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _since(end: float | None, start: float | None) -> float | None:
    return None if end is None or start is None else max(end - start, 0.0)


def timings(result: Any) -> dict:
    """Seconds from submission to each step (None where the request never got there)."""
    return {
        "submitted_at": result.submitted_at,
        "admitted_at": result.admitted_at,
        "first_chunk_at": result.first_chunk_at,
        "done_at": result.done_at,
        "queued_s": _since(result.admitted_at, result.submitted_at),
        "first_chunk_s": _since(result.first_chunk_at, result.submitted_at),
        "total_s": _since(result.done_at, result.submitted_at),
    }


def result_body(result: Any, simulated: bool) -> dict:
    """``POST /v1/prefill``'s answer: the engine's result and its timings; ``simulated``:
    the sim executor predicted its waves (its first token is -1)."""
    return {
        "id": result.request_id,
        "simulated": simulated,
        "status": result.status,
        "first_token": result.first_token,
        "top_logit": _finite(result.top_logit),
        "num_tokens": result.num_tokens,
        "cached_tokens": result.cached_tokens,
        "error": result.error,
        "timings": timings(result),
        **({"handoff": client_handoff(result.handoff)}
           if getattr(result, "handoff", None) else {}),
        **({"deadline_s": result.deadline_s, "deadline_met": result.deadline_met}
           if getattr(result, "deadline_s", None) is not None else {}),
    }


def wanted_tokens(body: Any) -> int:
    """The tokens an OpenAI body asks for: ``max_tokens``, else ``max_completion_tokens``
    (chat's name), else 1."""
    if body.max_tokens is not None:
        return body.max_tokens
    return body.max_completion_tokens or 1


def completion_body(
    result: Any, body: Any, detokenize: Callable[[int], str] | None,
    simulated: bool, token_ids: list[int] | None = None, *, answer_id: str | None = None,
    chat: bool = False,
) -> dict:  # fmt: skip
    """``POST /v1/completions``'s answer (``chat``: ``/v1/chat/completions``'), in the
    OpenAI shape plus a ``wavepp`` record. ``token_ids``: what the decoder generated (the
    first token included); None: the prefill's first token alone. ``answer_id``: the id
    the answer carries after its ``cmpl-`` / ``chatcmpl-`` (the client's X-Request-Id;
    default WavePP's request id)."""
    token = result.first_token
    done = result.status == "done"
    if token_ids is None:
        token_ids = [token] if done and token is not None else []
    text = "".join(detokenize(t) for t in token_ids) if detokenize is not None else ""
    finish = result.status if not done else (
        "length" if len(token_ids) >= wanted_tokens(body) else "stop")
    choice: dict[str, Any] = {"index": 0}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice.update(text=text, token=token)
    choice.update(token_ids=token_ids, logprobs=None, finish_reason=finish)
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{answer_id or result.request_id}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": body.model or "wavepp",
        "choices": [choice],
        "usage": {
            "prompt_tokens": result.num_tokens,
            "completion_tokens": len(token_ids),
            "total_tokens": result.num_tokens + len(token_ids),
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
        },
        "wavepp": result_body(result, simulated),
    }


def stream_event(answer: dict) -> dict:
    """A streamed chunk from an answer built by :func:`completion_body`: no finish
    reason, usage or ``wavepp`` record; a chat's message as its ``delta``."""
    event = {k: v for k, v in answer.items() if k not in ("usage", "wavepp")}
    choice = dict(event["choices"][0], finish_reason=None)
    choice.pop("token", None)
    if "message" in choice:
        choice["delta"] = choice.pop("message")
        event["object"] = "chat.completion.chunk"
    event["choices"] = [choice]
    return event


STATUS_CODE = {"done": 200, "cancelled": 200, "rejected": 400, "failed": 500}
"""HTTP status for a result's status (a cancelled request answers 200 with its status)."""
