"""The handoff wire format: one band of a request's cache, and the receiver's ack.

Pure: msgspec only, no torch, no I/O. Bytes from a peer are input, not objects: every
length is checked against its bound before anything is read or allocated, the header
decodes into exactly ``BandHeader`` (bounds on every field), and :func:`decode_header`
checks that it is consistent with itself. Anything else raises ``WireError`` naming the
problem. ``docs/handoff.md`` is the contract in prose.

One band (one connection per band)::

    b"WPHB" | u16 LE version (3) | u16 LE flags (0) | u32 LE header_len | header | payload

The receiver answers once: ``b"WPHA" | u32 LE ack_len | ack`` (msgpack of ``Ack``).
Version 3 is the only one, and it defines no flag: a prefix of another version, or with
a flag set, is refused.

A decoder that pulls a band from a stage's band server (target ``pull:``) opens the
connection and sends one pull frame first; the stage answers with the band above (then
reads the decoder's ack) or with a refusing ack::

    b"WPHP" | u16 LE version (1) | u16 LE flags (0) | u32 LE pull_len | pull

``pull`` is the msgspec JSON of ``Pull`` (at most ``MAX_PULL_BYTES``).
"""

from __future__ import annotations

import ipaddress
import math
import re
import struct
from typing import Annotated

import attrs
import msgspec

from wavepp.dtypes import FLOATS, ITEMSIZE
from wavepp.ids import MAX_ID_CHARS

WIRE_VERSION = 3  # the only one read and written
BAND_MAGIC = b"WPHB"
ACK_MAGIC = b"WPHA"
PREFIX_BYTES = 12  # magic, version, flags, header_len
ACK_PREFIX_BYTES = 8  # magic, ack_len
ALIGN = 64  # bytes: where each tensor of a receiver's band buffer starts
MAX_HEADER_BYTES = 1 << 20
MAX_ACK_BYTES = 1 << 16
MAX_ERROR_CHARS = 4096
MAX_STAGES = 4096
MAX_TENSORS = 4096
MAX_LAYERS = 1 << 16
MAX_DIMS = 8
MAX_DIM = 2**31
DTYPES = ITEMSIZE  # a band tensor's dtype name: its itemsize (wavepp.dtypes)
STATE_DTYPES = FLOATS  # Fingerprint.dtype: the attention tensors
LAYER_KINDS = "AML"  # A: GQA/MHA K/V, M: MLA latent, L: recurrent state

_PREFIX = struct.Struct("<4sHHI")
_ACK_PREFIX = struct.Struct("<4sI")

PULL_MAGIC = b"WPHP"
PULL_VERSION = 1  # the pull frame's own version (the band it answers is WIRE_VERSION's)
PULL_PREFIX_BYTES = PREFIX_BYTES  # magic, version, flags, pull_len
MAX_PULL_BYTES = 1 << 16
MAX_AUTH_CHARS = 4096  # a pull's auth
MAX_BAND_AUTH_CHARS = 256  # a band header's auth (wavepp.handoff.auth: about 130 chars)
MAX_SENDER_CHARS = 64  # a band's sender (WavePP's: 16 hex digits)
PULL_TARGET = "pull:"  # a request's handoff target: its bands wait on the stages' band servers


Sender = Annotated[str, msgspec.Meta(max_length=MAX_SENDER_CHARS, pattern=r"^[A-Za-z0-9._-]*$")]


def request_key(sender: str, request_id: str) -> str:
    """Where a receiver keeps a request: its id, under its sender's when there is one
    (``SENDER/ID``: ids hold no '/'), so that two runs' equal ids never meet."""
    return f"{sender}/{request_id}" if sender else request_id


class WireError(ValueError):
    """Bytes from a peer that are not a valid band or ack (the message says why)."""


