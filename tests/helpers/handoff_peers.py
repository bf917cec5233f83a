"""Peers of a handoff receiver, good and bad, on plain blocking sockets: a tiny Llama's
bands (signed or not), connections from a chosen loopback host (127.0.0.2 is another
peer than 127.0.0.1), and a receiver served in the test's event loop."""

from __future__ import annotations

import contextlib
import socket

import anyio
import msgspec
import torch

from wavepp.handoff import wire
from wavepp.handoff.auth import sign_header
from wavepp.handoff.base import BandJob, BandTensor
from wavepp.handoff.client import build_band

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
          "num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2,
          "num_key_value_heads": 1, "head_dim": 4, "vocab_size": 64}  # fmt: skip
FP = wire.fingerprint_from_hf_config(CONFIG, "float32")
SECRET = b"a shared secret of 32 bytes....."
LOCAL = wire.Address("tcp", host="127.0.0.1", port=0)


def layers_of(stage: int, num_stages: int) -> list[int]:
    return [0, 1] if num_stages == 1 else [stage] if stage < 2 else []


def band(rid: str, stage: int = 0, num_stages: int = 2, t: int = 4,
         secret: bytes | None = None, sender: str = "") -> bytes:  # fmt: skip
    """The whole band's bytes (prefix, header, payload) of stage ``stage`` of
    ``num_stages`` (stages 0 and 1 hold layers 0 and 1; P = 1 both), from run ``sender``."""
    tensors = {}
    if stage == 0:
        tensors[(-1, "tokens")] = torch.arange(t, dtype=torch.int32)
    for layer in layers_of(stage, num_stages):
        for name in ("k", "v"):
            tensors[(layer, name)] = torch.full((t, 1, 4), float(layer))
    last = stage == num_stages - 1
    header, payload = build_band(rid, stage, num_stages, FP, tensors, t, 5 if last else -1)
    header = msgspec.structs.replace(header, sender=sender)
    prefix = wire.encode_band_prefix(sign_header(header, secret))
    return prefix + b"".join(p.reshape(-1).view(torch.uint8).numpy().tobytes() for p in payload)


def split(data: bytes) -> tuple[bytes, bytes]:
    """A band's bytes as (prefix and header, payload)."""
    end = wire.PREFIX_BYTES + wire.header_length(data[: wire.PREFIX_BYTES])
    return data[:end], data[end:]


def connect(address: wire.Address, source: str | None = None,
            timeout_s: float = 30.0) -> socket.socket:  # fmt: skip
    """A blocking socket to ``address``; from host ``source`` (TCP) when given."""
    if address.kind == "unix":
        sock = socket.socket(socket.AF_UNIX)
        sock.settimeout(timeout_s)
        sock.connect(address.path)
        return sock
    sock = socket.socket(socket.AF_INET)
    sock.settimeout(timeout_s)
    if source:
        sock.bind((source, 0))
    sock.connect((address.host, address.port))
    return sock


def read_ack(sock: socket.socket) -> wire.Ack | None:
    """The receiver's ack; None when it closed without one."""
    data = bytearray()
    try:
        while len(data) < wire.ACK_PREFIX_BYTES:
            part = sock.recv(wire.ACK_PREFIX_BYTES - len(data))
            if not part:
                return None
            data += part
        length = wire.ack_length(bytes(data))
        data = bytearray()
        while len(data) < length:
            part = sock.recv(length - len(data))
            if not part:
                return None
            data += part
    except ConnectionResetError:
        return None
    return wire.decode_ack(bytes(data))


def exchange(address: wire.Address, data: bytes, source: str | None = None) -> wire.Ack | None:
    """Send ``data`` on a new connection (from ``source``), then the ack."""
    with connect(address, source) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(data)
        return read_ack(sock)


async def in_thread(fn, *args):
    return await anyio.to_thread.run_sync(fn, *args)


@contextlib.asynccontextmanager
async def serving(receiver, address: wire.Address = LOCAL):
    """The receiver listening at ``address`` (default: loopback TCP, any port) in the
    test's event loop, under a hang guard; yields the bound address."""
    with anyio.fail_after(60):  # a hang guard
        async with anyio.create_task_group() as tg:
            yield await tg.start(receiver.serve, address)
            tg.cancel_scope.cancel()


def tensors_of(job: BandJob) -> list[BandTensor]:
    """A sender's band for the tiny Llama at P = 1: the tokens and both layers' k/v."""
    n = job.num_tokens
    out = [BandTensor(-1, "tokens", "int32", (n,),
                      lambda: torch.arange(n, dtype=torch.int32))]  # fmt: skip
    for layer in (0, 1):
        for name in ("k", "v"):
            out.append(BandTensor(layer, name, "float32", (n, 1, 4),
                                  lambda v=float(layer): torch.full((n, 1, 4), v)))  # fmt: skip
    return out
