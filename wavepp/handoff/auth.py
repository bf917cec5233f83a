"""Senders proving themselves with the shared secret (``docs/handoff.md``,
Authentication): a band header, a pull frame and a decode request (``wavepp.handoff.client``)
each carry an optional ``auth`` field, signed and checked as ``wavepp.signing`` says.

A frame's signed body is the frame with ``auth`` empty as WavePP encodes it: a band
header's msgpack (``wire.encode_header``: the request id, the sender, the stage, the
fingerprint and every tensor's spec included), a pull's JSON, a decode request's msgpack;
each in a domain of its own (``BAND_DOMAIN``, ``PULL_DOMAIN``, ``DECODE_DOMAIN``). A
receiver given the secret (:class:`Verifier`) refuses, before it reads any payload, a
frame that is unsigned, malformed, signed with another key, stale or replayed, with an
:class:`AuthError` (a ``WireError``: the band's ack says why). Without a secret, ``auth``
is ignored.
"""

from __future__ import annotations

import msgspec

from wavepp.handoff import wire
from wavepp.signing import (
    MAX_AGE_S,
    MIN_SECRET_BYTES,
    SECRET_ENV,
    SignatureError,
    load_secret,
    sign,
)
from wavepp.signing import Verifier as _Verifier

__all__ = ["BAND_DOMAIN", "DECODE_DOMAIN", "MAX_AGE_S", "MIN_SECRET_BYTES", "PULL_DOMAIN",
           "SECRET_ENV", "AuthError", "Verifier", "load_secret", "sign", "sign_header",
           "sign_message", "sign_pull"]  # fmt: skip

BAND_DOMAIN = b"wavepp band v3\n"
PULL_DOMAIN = b"wavepp pull v1\n"
DECODE_DOMAIN = b"wavepp decode v1\n"


class AuthError(wire.WireError, SignatureError):
    """A frame a receiver with a secret refuses: unsigned, or its signature is wrong,
    stale or replayed (the message says which)."""


def _band_body(header: wire.BandHeader) -> bytes:
    return wire.encode_header(msgspec.structs.replace(header, auth=""))


def _pull_body(pull: wire.Pull) -> bytes:
    return msgspec.json.encode(msgspec.structs.replace(pull, auth=""))


def _message_body(message) -> bytes:
    return msgspec.msgpack.encode(msgspec.structs.replace(message, auth=""))


def sign_header(header: wire.BandHeader, secret: bytes | None) -> wire.BandHeader:
    """The header signed with ``secret`` (unchanged without one)."""
    if not secret:
        return header
    return msgspec.structs.replace(header, auth=sign(secret, BAND_DOMAIN, _band_body(header)))


def sign_pull(pull: wire.Pull, secret: bytes | None) -> wire.Pull:
    """The pull signed with ``secret`` (unchanged without one)."""
    if not secret:
        return pull
    return msgspec.structs.replace(pull, auth=sign(secret, PULL_DOMAIN, _pull_body(pull)))


def sign_message(message, secret: bytes | None, domain: bytes = DECODE_DOMAIN):
    """A msgspec struct with an ``auth`` field (a decode request), signed with ``secret``
    over its msgpack with ``auth`` empty (unchanged without a secret)."""
    if not secret:
        return message
    return msgspec.structs.replace(message, auth=sign(secret, domain, _message_body(message)))


class Verifier(_Verifier):
    """A receiver's check of the frames' signatures (AuthError when one fails)."""

    error = AuthError

    def header(self, header: wire.BandHeader, now: float | None = None) -> None:
        """AuthError unless the band header is signed with this secret, fresh, unseen."""
        self.verify(header.auth, BAND_DOMAIN, _band_body(header), "band", now)

    def pull(self, pull: wire.Pull, now: float | None = None) -> None:
        """AuthError unless the pull is signed with this secret, fresh, unseen."""
        self.verify(pull.auth, PULL_DOMAIN, _pull_body(pull), "pull", now)

    def message(self, message, what: str, domain: bytes = DECODE_DOMAIN,
                now: float | None = None) -> None:  # fmt: skip
        """AuthError unless ``message`` (:func:`sign_message`'s) is signed with this
        secret, fresh, unseen."""
        self.verify(message.auth, domain, _message_body(message), what, now)
