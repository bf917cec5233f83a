"""The one error every refusal of the server (and the router) is: an HTTP status and why."""

from __future__ import annotations


class ApiError(Exception):
    """A request the server refuses: ``status`` is the HTTP status, the message says why."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "code": self.status}}
