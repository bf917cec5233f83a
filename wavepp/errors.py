"""Errors a caller of WavePP sees, importable without torch."""

from __future__ import annotations

REASONS = ("invalid", "too_long", "duplicate", "draining")


class RequestRejected(ValueError):
    """Bad input for one request: it never ran and nothing was allocated for it.

    ``reason`` says which kind, for a front end mapping it to a status code:
    ``invalid`` (empty prompt, ids outside the vocabulary, wrong types), ``too_long``
    (can never fit the smallest stage pool), ``duplicate`` (the id is in use) or
    ``draining`` (the engine takes no new requests).
    """

    def __init__(self, message: str, reason: str = "invalid") -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown rejection reason {reason!r}; one of {REASONS}")
        super().__init__(message)
        self.reason = reason
