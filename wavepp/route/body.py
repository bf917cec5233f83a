"""What the router reads of a request body: its id, its prompt's token ids, whether it streams.

The body itself is forwarded as it came, with one exception: a request without an id gets
one (``id`` for ``/v1/prefill``, ``request_id`` for ``/v1/completions``), so that a retry
on another replica runs under the same id. A body the router cannot read (not JSON, a
field of the wrong type) is forwarded anyway, routed as a prompt of unknown tokens: the
replica answers it as a single server would (a 400 naming the field).
"""

from __future__ import annotations

import uuid
from typing import Any

import attrs
import msgspec
import numpy as np

from wavepp.ids import id_problem

ID_FIELD = {"/v1/prefill": "id", "/v1/completions": "request_id"}


class _Prefill(msgspec.Struct):
    tokens: Any = None
    text: Any = None
    id: Any = None


class _Completion(msgspec.Struct):
    prompt: Any = None
    request_id: Any = None
    stream: Any = False


@attrs.frozen
class Peek:
    """A request as the router routes it."""

    body: bytes  # what goes to the replica (the client's, plus an id when it had none)
    request_id: str | None  # the id the replica sees; None when the client's is not valid
    assigned: bool  # the router named it (the client gave no id)
    tokens: np.ndarray | None  # int32 token ids, when the prompt is token ids
    tree_key: tuple[int, ...] | None  # the text tree's key: token ids or a text's code points
    stream: bool  # a completion asking for server-sent events


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


def new_request_id() -> str:
    return f"route-{uuid.uuid4().hex}"


def peek(route: str, raw: bytes) -> Peek:
    """The router's reading of ``raw``, a body for ``route`` (a key of :data:`ID_FIELD`)."""
    kind = _Prefill if route == "/v1/prefill" else _Completion
    try:
        parsed = msgspec.json.decode(raw, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return Peek(raw, None, False, None, None, False)
    if isinstance(parsed, _Prefill):
        tokens, text, given, stream = _ids(parsed.tokens), parsed.text, parsed.id, False
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
        return Peek(msgspec.json.encode(whole), request_id, True, tokens, tree_key, stream)
    request_id = given if id_problem(given) is None else None
    return Peek(raw, request_id, False, tokens, tree_key, stream)


def answer_figures(body: Any) -> tuple[str | None, int | None, int | None]:
    """(status, prompt tokens, cached tokens) of a replica's JSON answer, where it says."""
    if not isinstance(body, dict):
        return None, None, None
    result = body.get("wavepp", body)
    if not isinstance(result, dict):
        return None, None, None
    status, num = result.get("status"), result.get("num_tokens")
    cached = result.get("cached_tokens")
    ok = all(isinstance(x, int) and not isinstance(x, bool) for x in (num, cached))
    return (status if isinstance(status, str) else None,
            num if ok else None, cached if ok else None)  # fmt: skip
