"""Errors of the rounds plane's protocol (what and why, with the numbers)."""


class ProtocolError(RuntimeError):
    """A step of the admission protocol saw something the protocol rules out: a policy
    or a peer broke its contract. A bug, never bad input."""
