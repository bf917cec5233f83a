"""A shared secret, and proof that a frame came from someone who holds it.

Pure: the standard library only, no I/O but :func:`load_secret`. A frame's ``auth``
field holds::

    hmac-sha256:<unix time, ms>:<nonce, 32 hex>:<HMAC-SHA256, 64 hex>

the HMAC keyed by the secret over ``domain | "<time>:<nonce>\\n" | body``: ``domain``
names the kind of frame (a band's signature is no pull's, nor a KV-event batch's),
``body`` is the frame as its owner encodes it with ``auth`` left out. A
:class:`Verifier` refuses a frame that is unsigned, malformed, signed with another key
(``hmac.compare_digest``), signed more than ``MAX_AGE_S`` from its own clock, or whose
nonce it has seen (a replay). The frames: the handoff's bands, pulls and decode requests
(``wavepp.handoff.auth``) and the KV-event batches (``wavepp.kv_events``).

The secret: a file's bytes (a trailing newline dropped; ``--handoff-secret FILE``), else
the environment variable ``WAVEPP_HANDOFF_SECRET`` (its value itself); 16 to 4096 bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import time
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path

SECRET_ENV = "WAVEPP_HANDOFF_SECRET"
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
MAX_AGE_S = 60.0  # a signature's time may differ from the verifier's clock by this much
MAX_NONCES = 1 << 16  # nonces remembered (within MAX_AGE_S); beyond, the oldest go
SCHEME = "hmac-sha256"
MAX_AUTH_CHARS = 256  # an auth string (about 130 characters)
_AUTH = re.compile(r"^hmac-sha256:([0-9]{1,16}):([0-9a-f]{32}):([0-9a-f]{64})$")


class SignatureError(ValueError):
    """A frame a verifier refuses: unsigned, or its signature is wrong, stale or replayed
    (the message says which)."""


def load_secret(path: str | None, environ: Mapping[str, str] | None = None) -> bytes | None:
    """The shared secret: the file at ``path`` (a trailing newline dropped), else
    ``$WAVEPP_HANDOFF_SECRET``'s value, else None. ValueError (one line) for a file that
    cannot be read or a secret of the wrong length."""
    environ = os.environ if environ is None else environ
    if path:
        try:
            with open(Path(path), "rb") as f:
                secret = f.read(MAX_SECRET_BYTES + 1)
        except OSError as error:
            raise ValueError(f"cannot read the handoff secret {path}: "
                             f"{error.strerror or error}") from None  # fmt: skip
        where = path
    elif environ.get(SECRET_ENV):
        secret, where = environ[SECRET_ENV].encode(), f"${SECRET_ENV}"
    else:
        return None
    secret = secret.rstrip(b"\r\n")
    if not MIN_SECRET_BYTES <= len(secret) <= MAX_SECRET_BYTES:
        raise ValueError(f"the handoff secret ({where}) is {len(secret)} bytes; it needs "
                         f"{MIN_SECRET_BYTES}..{MAX_SECRET_BYTES}")  # fmt: skip
    return secret


def _mac(secret: bytes, domain: bytes, stamp: str, body: bytes) -> str:
    return hmac.new(secret, domain + stamp.encode() + b"\n" + body, hashlib.sha256).hexdigest()


def sign(secret: bytes, domain: bytes, body: bytes, now: float | None = None,
         nonce: str | None = None) -> str:  # fmt: skip
    """The ``auth`` string for ``body`` (the frame with ``auth`` left out)."""
    stamp = f"{int((time.time() if now is None else now) * 1000)}:{nonce or os.urandom(16).hex()}"
    return f"{SCHEME}:{stamp}:{_mac(secret, domain, stamp, body)}"


class Verifier:
    """Checks signatures with a secret; remembers the nonces it accepted for
    ``max_age_s`` (at most ``max_nonces``: past that the oldest go, and a signature no
    newer than the newest gone is refused). Its refusals are ``error`` (a
    :class:`SignatureError` by default; a caller's own subclass of it)."""

    error: type[Exception] = SignatureError

    def __init__(self, secret: bytes, max_age_s: float = MAX_AGE_S,
                 max_nonces: int = MAX_NONCES) -> None:  # fmt: skip
        self._secret = secret
        self.max_age_s, self.max_nonces = max_age_s, max_nonces
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> its time, s
        self._floor = -1.0  # a signature at or before this time is refused

    def __repr__(self) -> str:
        return f"{type(self).__name__}(max_age_s={self.max_age_s:g})"

    def verify(self, auth: str, domain: bytes, body: bytes, what: str,
               now: float | None = None) -> None:  # fmt: skip
        """``error`` unless ``auth`` signs ``body`` in ``domain`` with this secret, fresh
        and unseen; ``what`` names the frame in the message."""
        now = time.time() if now is None else now
        if not auth:
            raise self.error(f"unsigned {what} refused: this side needs it signed with the "
                             "shared secret (--handoff-secret)")  # fmt: skip
        match = _AUTH.match(auth)
        if match is None:
            raise self.error(f"{what} auth is not {SCHEME}:<ms>:<32 hex>:<64 hex>")
        ms, nonce, mac = match.groups()
        if not hmac.compare_digest(_mac(self._secret, domain, f"{ms}:{nonce}", body), mac):
            raise self.error(f"{what} signature does not verify (another --handoff-secret?)")
        signed = int(ms) / 1000
        if abs(now - signed) > self.max_age_s:
            raise self.error(f"{what} signed {now - signed:+.0f} s from this side's "
                             f"clock, outside ±{self.max_age_s:g} s (clock skew, or a "
                             "replay)")  # fmt: skip
        if nonce in self._seen or signed <= self._floor:
            raise self.error(f"{what} signature seen before: a replay")
        self._seen[nonce] = signed
        cutoff = now - self.max_age_s
        while self._seen:
            oldest, at = next(iter(self._seen.items()))
            if at >= cutoff and len(self._seen) <= self.max_nonces:
                break
            del self._seen[oldest]
            if at >= cutoff:  # gone before its time: nothing as old is taken again
                self._floor = max(self._floor, at)
