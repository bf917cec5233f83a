"""Clients of a receiver: a reference band sender (:func:`build_band`, :func:`send_band`,
through the socket transport's exchange) and the decode worker's client (:func:`decode`).

The decode protocol, on the worker's listening address (``python -m wavepp.decode``)::

    client -> worker   b"WPHD" | u32 LE length | msgpack DecodeRequest
    worker -> client   b"WPHT" | u32 LE length | msgpack DecodeChunk     (repeated, until done)

A chunk with ``error`` set ends the stream; so does one with ``done``.
"""

from __future__ import annotations

import math
import struct
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Annotated

import msgspec
import torch

from wavepp.dtypes import name_of
from wavepp.handoff import _io
from wavepp.handoff.auth import sign_header, sign_message
from wavepp.handoff.socket_send import exchange
from wavepp.handoff.wire import (
    ACK_MAGIC,
    DTYPES,
    MAX_BAND_AUTH_CHARS,
    MAX_ID_CHARS,
    Ack,
    Address,
    BandHeader,
    Fingerprint,
    Sender,
    TensorSpec,
    WireError,
    ack_length,
    decode_ack,
    encode_band_prefix,
    parse_address,
)

DECODE_MAGIC = b"WPHD"
TOKENS_MAGIC = b"WPHT"
PING_MAGIC = b"WPHL"  # a liveness probe on a decode worker's address; it answers the same
PONG = PING_MAGIC
MAX_FRAME_BYTES = 1 << 20
MAX_DECODE_TOKENS = 4096
_FRAME = struct.Struct("<4sI")


class DecodeRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Decode one request from its handed-off cache."""

    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_DECODE_TOKENS)]  # first token included
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=100.0)] = 0.0  # only 0 (greedy)
    timeout_s: Annotated[float, msgspec.Meta(gt=0.0, le=86_400.0)] = 60.0  # wait for the cache
    sender: Sender = ""  # the run whose request it is: its bands' sender
    # the client's signature with the shared secret (wavepp.handoff.auth); "": unsigned
    auth: Annotated[str, msgspec.Meta(max_length=MAX_BAND_AUTH_CHARS)] = ""


class DecodeChunk(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Tokens generated so far (new ones only); the last chunk has done or error set."""

    request_id: Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]
    token_ids: Annotated[list[int], msgspec.Meta(max_length=MAX_DECODE_TOKENS)]
    done: bool = False
    error: Annotated[str, msgspec.Meta(max_length=4096)] = ""


class DecodeError(RuntimeError):
    """The worker refused or failed the request, or the connection broke."""


def encode_frame(magic: bytes, message: msgspec.Struct) -> bytes:
    raw = msgspec.msgpack.encode(message)
    if len(raw) > MAX_FRAME_BYTES:
        raise WireError(f"frame of {len(raw)} bytes exceeds {MAX_FRAME_BYTES}")
    return _FRAME.pack(magic, len(raw)) + raw


def frame_length(prefix: bytes, magic: bytes) -> int:
    """The payload length from a frame's 8-byte prefix (magic checked, length bounded)."""
    got, length = _FRAME.unpack(prefix)
    if got != magic:
        raise WireError(f"bad frame magic {got!r}, expected {magic!r}")
    if not 1 <= length <= MAX_FRAME_BYTES:
        raise WireError(f"frame length {length} outside 1..{MAX_FRAME_BYTES}")
    return length


def decode_frame(raw: bytes, kind: type):
    try:
        return msgspec.msgpack.decode(raw, type=kind)
    except (msgspec.ValidationError, msgspec.DecodeError) as error:
        raise WireError(f"{kind.__name__} does not decode: {error}") from None


# -- bands ---------------------------------------------------------------------------


