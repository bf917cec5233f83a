"""The connector's pure parts (``docs/handoff.md``, the connector): what it reads from a
request's ``kv_transfer_params``, how much of the prompt it loads, what it checks of the
decoder's model and paged cache before it starts, and where each loaded token's keys
and values go in vLLM's pages. No vLLM import: torch, msgspec and ``wavepp.handoff``
only, so WavePP's own tests run it without vLLM installed.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Annotated

import attrs
import msgspec
import numpy as np
import torch

from wavepp.handoff import auth, wire

PARAMS_VERSION = 1  # kv_transfer_params.wavepp.version this connector reads
MAX_IDS = 1 << 22  # prompt token ids in kv_transfer_params
DEFAULT_ALLOW = ("unix:", "tcp://127.0.0.1:", "tcp://localhost:", "tcp://[::1]:")
#  band servers a decoder pulls from unless kv_connector_extra_config.allow says otherwise
#  (one host); "*" allows any address
PAGE_ISAS = ("vec", "vec16", "neon")  # CPU attention kernels whose page layout this writes
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class _Extra(msgspec.Struct, forbid_unknown_fields=True):
    """``kv_connector_extra_config``: every key optional, one-host defaults."""

    allow: list[Annotated[str, msgspec.Meta(max_length=4096)]] = msgspec.field(
        default_factory=lambda: list(DEFAULT_ALLOW))  # fmt: skip
    #  band server address prefixes the connector connects to ("*": any)
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0  # a load not complete by then fails
    read_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0  # a stage silent this long fails
    threads: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 8  # stages pulled at once
    max_band_mib: Annotated[int, msgspec.Meta(ge=1)] = 4096  # a larger band is refused unread
    secret_file: str | None = None  # the stages' shared secret (else $WAVEPP_HANDOFF_SECRET)


@attrs.frozen
class Settings:
    """The connector's settings: ``kv_connector_extra_config`` read (:func:`read_settings`)."""

    allow: tuple[str, ...]  # band server address prefixes ("*": any)
    timeout_s: float  # a load not complete this long after it started fails
    read_timeout_s: float  # no byte from a stage this long: its band fails
    threads: int  # stages pulled at once (all requests together)
    max_band_bytes: int  # a band larger than this is refused before it is read
    # the stages' shared secret (wavepp.handoff.auth): pulls go signed with it and every
    # band's header must be signed with it; None: unsigned both ways
    secret: bytes | None = attrs.field(repr=False)


EXTRA_KEYS = tuple(_Extra.__struct_fields__)


def read_settings(extra: Mapping | None, environ: Mapping[str, str]) -> Settings:
    """The :class:`Settings` of ``kv_connector_extra_config`` (``extra``); the secret from
    its ``secret_file``, else ``environ``'s ``WAVEPP_HANDOFF_SECRET`` (``auth.load_secret``).
    ValueError naming the key: an unknown key, a wrong type or bound, a secret file that
    cannot be read or a secret too short."""
    try:
        got = msgspec.convert(dict(extra or {}), _Extra, strict=True)
    except msgspec.ValidationError as error:
        raise ValueError(f"WavePPConnector: kv_connector_extra_config: {error} (it takes "
                         f"{list(EXTRA_KEYS)})") from None  # fmt: skip
    try:
        secret = auth.load_secret(got.secret_file, environ)
    except ValueError as error:
        raise ValueError(f"WavePPConnector: {error}") from None
    return Settings(tuple(got.allow), got.timeout_s, got.read_timeout_s, got.threads,
                    got.max_band_mib << 20, secret)  # fmt: skip


class ParamsError(ValueError):
    """``kv_transfer_params`` this connector cannot load from (the message says why)."""


class ModelRefused(ValueError):
    """A decoder this connector cannot load into (raised when the connector starts)."""


class _WavePP(msgspec.Struct, forbid_unknown_fields=True):
    """``kv_transfer_params.wavepp``, as ``wavepp.serve.pd.decoder_params`` writes it."""

    version: int
    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=wire.MAX_ID_CHARS)]
    stages: Annotated[list[Annotated[str, msgspec.Meta(max_length=4096)]],
                      msgspec.Meta(min_length=1, max_length=wire.MAX_STAGES)]  # fmt: skip
    num_tokens: Annotated[int, msgspec.Meta(ge=1, le=wire.MAX_DIM)]
    first_token: Annotated[int, msgspec.Meta(ge=-1, le=wire.MAX_DIM)] = -1
    expires_in_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0


class _Params(msgspec.Struct):
    """The keys of ``kv_transfer_params`` the connector reads (others are vLLM's or a
    proxy's, and ignored)."""

    do_remote_prefill: bool = False
    prompt_token_ids: Annotated[list[int], msgspec.Meta(max_length=MAX_IDS)] | None = None
    wavepp: _WavePP | None = None


