"""What the router reads of a request body: its id, its prompt's token ids (a chat's
messages as text, for the text tree), whether it streams, its priority and deadline.

The body itself is forwarded as it came, with two exceptions: a request without an id gets
one (``id`` for ``/v1/prefill``, ``request_id`` for ``/v1/completions`` and
``/v1/chat/completions``), so that a retry on another replica runs under the same id; and
a request with a deadline is sent with what is left of it (:func:`with_deadline`). A body
the router cannot read (not JSON, a field of the wrong type) is forwarded anyway, routed
as a prompt of unknown tokens with no deadline: the replica answers it as a single server
would (a 400 naming the field).
"""

from __future__ import annotations

import uuid
from typing import Any

import attrs
import msgspec
import numpy as np

from wavepp.ids import id_problem
from wavepp.serve.api import PRIORITY_RANGE, TOO_DEEP, ApiError
from wavepp.workload import MAX_DEADLINE_S

ID_FIELD = {"/v1/prefill": "id", "/v1/completions": "request_id",
            "/v1/chat/completions": "request_id"}  # fmt: skip


class _Prefill(msgspec.Struct):
    tokens: Any = None
    text: Any = None
    id: Any = None
    priority: Any = 0
    deadline_s: Any = None


class _OpenAI(msgspec.Struct, kw_only=True):
    request_id: Any = None
    stream: Any = False
    priority: Any = 0
    deadline_s: Any = None


class _Completion(_OpenAI, kw_only=True):
    prompt: Any = None


class _Chat(_OpenAI, kw_only=True):
    messages: Any = None


@attrs.frozen
class Peek:
    """A request as the router routes it."""

    body: bytes  # what goes to the replica (the client's, plus an id when it had none)
    request_id: str | None  # the id the replica sees; None when the client's is not valid
    assigned: bool  # the router named it (the client gave no id)
    tokens: np.ndarray | None  # int32 token ids, when the prompt is token ids
    tree_key: tuple[int, ...] | None  # the text tree's key: token ids or a text's code points
    stream: bool  # a completion asking for server-sent events
    priority: int = 0  # its priority class (0 when absent or not one the server takes)
    # seconds from its arrival at the router to its result's deadline; None when it has
    # none, or one the server does not take (sent untouched: the replica refuses it)
    deadline_s: float | None = None
    # the prompt's chained block hashes per block size, filled once as replicas ask
    hashes_of: dict[int, tuple[int, ...]] = attrs.field(factory=dict, eq=False, repr=False)
    headers: dict[str, str] = attrs.field(factory=dict)  # sent with the body (X-Request-Id)


def _ids(value: Any) -> np.ndarray | None:
    if not isinstance(value, list) or not value:
        return None
    if not all(type(t) is int and 0 <= t < 2**31 for t in value):
        return None
    return np.asarray(value, dtype=np.int32)


def _prompt(value: Any) -> tuple[np.ndarray | None, str | None]:
    """(token ids, text) of a completion prompt: ids, text, or a batch of one of either."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list | str):
        value = value[0]
    if isinstance(value, str):
        return None, value
    return _ids(value), None


def _chat_text(messages: Any) -> str | None:
    """A chat's messages as one text (roles and text contents, in order): the text
    tree's key, so that chats sharing a beginning share a prefix."""
    if not isinstance(messages, list):
        return None
    parts = []
    for message in messages:
        if not isinstance(message, dict):
            return None
        content = message.get("content")
        if isinstance(content, list):
            content = "\n".join(p.get("text", "") for p in content
                                if isinstance(p, dict) and isinstance(p.get("text"), str))
        parts.append(f"{message.get('role')}\n{content if isinstance(content, str) else ''}\n")
    return "".join(parts)


def _priority(value: Any) -> int:
    ok = type(value) is int and PRIORITY_RANGE[0] <= value <= PRIORITY_RANGE[1]
    return value if ok else 0


def _deadline(value: Any) -> float | None:
    ok = type(value) in (int, float) and 0 < value <= MAX_DEADLINE_S
    return float(value) if ok else None


def new_request_id() -> str:
    return f"route-{uuid.uuid4().hex}"


KINDS = {"/v1/prefill": _Prefill, "/v1/completions": _Completion,
         "/v1/chat/completions": _Chat}  # fmt: skip


def peek(route: str, raw: bytes) -> Peek:
    """The router's reading of ``raw``, a body for ``route`` (a key of :data:`ID_FIELD`)."""
    try:
        parsed = msgspec.json.decode(raw, type=KINDS[route])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return Peek(raw, None, False, None, None, False)  # the replica's 400 says why
    except RecursionError:  # msgspec's depth guard: no replica would read it either
        raise ApiError(400, TOO_DEEP) from None
    priority, deadline_s = _priority(parsed.priority), _deadline(parsed.deadline_s)
    if isinstance(parsed, _Prefill):
        tokens, text, given, stream = _ids(parsed.tokens), parsed.text, parsed.id, False
    elif isinstance(parsed, _Chat):
        tokens, text = None, _chat_text(parsed.messages)
        given, stream = parsed.request_id, parsed.stream is True
    else:
        tokens, text = _prompt(parsed.prompt)
        given, stream = parsed.request_id, parsed.stream is True
    text = text if isinstance(text, str) else None
    tree_key = tuple(tokens.tolist()) if tokens is not None else (
        tuple(map(ord, text)) if text else None)  # fmt: skip
    if given is None:
        request_id = new_request_id()
        whole = msgspec.json.decode(raw)
        whole[ID_FIELD[route]] = request_id
        return Peek(msgspec.json.encode(whole), request_id, True, tokens, tree_key, stream,
                    priority, deadline_s)  # fmt: skip
    request_id = given if id_problem(given) is None else None
    return Peek(raw, request_id, False, tokens, tree_key, stream, priority, deadline_s)


def with_deadline(body: bytes, deadline_s: float) -> bytes:
    """``body`` (a JSON object the router has read) with ``deadline_s`` in it instead."""
    whole = msgspec.json.decode(body)
    whole["deadline_s"] = deadline_s
    return msgspec.json.encode(whole)


@attrs.frozen
class Answer:
    """What the router counts of a replica's JSON answer (None where it does not say)."""

    status: str | None = None  # the engine's: done, cancelled, rejected, failed
    num_tokens: int | None = None  # prompt tokens (with cached_tokens, or neither)
    cached_tokens: int | None = None
    deadline_met: bool | None = None  # only in the answer to a request with a deadline


def read_answer(body: Any) -> Answer:
    """The figures of a replica's decoded answer: ``/v1/prefill``'s result, or the
    ``wavepp`` record of a completion."""
    if not isinstance(body, dict):
        return Answer()
    result = body.get("wavepp", body)
    if not isinstance(result, dict):
        return Answer()
    status, num = result.get("status"), result.get("num_tokens")
    cached, met = result.get("cached_tokens"), result.get("deadline_met")
    ok = all(isinstance(x, int) and not isinstance(x, bool) for x in (num, cached))
    return Answer(status if isinstance(status, str) else None, num if ok else None,
                  cached if ok else None, met if isinstance(met, bool) else None)  # fmt: skip
