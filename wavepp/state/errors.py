"""Errors of the state core. Each message gives the numbers."""


class StateError(ValueError):
    """A reducer was asked for something the state does not allow."""


class UnknownRequest(StateError, KeyError):
    """The stage holds nothing for this request."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class InvariantError(RuntimeError):
    """The state broke one of its own invariants: a bug, never bad input."""