@attrs.frozen
class Source:
    """Where a request's prompt cache is held: WavePP's id of the request, each stage's
    band server, the prompt WavePP computed it for."""

    request_id: str
    stages: tuple[str, ...]
    num_tokens: int
    # None: vLLM took them out of kv_transfer_params (its chat endpoint decodes from
    # them as its prompt instead of templating the messages again)
    prompt_token_ids: tuple[int, ...] | None


def is_ours(params: object) -> bool:
    """Whether a request's ``kv_transfer_params`` ask this connector to load: a dict with
    ``do_remote_prefill`` true and a ``wavepp`` key (others, e.g. NIXL's, are not ours)."""
    return (isinstance(params, dict) and params.get("do_remote_prefill") is True
            and "wavepp" in params)  # fmt: skip


def parse_params(params: object, vocab_size: int,
                 allow: Sequence[str] = DEFAULT_ALLOW) -> Source:  # fmt: skip
    """The :class:`Source` of ``kv_transfer_params``; ParamsError naming the first
    problem: a wrong type or an unknown field in ``wavepp``, another version, token ids
    that are not the prompt's (a count other than ``num_tokens``, ids outside the
    vocabulary), a stage address that does not parse or is not allowed. Without
    ``prompt_token_ids`` (vLLM's chat endpoint takes them out, and decodes from them),
    the source has none: what is loaded is then checked against stage 0's token ids
    only, when its band comes."""
    try:
        got = msgspec.convert(params, _Params, strict=True)
    except msgspec.ValidationError as error:
        raise ParamsError(f"kv_transfer_params: {error}") from None
    w = got.wavepp
    if w is None:
        raise ParamsError("kv_transfer_params.wavepp is missing")
    if w.version != PARAMS_VERSION:
        raise ParamsError(f"kv_transfer_params.wavepp.version {w.version} is not supported "
                          f"(this connector reads {PARAMS_VERSION})")  # fmt: skip
    ids = got.prompt_token_ids
    if ids is not None and len(ids) != w.num_tokens:
        raise ParamsError(f"kv_transfer_params: {len(ids)} prompt_token_ids but "
                          f"wavepp.num_tokens is {w.num_tokens}")  # fmt: skip
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        raise ParamsError(f"kv_transfer_params.prompt_token_ids span {min(ids)}..{max(ids)}, "
                          f"outside the decoder's vocabulary of {vocab_size}")  # fmt: skip
    for s, address in enumerate(w.stages):
        try:
            where = wire.parse_address(address)
        except ValueError as error:
            raise ParamsError(f"kv_transfer_params.wavepp.stages[{s}]: {error}") from None
        if "*" not in allow and not any(str(where).startswith(a) for a in allow):
            raise ParamsError(
                f"kv_transfer_params.wavepp.stages[{s}] {address!r} is not "
                f"allowed (kv_connector_extra_config.allow: {list(allow)})"
            )
    return Source(w.request_id, tuple(w.stages), w.num_tokens,
                  None if ids is None else tuple(ids))  # fmt: skip


def agreed_tokens(decoder_ids: Sequence[int], source: Source, block_size: int) -> int:
    """How many of the decoder's prompt tokens to load: the longest prefix on which the
    decoder's ids and the ids WavePP computed the cache for agree, cut to whole blocks
    (vLLM computes the rest itself, less than one block). A source without ids: the
    shorter of the two prompts, in whole blocks (stage 0's band then checks its ids)."""
    if source.prompt_token_ids is None:
        return min(len(decoder_ids), source.num_tokens) // block_size * block_size
    a = np.asarray(decoder_ids[: source.num_tokens], dtype=np.int64)
    b = np.asarray(source.prompt_token_ids[: len(a)], dtype=np.int64)
    differ = np.flatnonzero(a != b)
    same = int(differ[0]) if differ.size else len(a)
    return same // block_size * block_size


def token_digest(ids: Sequence[int] | np.ndarray) -> str:
    """The digest a band's ``tokens`` (int32) are checked against: blake2b-128 of the ids
    as little-endian int32."""
    raw = np.asarray(ids, dtype="<i4").tobytes()
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


# -- the decoder's model and cache, checked when the connector starts --------------


def decoder_fingerprint(hf_config: dict, dtype: torch.dtype, cache_dtype: str) -> wire.Fingerprint:
    """The fingerprint a decoder running ``hf_config`` at ``dtype`` pulls with;
    ModelRefused for one the connector cannot load into: a model type WavePP's handoff
    does not know, a family with layers other than GQA/MHA attention (Qwen3-Next's Gated
    DeltaNet, Kimi Linear's KDA and MLA: their recurrent states and latents have no
    place in vLLM's paged attention cache this connector writes), a quantized KV cache."""
    if dtype not in DTYPES:
        raise ModelRefused(f"WavePPConnector: the decoder's dtype {dtype} is not one of "
                           f"{sorted(DTYPES.values())}")  # fmt: skip
    if cache_dtype not in ("auto", DTYPES[dtype]):
        raise ModelRefused(
            f"WavePPConnector: kv cache dtype {cache_dtype!r}: the bands "
            f"are {DTYPES[dtype]}; run vLLM with --kv-cache-dtype auto"
        )
    try:
        fp = wire.fingerprint_from_hf_config(hf_config, DTYPES[dtype])
    except (ValueError, KeyError, TypeError) as error:
        raise ModelRefused(f"WavePPConnector: {error}") from None
    others = sorted(set(fp.layer_kinds) - {"A"})
    if others:
        names = {"L": "linear-attention (recurrent state)", "M": "MLA latent"}
        raise ModelRefused(
            f"WavePPConnector loads attention-only models (Llama, MiniMax-M2); "
            f"{fp.architecture} has {' and '.join(names[k] for k in others)} layers "
            f"({fp.layer_kinds}), which it does not write into vLLM's cache: decode "
            "it with python -m wavepp.decode, or let vLLM compute its prompt"
        )
    return fp


