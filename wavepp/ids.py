"""Request ids: the one rule of the Python API, the server and requests files."""

from __future__ import annotations

MAX_ID_CHARS = 128  # every id a request carries, wherever it goes (API, server, ranks)
RETAINED_IDS = 10_000  # a server's ended requests whose ids stay taken (a router's too)
ID_RULE = (f"a request id is 1 to {MAX_ID_CHARS} printable characters without '/' (a string "
           "in a requests file); it names one request until that request has ended and, on a "
           f"server, {RETAINED_IDS:,} later ones have too; a repeat meanwhile is refused (409 "
           "on the server); a rejected request leaves no trace, so its id is free at once")
"""The one id rule of the Python API, the server and requests files (docs/guide.md, Serving)."""


def id_problem(request_id: object) -> str | None:
    """Why ``request_id`` breaks :data:`ID_RULE`, or None."""
    if not isinstance(request_id, str):
        return f"a request id must be a string, got {type(request_id).__name__} {request_id!r:.40}"
    if not 0 < len(request_id) <= MAX_ID_CHARS:
        return f"a request id must be 1 to {MAX_ID_CHARS} characters, got {len(request_id)}"
    if not request_id.isprintable() or "/" in request_id:
        return "a request id must be printable characters without '/'"
    return None
