"""Where a band's connection is read and checked before any of its payload is allocated.

:meth:`Gate.admit` is the one place a receiver reads what precedes a band's payload —
the prefix and the header — and checks it: the wire's own checks
(bounds, internal consistency: ``wavepp.handoff.wire``), then against this receiver's
model (the fingerprint field by field, each layer's tensors by name, dtype and shape) and
its byte limit. Given the shared secret (``wavepp.handoff.auth``), the header's
signature is checked first, as soon as the header has decoded: an unsigned or wrongly
signed band is refused before anything else of it is looked at. A band that passes is
then claimed in its request (``assembly``) and only then is its memory allocated. The
deadline for the prefix and header is the connection's (``_io.Connection.set_deadline``,
set by the receiver when it accepts). Token ids are the one check made after the payload
is in (:meth:`Gate.check_tokens`).
"""

from __future__ import annotations

import attrs
import torch

from wavepp.handoff import _io
from wavepp.handoff.auth import Verifier
from wavepp.handoff.wire import (
    BAND_MAGIC,
    PREFIX_BYTES,
    BandHeader,
    Fingerprint,
    WireError,
    band_bytes,
    decode_header,
    expected_tensors,
    fingerprint_mismatch,
    header_length,
)


@attrs.define
class Arrival:
    """What a band's connection said before its payload, as far as it was read (a
    refusal acks with the header's request and stage when there is one)."""

    header: BandHeader | None = None


class Gate:
    """The checks of one receiver's model (a Hugging Face config dict and the attention
    tensors' dtype) and byte limit; with a ``verifier``, bands must be signed."""

    def __init__(self, config: dict, dtype: str, fingerprint: Fingerprint,
                 max_band_bytes: int, verifier: Verifier | None = None) -> None:  # fmt: skip
        self.config, self.dtype, self.fingerprint = config, dtype, fingerprint
        self.max_band_bytes = max_band_bytes
        self.verifier = verifier

    async def admit(self, conn: _io.Connection, arrival: Arrival) -> BandHeader:
        """Read the rest of a band's prefix (its magic is read) and its header into
        ``arrival``, and check them; ``WireError`` naming the first problem. Reads at most
        ``wire.MAX_HEADER_BYTES`` and some; allocates nothing for the payload. An
        unsigned or wrongly signed band (with a verifier) is ``auth.AuthError``."""
        length = header_length(BAND_MAGIC + await conn.read_exactly(PREFIX_BYTES - 4))
        arrival.header = header = decode_header(await conn.read_exactly(length))
        if self.verifier is not None:
            self.verifier.header(header)
        self.check(header)
        return header

    def check(self, header: BandHeader) -> None:
        """A decoded header against this receiver's model; ``WireError`` naming what
        differs. (Pure: nothing is claimed or allocated.)"""
        mine = self.fingerprint
        differs = fingerprint_mismatch(header.fingerprint, mine, "the band", "this model")
        if differs:
            raise WireError(differs)
        if header.first_token >= mine.vocab_size:
            raise WireError(f"first_token {header.first_token} >= vocab_size {mine.vocab_size}")
        t = header.num_tokens
        expected: dict[tuple[int, str], tuple[str, tuple[int, ...]]] = {}
        for layer in [-1] * (header.stage == 0) + header.layers:
            for name, spec in expected_tensors(self.config, self.dtype, layer, t,
                                                mine).items():  # fmt: skip
                expected[(layer, name)] = spec
        for spec in header.tensors:
            key = (spec.layer, spec.name)
            kind = "per-request" if spec.layer == -1 else mine.layer_kinds[spec.layer]
            if key not in expected:
                names = sorted(n for (la, n) in expected if la == spec.layer)
                raise WireError(f"layer {spec.layer} ({kind}, stage {header.stage}) has no "
                                f"tensor {spec.name!r}; expected {names}")  # fmt: skip
            dtype, shape = expected.pop(key)
            if (spec.dtype, tuple(spec.shape)) != (dtype, shape):
                raise WireError(
                    f"layer {spec.layer} ({kind}) tensor {spec.name!r}: the band has "
                    f"{spec.dtype} {list(spec.shape)}, expected {dtype} {list(shape)} "
                    f"for {t} tokens"
                )
        if expected:
            missing = [f"{name} of layer {layer}" for layer, name in sorted(expected)]
            raise WireError(f"stage {header.stage}'s band lacks {', '.join(missing[:8])}")
        size = band_bytes(header)
        if size > self.max_band_bytes:
            raise WireError(
                f"band of {size:,} bytes exceeds max_band_bytes {self.max_band_bytes:,}"
            )

    def check_tokens(self, tensors: dict[tuple[int, str], torch.Tensor]) -> None:
        """Stage 0's token ids, once read, within the model's vocabulary."""
        tokens = tensors.get((-1, "tokens"))
        if tokens is not None and tokens.numel():
            low, high = int(tokens.min()), int(tokens.max())
            if low < 0 or high >= self.fingerprint.vocab_size:
                raise WireError(f"token ids span {low}..{high}, outside the vocabulary of "
                                f"{self.fingerprint.vocab_size}")  # fmt: skip