_INDEX = re.compile(r"\.(\d+)\.")


def layer_index(layer_name: str) -> int:
    """The global layer of a vLLM attention layer's name (``model.layers.3.self_attn.attn``
    -> 3); ValueError unless it holds exactly one ``.N.`` part."""
    found = _INDEX.findall(f".{layer_name}.")
    if len(found) != 1:
        raise ValueError(f"cannot tell the layer of vLLM's layer {layer_name!r}")
    return int(found[0])


@attrs.frozen
class Pages:
    """One layer of vLLM CPU's paged cache, seen as its key and value halves: keys
    ``[blocks, heads, head_dim, B]`` (each page's keys column-major), values ``[blocks,
    heads, B, head_dim]``; views of the cache tensor, so writes land in it."""

    keys: torch.Tensor
    values: torch.Tensor
    block_size: int


def cpu_pages(cache: torch.Tensor, fp: wire.Fingerprint, block_size: int, isa: str,
              name: str) -> Pages:  # fmt: skip
    """The :class:`Pages` of one layer's cache tensor, checked against the model (the
    fingerprint) and the block size: ``[blocks, kv heads, B, 2 * head_dim]``,
    contiguous, the model's dtype, a kernel whose page layout is known (``PAGE_ISAS``:
    each (block, head) page is its keys ``[head_dim, B]`` then its values ``[B,
    head_dim]``; ``amx`` packs tiles instead). ModelRefused naming both sides otherwise."""
    want = (fp.num_kv_heads, block_size, 2 * fp.head_dim)
    if isa not in PAGE_ISAS:
        raise ModelRefused(f"WavePPConnector: vLLM's CPU attention kernel {isa!r} packs pages "
                           f"in a layout this connector does not write (it writes "
                           f"{list(PAGE_ISAS)}; amx is picked for bfloat16 on CPUs with AMX: "
                           "run float32 or float16)")  # fmt: skip
    if block_size % 32:
        raise ModelRefused(f"WavePPConnector: block size {block_size} is not a multiple of 32 "
                           "(vLLM CPU's kernel would split its blocks)")  # fmt: skip
    if cache.dim() != 4 or tuple(cache.shape[1:]) != want:
        raise ModelRefused(f"WavePPConnector: {name}'s cache is {list(cache.shape)}; the "
                           f"bands need [blocks, {want[0]}, {want[1]}, {want[2]}] (kv heads, "
                           "block size, 2 x head dim)")  # fmt: skip
    if DTYPES.get(cache.dtype) != fp.dtype:
        raise ModelRefused(f"WavePPConnector: {name}'s cache is {cache.dtype}, the bands "
                           f"{fp.dtype}")  # fmt: skip
    if not cache.is_contiguous():
        raise ModelRefused(f"WavePPConnector: {name}'s cache is not contiguous")
    blocks, heads, d = cache.shape[0], fp.num_kv_heads, fp.head_dim
    halves = cache.view(blocks, heads, 2, block_size * d)
    return Pages(halves[:, :, 0].unflatten(-1, (d, block_size)),
                 halves[:, :, 1].unflatten(-1, (block_size, d)), block_size)  # fmt: skip


def write_pages(pages: Pages, block_ids: Sequence[int], k: torch.Tensor,
                v: torch.Tensor) -> None:  # fmt: skip
    """Write the keys and values of whole blocks of tokens into ``pages``: ``k``, ``v``
    ``[len(block_ids) * B, kv heads, head_dim]`` (token-major, WavePP's layout), token
    ``i`` into block ``block_ids[i // B]`` at offset ``i % B``."""
    b = pages.block_size
    n = len(block_ids)
    if k.shape != v.shape or k.shape[0] != n * b:
        raise ValueError(f"k {list(k.shape)} and v {list(v.shape)} must both hold "
                         f"{n} blocks of {b} tokens")  # fmt: skip
    if not n:
        return
    heads, d = k.shape[1], k.shape[2]
    index = torch.as_tensor(list(block_ids), dtype=torch.long)
    kb = k.reshape(n, b, heads, d)
    vb = v.reshape(n, b, heads, d)
    pages.keys[index] = kb.permute(0, 2, 3, 1).to(pages.keys.dtype)
    pages.values[index] = vb.permute(0, 2, 1, 3).to(pages.values.dtype)