Size = Annotated[int, msgspec.Meta(ge=0, le=MAX_DIM)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


class Fingerprint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The model a band was computed with; the receiver's must be equal field by field."""

    architecture: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    #  HF architectures[0] (``LlamaForCausalLM``, ...) or ``wavepp:<name>``
    num_layers: Annotated[int, msgspec.Meta(ge=1, le=MAX_LAYERS)]  # decoder layers, whole model
    hidden_size: Size
    vocab_size: Size
    layer_kinds: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_LAYERS)]
    #  one char per layer: A (GQA/MHA), M (MLA latent), L (recurrent)
    num_heads: Size  # attention query heads (0: none)
    num_kv_heads: Size  # GQA KV heads (0: none)
    head_dim: Size  # GQA head size (0: none)
    kv_lora_rank: Size  # MLA latent rank (0: no MLA)
    rope_dim: Size  # MLA shared rope key dim (0: no MLA)
    dtype: Annotated[str, msgspec.Meta(max_length=16)]  # of the attention tensors


class TensorSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One tensor of the payload: ``nbytes`` bytes, C-contiguous, little-endian."""

    layer: Annotated[int, msgspec.Meta(ge=-1, le=MAX_LAYERS)]  # global layer; -1: per request
    name: Name  # k | v | latent | delta | conv | state | tokens
    dtype: Annotated[str, msgspec.Meta(max_length=16)]  # a key of DTYPES
    shape: Annotated[list[Size], msgspec.Meta(min_length=1, max_length=MAX_DIMS)]
    nbytes: Annotated[int, msgspec.Meta(ge=0, le=2**62)]  # prod(shape) * itemsize


class BandHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """What one stage sends: its layers of one request's cache. Fields at their default
    are left out of the encoding (a receiver fills them in)."""

    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]
    stage: Annotated[int, msgspec.Meta(ge=0, lt=MAX_STAGES)]  # sending stage, < num_stages
    num_stages: Annotated[int, msgspec.Meta(ge=1, le=MAX_STAGES)]  # P: bands of the whole cache
    fingerprint: Fingerprint
    layers: Annotated[list[Annotated[int, msgspec.Meta(ge=0, lt=MAX_LAYERS)]],
                      msgspec.Meta(max_length=MAX_LAYERS)]  # fmt: skip
    #  global layer indices of this band, ascending, each < fingerprint.num_layers
    num_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_DIM)]  # prompt length T
    tensors: Annotated[list[TensorSpec], msgspec.Meta(max_length=MAX_TENSORS)]  # payload order
    first_token: Annotated[int, msgspec.Meta(ge=-1, le=MAX_DIM)] = -1  # last stage only
    top_logit: float = 0.0  # last stage only
    # the run that sent it (WavePP: a random id per pipeline run, the same on every stage);
    # a receiver keeps requests apart by sender and id (request_key); "": none
    sender: Sender = ""
    # the sender's signature over the rest of the header, with the shared secret
    # (wavepp.handoff.auth); "" (left out): unsigned
    auth: Annotated[str, msgspec.Meta(max_length=MAX_BAND_AUTH_CHARS)] = ""


class Ack(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The receiver's one answer per band."""

    request_id: Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]  # echo ("" if unknown)
    stage: Annotated[int, msgspec.Meta(ge=-1, lt=MAX_STAGES)]  # echo (-1 if unknown)
    ok: bool  # band accepted: checked and stored
    error: Annotated[str, msgspec.Meta(max_length=MAX_ERROR_CHARS)] = ""  # why not


class Pull(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A decoder's request for one stage's band of a request held for pulling."""

    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]
    #  WavePP's id of the request (kv_transfer_params.wavepp.request_id)
    stage: Annotated[int, msgspec.Meta(ge=0, lt=MAX_STAGES)]  # the stage asked
    fingerprint: Fingerprint  # the decoder's model: the stage's must be equal field by field
    # the decoder's signature over the rest of the pull, with the shared secret
    # (wavepp.handoff.auth); "": unsigned
    auth: Annotated[str, msgspec.Meta(max_length=MAX_AUTH_CHARS)] = ""


_HEADER_DECODER = msgspec.msgpack.Decoder(BandHeader)
_ACK_DECODER = msgspec.msgpack.Decoder(Ack)
_ENCODER = msgspec.msgpack.Encoder()


# -- bands ---------------------------------------------------------------------------


def encode_header(header: BandHeader) -> bytes:
    """The header's msgpack bytes, as the wire carries them (and as a signature covers
    them, ``auth`` left empty: ``wavepp.handoff.auth``)."""
    return _ENCODER.encode(header)


def encode_band_prefix(header: BandHeader) -> bytes:
    """Magic, version, flags, header_len and the msgpack header: what precedes the
    payload. Raises ``WireError`` for a header the receiver would refuse."""
    raw = _ENCODER.encode(header)
    decode_header(raw)  # the sender's own check: never send what a receiver refuses
    return _PREFIX.pack(BAND_MAGIC, WIRE_VERSION, 0, len(raw)) + raw


def header_length(prefix: bytes) -> int:
    """header_len from a band's first ``PREFIX_BYTES`` bytes, checked."""
    return _frame_length(prefix, "band", BAND_MAGIC, WIRE_VERSION, "header_len",
                         MAX_HEADER_BYTES, "wire")  # fmt: skip


