"""Handing caches on, as a run sets it up: where a request's bands go, and the model
fingerprint every band carries (``docs/handoff.md``)."""

from __future__ import annotations

import json
from pathlib import Path

import attrs

from wavepp.errors import RequestRejected
from wavepp.handoff import wire
from wavepp.workload import RequestSpec


@attrs.frozen
class BandServers:
    """Where a run's stages serve bands to decoders that pull them (``pull:`` targets),
    as rank 0 agreed it at setup."""

    addresses: tuple[str, ...]  # stage s's band server, as decoders reach it
    lease_s: float  # how long a band waits for its decoder after its last chunk, seconds


class HandoffTargets:
    """Rank 0: the address a request's cache goes to, checked at intake.

    A request names an address (``unix:/path``, ``tcp://host:port``), asks for its
    cache to be held on the stages' band servers until a decoder pulls it (``pull:``,
    a run with ``--handoff-serve``), or asks for the run's default (``True``:
    ``--handoff-to``).
    """

    def __init__(self, default: str | None, pulls: bool = False) -> None:
        """``pulls``: the stages serve bands to decoders (``--handoff-serve``)."""
        self.default = default
        self.pulls = pulls

    def __call__(self, spec: RequestSpec) -> str:
        asked = spec.handoff
        if asked is True:
            if self.default is None:
                raise RequestRejected("handoff: true needs a default target (--handoff-to "
                                      "ADDRESS)", "invalid")  # fmt: skip
            return self.default
        if not isinstance(asked, str):
            raise RequestRejected(f"handoff must be an address string or true, got {asked!r}",
                                  "invalid")  # fmt: skip
        if asked == wire.PULL_TARGET:
            if not self.pulls:
                raise RequestRejected("handoff: pull: needs the stages' band servers "
                                      "(--handoff-serve)", "invalid")  # fmt: skip
            return asked
        try:
            wire.parse_address(asked)
        except ValueError as error:
            raise RequestRejected(f"handoff: {error}", "invalid") from None
        return asked


def model_hf_config(model: str, cfg) -> dict | None:
    """The Hugging Face ``config.json`` dict of the model this run computes with (a
    checkpoint directory's own, or the built-in model's equivalent); None for WavePP's
    own gated-linear-attention layout, which no Hugging Face class decodes."""
    from wavepp.model import hf_config

    path = Path(model) / "config.json"
    if path.exists():
        return json.loads(path.read_text())
    return hf_config(cfg)


def fingerprint(model: str, cfg, dtype: str) -> wire.Fingerprint:
    """The fingerprint every band of this run carries."""
    hf = model_hf_config(model, cfg)
    if hf is not None:
        return wire.fingerprint_from_hf_config(hf, dtype)
    kinds = "".join(cfg.kind(i) for i in range(cfg.num_layers))
    return wire.Fingerprint(
        architecture=f"wavepp:{model if '/' not in model else Path(model).name}",
        num_layers=cfg.num_layers, hidden_size=cfg.d_model, vocab_size=cfg.vocab_size,
        layer_kinds=kinds, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, kv_lora_rank=0, rope_dim=0, dtype=dtype,
    )  # fmt: skip
