"""vLLM's disaggregated prefill/decode protocol, the prefiller's side (``docs/handoff.md``).

A proxy written for vLLM's P/D (vLLM's toy proxy, llm-d, vllm-router, Dynamo) sends the
client's completion or chat request to P with ``kv_transfer_params: {"do_remote_decode":
true, ...}``, ``stream: false`` and ``max_tokens: 1``, copies the ``kv_transfer_params``
of P's answer into the same request to D, and streams D's answer back. WavePP as P reads
the incoming parameters (:class:`KvTransferParams`: vLLM's keys, typed and bounded; any
other key, a wrong type or a request P cannot serve is a 400 naming the field), prefills
the prompt with its cache held on the stages' band servers (``pull:``), and answers the
parameters D's ``wavepp.vllm`` connector pulls with (:func:`decoder_params`). Pure: no
I/O, no torch.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import msgspec

from wavepp.runtime.handoff import BandServers
from wavepp.serve.errors import ApiError

PARAMS_VERSION = 1  # of kv_transfer_params.wavepp
MAX_IDS = 1 << 22  # token or block ids in one list
Text = Annotated[str, msgspec.Meta(max_length=4096)]
Count = Annotated[int, msgspec.Meta(ge=0)]


class KvTransferParams(msgspec.Struct, forbid_unknown_fields=True):
    """``kv_transfer_params`` as a client may send them to P: the keys vLLM's proxies
    and connectors use, each with its type. P reads ``do_remote_decode`` and
    ``do_remote_prefill``; the other known keys are accepted and ignored (a NIXL proxy's
    placeholders, parameters meant for a decoder); an unknown key is refused."""

    do_remote_decode: bool = False  # P prefills for a decoder elsewhere
    do_remote_prefill: bool = False  # a decoder's: load the cache from a prefiller
    remote_engine_id: Text | None = None
    remote_block_ids: Annotated[list[int | list[int]], msgspec.Meta(max_length=MAX_IDS)] | None = (
        None)  # fmt: skip
    remote_host: Text | None = None
    remote_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] | None = None
    remote_request_id: Text | None = None
    remote_num_tokens: Count | None = None
    remote_blocks_expiry_time: float | None = None
    tp_size: Count | None = None
    dcp_size: Count | None = None
    pp_size: Count | None = None
    transfer_mode: Text | None = None
    remote_prefill_cached_tokens: Count | None = None
    prompt_token_ids: Annotated[list[int], msgspec.Meta(max_length=MAX_IDS)] | None = None
    wavepp: dict[str, Any] | None = None  # what WavePP answers a decoder (this module)


def remote_decode(params: KvTransferParams | None, servers: BandServers | None) -> bool:
    """Whether the request asks P to prefill for a decoder; ApiError(400) for one P
    cannot serve."""
    if params is None:
        return False
    if params.do_remote_prefill:
        raise ApiError(400, "kv_transfer_params.do_remote_prefill: true asks this server to "
                       "load a cache from a prefiller; WavePP is the prefiller (send "
                       "do_remote_decode: true)")  # fmt: skip
    if params.do_remote_decode and servers is None:
        raise ApiError(400, "kv_transfer_params.do_remote_decode: this server's stages serve "
                       "no bands to decoders (the torch executor, --handoff-serve)")  # fmt: skip
    return params.do_remote_decode


def check_shape(stream: bool, max_tokens: int | None, max_completion_tokens: int | None) -> None:
    """The proxy's shape: P answers once, with one token; the decoder does the rest."""
    if stream:
        raise ApiError(400, "stream must be false with kv_transfer_params.do_remote_decode "
                       "(the prefiller answers once; the decoder streams)")  # fmt: skip
    for name, value in (("max_tokens", max_tokens),
                        ("max_completion_tokens", max_completion_tokens)):  # fmt: skip
        if value is not None and value != 1:
            raise ApiError(400, f"{name} must be 1 with kv_transfer_params.do_remote_decode, "
                           f"got {value} (the decoder generates the rest)")  # fmt: skip


def decoder_params(result: Any, tokens: list[int], servers: BandServers,
                   now: float | None = None) -> dict | None:  # fmt: skip
    """The ``kv_transfer_params`` a decoder pulls the prompt's cache with, from P's
    answer (``result``: held for pulling, ``Handle.answer``); None when its cache is not
    held (its handoff failed, or it did not finish): the proxy then sends D the client's
    request as it came, and D computes the prompt itself."""
    handoff = getattr(result, "handoff", None) or {}
    if result.status != "done" or handoff.get("status") != "held":
        return None
    now = time.time() if now is None else now
    since = handoff.get("held_since") or now
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_prefill_cached_tokens": result.cached_tokens,
        "prompt_token_ids": list(tokens),
        "wavepp": {
            "version": PARAMS_VERSION,
            "request_id": result.request_id,
            "stages": list(servers.addresses),
            "num_tokens": result.num_tokens,
            "first_token": result.first_token,
            "expires_in_s": round(max(servers.lease_s - (now - since), 0.0), 3),
        },
    }