def _frame_length(prefix: bytes, what: str, magic: bytes, version: int, length_name: str,
                  limit: int, version_name: str) -> int:  # fmt: skip
    """The length a 12-byte prefix (magic, u16 version, u16 flags, u32 length) announces,
    checked: ``what`` names the frame in the errors."""
    if len(prefix) != PREFIX_BYTES:
        raise WireError(f"{what} prefix is {len(prefix)} bytes, expected {PREFIX_BYTES}")
    got, got_version, flags, length = _PREFIX.unpack(prefix)
    if got != magic:
        raise WireError(f"bad {what} magic {got!r}, expected {magic!r}")
    if got_version != version:
        raise WireError(f"{version_name} version {got_version} is not supported (this side "
                        f"speaks {version})")  # fmt: skip
    if flags:
        raise WireError(f"unknown {what} flags {flags:#x} (version {version} has none)")
    if not 1 <= length <= limit:
        raise WireError(f"{length_name} {length} outside 1..{limit}")
    return length


def payload_layout(header: BandHeader) -> tuple[list[int], int]:
    """Where each tensor of the band starts in a receiver's band buffer: at the next
    multiple of ``ALIGN`` bytes after the one before, in header order; and the bytes that
    takes in all."""
    offsets, size = [], 0
    for spec in header.tensors:
        offsets.append(size)
        size += -(-spec.nbytes // ALIGN) * ALIGN
    return offsets, size


def decode_header(raw: bytes) -> BandHeader:
    """A ``BandHeader`` from its msgpack bytes, checked for internal consistency."""
    if len(raw) > MAX_HEADER_BYTES:
        raise WireError(f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = _HEADER_DECODER.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as error:
        raise WireError(f"band header does not decode: {error}") from None
    _check_header(header)
    return header


def _check_header(header: BandHeader) -> None:
    fp = header.fingerprint
    if fp.dtype not in STATE_DTYPES:
        raise WireError(f"fingerprint dtype {fp.dtype!r} is not one of {STATE_DTYPES}")
    if len(fp.layer_kinds) != fp.num_layers:
        raise WireError(
            f"fingerprint has {fp.num_layers} layers but {len(fp.layer_kinds)} layer kinds"
        )
    if set(fp.layer_kinds) - set(LAYER_KINDS):
        raise WireError(f"layer kinds {fp.layer_kinds!r} use letters outside {LAYER_KINDS!r}")
    if header.stage >= header.num_stages:
        raise WireError(f"stage {header.stage} is not below num_stages {header.num_stages}")
    last = header.stage == header.num_stages - 1
    if last and header.first_token < 0:
        raise WireError(f"the last stage's band (stage {header.stage}) carries no first_token")
    if not last and header.first_token != -1:
        raise WireError(
            f"stage {header.stage} of {header.num_stages} sends first_token "
            f"{header.first_token}; only the last stage does"
        )
    for before, after in zip(header.layers, header.layers[1:], strict=False):
        if after <= before:
            raise WireError(f"layers are not strictly ascending: {before} then {after}")
    if header.layers and header.layers[-1] >= fp.num_layers:
        raise WireError(f"layer {header.layers[-1]} is outside the model's {fp.num_layers} layers")
    held = set(header.layers)
    seen: set[tuple[int, str]] = set()
    for spec in header.tensors:
        where = f"tensor {spec.name!r} of layer {spec.layer}"
        if spec.layer != -1 and spec.layer not in held:
            raise WireError(f"{where}: the band's layers {header.layers} do not include it")
        if (spec.layer, spec.name) in seen:
            raise WireError(f"{where} appears twice")
        seen.add((spec.layer, spec.name))
        if spec.dtype not in DTYPES:
            raise WireError(f"{where}: dtype {spec.dtype!r} is not one of {sorted(DTYPES)}")
        expected = math.prod(spec.shape) * DTYPES[spec.dtype]
        if spec.nbytes != expected:
            raise WireError(
                f"{where}: nbytes {spec.nbytes} but shape {spec.shape} of {spec.dtype} "
                f"is {expected} bytes"
            )


def band_bytes(header: BandHeader) -> int:
    """The payload's length: the sum of every tensor's nbytes."""
    return sum(spec.nbytes for spec in header.tensors)


# -- acks ----------------------------------------------------------------------------


def encode_ack(ack: Ack) -> bytes:
    """Magic, ack_len and the msgpack ack. An error longer than the bound is cut."""
    if len(ack.error) > MAX_ERROR_CHARS:
        ack = msgspec.structs.replace(ack, error=ack.error[: MAX_ERROR_CHARS - 3] + "...")
    raw = _ENCODER.encode(ack)
    if len(raw) > MAX_ACK_BYTES:  # 4096 chars of 4 UTF-8 bytes + a 256-char id still fit
        raise WireError(f"ack of {len(raw)} bytes exceeds {MAX_ACK_BYTES}")
    return _ACK_PREFIX.pack(ACK_MAGIC, len(raw)) + raw


def ack_length(prefix: bytes) -> int:
    """ack_len from an ack's first ``ACK_PREFIX_BYTES`` bytes, checked."""
    if len(prefix) != ACK_PREFIX_BYTES:
        raise WireError(f"ack prefix is {len(prefix)} bytes, expected {ACK_PREFIX_BYTES}")
    magic, length = _ACK_PREFIX.unpack(prefix)
    if magic != ACK_MAGIC:
        raise WireError(f"bad ack magic {magic!r}, expected {ACK_MAGIC!r}")
    if not 1 <= length <= MAX_ACK_BYTES:
        raise WireError(f"ack_len {length} outside 1..{MAX_ACK_BYTES}")
    return length


def decode_ack(raw: bytes) -> Ack:
    return _decode_bounded(raw, _ACK_DECODER, MAX_ACK_BYTES, "ack")


def _decode_bounded(raw: bytes, decoder, limit: int, what: str):
    """``decoder.decode(raw)`` for at most ``limit`` bytes; WireError otherwise."""
    if len(raw) > limit:
        raise WireError(f"{what} of {len(raw)} bytes exceeds {limit}")
    try:
        return decoder.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as error:
        raise WireError(f"{what} does not decode: {error}") from None


# -- pulls ---------------------------------------------------------------------------

_PULL_DECODER = msgspec.json.Decoder(Pull)


def encode_pull(pull: Pull) -> bytes:
    """Magic, version, flags, pull_len and the JSON pull. Raises ``WireError`` for a pull
    a stage would refuse before reading it (one over ``MAX_PULL_BYTES``)."""
    raw = msgspec.json.encode(pull)
    if len(raw) > MAX_PULL_BYTES:
        raise WireError(f"pull of {len(raw)} bytes exceeds {MAX_PULL_BYTES}")
    return _PREFIX.pack(PULL_MAGIC, PULL_VERSION, 0, len(raw)) + raw


def pull_length(prefix: bytes) -> int:
    """pull_len from a pull frame's first ``PULL_PREFIX_BYTES`` bytes, checked."""
    return _frame_length(prefix, "pull", PULL_MAGIC, PULL_VERSION, "pull_len", MAX_PULL_BYTES,
                         "pull")  # fmt: skip


def decode_pull(raw: bytes) -> Pull:
    """A ``Pull`` from its JSON bytes (strict: exactly the struct's fields and types)."""
    return _decode_bounded(raw, _PULL_DECODER, MAX_PULL_BYTES, "pull")


def fingerprint_mismatch(theirs: Fingerprint, mine: Fingerprint, their_side: str,
                         my_side: str) -> str | None:  # fmt: skip
    """The first field where two fingerprints differ, as one line naming both sides'
    values (``fingerprint num_kv_heads: the decoder has 8, WavePP has 2``); None when
    they are equal."""
    for field in mine.__struct_fields__:
        a, b = getattr(theirs, field), getattr(mine, field)
        if a != b:
            return f"fingerprint {field}: {their_side} has {a!r}, {my_side} has {b!r}"
    return None


# -- addresses -----------------------------------------------------------------------

_ACCEPTED = "unix:/abs/path or tcp://HOST:PORT (HOST a name, IPv4 or [IPv6])"
_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                       r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")  # fmt: skip
MAX_UNIX_PATH_BYTES = 107


@attrs.frozen
class Address:
    """Where a band goes: a Unix socket, a TCP endpoint, or the stage's own band server,
    where a decoder pulls it (``pull``: ``PULL_TARGET``)."""

    kind: str  # unix | tcp | pull
    path: str = ""  # unix: absolute path
    host: str = ""  # tcp: a name, IPv4, or IPv6 (without brackets)
    port: int = 0  # tcp: 1..65535

    def __str__(self) -> str:
        if self.kind == "tcp":
            host = f"[{self.host}]" if ":" in self.host else self.host
            return f"tcp://{host}:{self.port}"
        return f"{self.kind}:{self.path}"


def parse_address(text: str, *, any_port: bool = False) -> Address:
    """``unix:/abs/path`` or ``tcp://HOST:PORT``; ValueError otherwise.
    ``any_port``: a listener's address, whose port may be 0 (any free one)."""

    def bad(why: str) -> ValueError:
        return ValueError(f"address {text!r}: {why}; accepted forms: {_ACCEPTED}")

    if not isinstance(text, str):
        raise bad("not a string")
    if text.startswith("unix:") and not text.startswith("unix://"):
        path = text[len("unix:") :]
        if not path.startswith("/"):
            raise bad("the path must be absolute")
        if "\x00" in path:
            raise bad("the path holds a NUL byte")
        if len(path.encode()) > MAX_UNIX_PATH_BYTES:
            raise bad(f"a Unix socket path is at most {MAX_UNIX_PATH_BYTES} bytes")
        return Address(kind="unix", path=path)
    if text.startswith("tcp://"):
        rest = text[len("tcp://") :]
        host, sep, port_text = rest.rpartition(":")
        if not sep or not port_text.isdigit() or not port_text.isascii():
            raise bad("no :PORT")
        port = int(port_text)
        low = 0 if any_port else 1
        if not low <= port <= 65535:
            raise bad(f"port {port} outside {low}..65535")
        if host.startswith("[") and host.endswith("]"):
            try:
                ipaddress.IPv6Address(host[1:-1])
            except ValueError:
                raise bad(f"{host} is not an IPv6 address") from None
            return Address(kind="tcp", host=host[1:-1], port=port)
        if not _HOSTNAME.match(host):
            raise bad(f"host {host!r} is not a name or an IPv4 address (IPv6 goes in [])")
        return Address(kind="tcp", host=host, port=port)
    raise bad("unknown form")


def parse_target(text: str) -> Address:
    """A band's target: an address :func:`parse_address` reads, or ``PULL_TARGET``."""
    if text == PULL_TARGET:
        return Address(kind="pull")
    return parse_address(text)


# -- what a model's bands hold -------------------------------------------------------

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "kimi_linear": "KimiLinearForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
}


def _need(config: dict, key: str):
    value = config.get(key)
    if value is None:
        raise ValueError(f"config ({config.get('model_type')}) needs {key!r}")
    return value


def _layer_types(config: dict) -> list[str]:
    n = _need(config, "num_hidden_layers")
    types = config.get("layer_types")
    linear = config.get("linear_attn_config") or {}
    if types is None and "kda_layers" in linear and "full_attn_layers" in linear:
        types = [""] * n  # Kimi's checkpoint config: 1-indexed layer lists
        for layer in linear["full_attn_layers"]:
            types[layer - 1] = "full_attention"
        for layer in linear["kda_layers"]:
            types[layer - 1] = "linear_attention"
    if types is None or len(types) != n:
        raise ValueError(f"config needs layer_types for its {n} layers, got {types!r}")
    unknown = set(types) - {"linear_attention", "full_attention"}
    if unknown:
        raise ValueError(f"layer types {sorted(unknown)} are not supported")
    return list(types)


def _kimi_linear(config: dict) -> tuple[int, int, int]:
    """Kimi Linear's KDA: (heads, head_dim, conv kernel), as WavePP reads them."""
    linear = config.get("linear_attn_config") or {}
    heads = linear.get("num_heads", config.get("linear_num_heads"))
    head_dim = linear.get("head_dim", config.get("linear_head_dim"))
    kernel = linear.get("short_conv_kernel_size", config.get("linear_conv_kernel_dim", 4))
    if not heads or not head_dim:
        raise ValueError("kimi_linear config needs linear_num_heads and linear_head_dim")
    return heads, head_dim, kernel


def fingerprint_from_hf_config(config: dict, dtype: str) -> Fingerprint:
    """The fingerprint of a Hugging Face ``config.json`` dict (model_type llama,
    kimi_linear, qwen3_next or minimax_m2), with ``dtype`` the attention tensors' dtype."""
    kind = config.get("model_type")
    if kind not in _ARCHITECTURES:
        raise ValueError(
            f"model_type {kind!r} is not supported; supported: {sorted(_ARCHITECTURES)}"
        )
    if dtype not in STATE_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {STATE_DTYPES}")
    n = _need(config, "num_hidden_layers")
    hidden = _need(config, "hidden_size")
    heads = _need(config, "num_attention_heads")
    names = config.get("architectures") or [_ARCHITECTURES[kind]]
    common = dict(
        architecture=str(names[0]),
        num_layers=n,
        hidden_size=hidden,
        vocab_size=_need(config, "vocab_size"),
        num_heads=heads,
        dtype=dtype,
    )
    if kind == "kimi_linear":
        kinds = "".join("L" if t == "linear_attention" else "M" for t in _layer_types(config))
        return Fingerprint(
            **common, layer_kinds=kinds, num_kv_heads=0, head_dim=0,
            kv_lora_rank=_need(config, "kv_lora_rank"),
            rope_dim=_need(config, "qk_rope_head_dim"),
        )  # fmt: skip
    if kind == "qwen3_next":
        kinds = "".join("L" if t == "linear_attention" else "A" for t in _layer_types(config))
    else:
        kinds = "A" * n
    return Fingerprint(
        **common,
        layer_kinds=kinds,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or hidden // heads,
        kv_lora_rank=0,
        rope_dim=0,
    )


def expected_tensors(
    config: dict, dtype: str, layer: int, num_tokens: int, fp: Fingerprint | None = None
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """What a band carries for ``layer`` (-1: the per-request ``tokens``) of a prompt of
    ``num_tokens`` tokens: name -> (dtype, shape), in WavePP's native layout. ``fp``:
    ``fingerprint_from_hf_config(config, dtype)`` when the caller holds it already (a
    receiver checks every layer of every band)."""
    if fp is None:
        fp = fingerprint_from_hf_config(config, dtype)
    t = num_tokens
    if layer == -1:
        return {"tokens": ("int32", (t,))}
    if not 0 <= layer < fp.num_layers:
        raise ValueError(f"layer {layer} is outside the model's {fp.num_layers} layers")
    kind = fp.layer_kinds[layer]
    if kind == "A":
        shape = (t, fp.num_kv_heads, fp.head_dim)
        return {"k": (dtype, shape), "v": (dtype, shape)}
    if kind == "M":
        return {"latent": (dtype, (t, 1, fp.kv_lora_rank + fp.rope_dim))}
    if config["model_type"] == "kimi_linear":  # KDA: q | k | v channels, square heads
        heads, head_dim, kernel = _kimi_linear(config)
        dk = dv = head_dim
        channels = 3 * heads * head_dim
    else:  # Gated DeltaNet: value heads; q | k over key heads, v over value heads
        heads = _need(config, "linear_num_value_heads")
        dk = _need(config, "linear_key_head_dim")
        dv = _need(config, "linear_value_head_dim")
        key_dim = _need(config, "linear_num_key_heads") * dk
        kernel = config.get("linear_conv_kernel_dim", 4)
        channels = 2 * key_dim + heads * dv
    return {
        "delta": ("float32", (heads, dk, dv)),
        "conv": ("float32", (kernel - 1, channels)),
    }