def build_band(
    request_id: str,
    stage: int,
    num_stages: int,
    fingerprint: Fingerprint,
    tensors: Mapping[tuple[int, str], torch.Tensor],
    num_tokens: int,
    first_token: int = -1,
    top_logit: float = 0.0,
) -> tuple[BandHeader, list[torch.Tensor]]:
    """A band's header and its payload tensors (C-contiguous, header order) from
    ``{(layer, name): tensor}`` (layer -1: ``tokens``)."""
    specs, payload = [], []
    for (layer, name), tensor in tensors.items():
        try:
            dtype = name_of(tensor.dtype)
        except ValueError as error:
            raise ValueError(f"{name} of layer {layer}: {error}") from None
        shape = list(tensor.shape)
        specs.append(TensorSpec(layer, name, dtype, shape, math.prod(shape) * DTYPES[dtype]))
        payload.append(tensor.detach().to("cpu").contiguous())
    layers = sorted({layer for layer, _ in tensors if layer >= 0})
    header = BandHeader(
        request_id=request_id, stage=stage, num_stages=num_stages, fingerprint=fingerprint,
        layers=layers, num_tokens=num_tokens, tensors=specs, first_token=first_token,
        top_logit=top_logit,
    )  # fmt: skip
    return header, payload


async def send_band(
    address: str | Address,
    header: BandHeader,
    payload: Sequence[torch.Tensor],
    timeout_s: float = 30.0,
    secret: bytes | None = None,
) -> Ack:
    """Send one band (signed with ``secret``, if given: ``wavepp.handoff.auth``) and
    return the receiver's ack (``WireError`` for a malformed ack, ``TimeoutError`` /
    ``OSError`` for a receiver that is gone or silent)."""
    where = parse_address(address) if isinstance(address, str) else address
    views = [memoryview(encode_band_prefix(sign_header(header, secret)))]
    views += [tensor.reshape(-1).view(torch.uint8).numpy().data for tensor in payload]
    conn = await _io.connect(where, timeout_s)
    try:
        return await exchange(conn, views)
    finally:
        conn.close()


# -- decoding ------------------------------------------------------------------------


async def decode(
    address: str | Address,
    request_id: str,
    max_tokens: int,
    timeout_s: float = 60.0,
    temperature: float = 0.0,
    sender: str = "",
    secret: bytes | None = None,
) -> AsyncIterator[list[int]]:
    """The tokens the decode worker generates for ``request_id`` of the run ``sender``
    (the handed-off first token first), as they come; the request signed with ``secret``
    if given. ``DecodeError`` for an error frame, a refusal or a broken stream."""
    where = parse_address(address) if isinstance(address, str) else address
    request = sign_message(DecodeRequest(request_id, max_tokens, temperature, timeout_s,
                                         sender), secret)  # fmt: skip
    # reads may wait for the cache to arrive and for the first tokens to be generated
    try:
        conn = await _io.connect(where, min(timeout_s, 30.0))
    except (OSError, TimeoutError) as error:
        raise DecodeError(f"decode worker at {where} unreachable: {error!r}") from None
    conn.timeout_s = timeout_s + 60.0
    try:
        await conn.send(encode_frame(DECODE_MAGIC, request))
        while True:
            try:
                prefix = await conn.read_exactly(8)
                if prefix[:4] == ACK_MAGIC:  # the worker refused the connection itself
                    ack = decode_ack(await conn.read_exactly(ack_length(prefix)))
                    raise DecodeError(f"decode of {request_id!r}: refused: {ack.error}")
                length = frame_length(prefix, TOKENS_MAGIC)
                chunk = decode_frame(await conn.read_exactly(length), DecodeChunk)
            except (OSError, TimeoutError, WireError) as error:
                raise DecodeError(f"decode of {request_id!r}: stream broke: {error!r}") from None
            if chunk.error:
                raise DecodeError(f"decode of {request_id!r}: {chunk.error}")
            if chunk.token_ids:
                yield chunk.token_ids
            if chunk.done:
                return
    finally:
        conn.close()
