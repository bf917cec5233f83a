"""Handing caches on, as a run sets it up: where a request's bands go, and the model
fingerprint every band carries (``docs/handoff.md``)."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import time
from pathlib import Path

import attrs

from wavepp.errors import RequestRejected
from wavepp.handoff import wire
from wavepp.workload import RequestSpec

FORMATS = ("wavepp", "vllm-example")
STAGING = ".wavepp-staging"  # under --handoff-dir: folders being written


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
    a run with ``--handoff-serve``), or asks for the
    run's default (``True``): ``--handoff-to``, or with ``--handoff-format vllm-example``
    folders under ``--handoff-dir`` named as vLLM's ``ExampleConnector`` names them (a
    hash of the block-aligned prompt, ``--handoff-block-size``).

    vLLM takes a folder that exists as a hit and reads every layer file in it, so the
    stages write into a staging folder of the request's own (under
    ``<dir>/.wavepp-staging/``) and, once every stage's files are in, rank 0 renames it
    into place (:meth:`settled`), one atomic rename per folder vLLM reads; a folder
    already there (the same prompt, handed off before) is kept. A failed or cancelled
    handoff's staging folder is removed.
    """

    def __init__(self, default: str | None, fmt: str, folder: str | None, block_size: int,
                 layer_kinds: str, pulls: bool = False) -> None:  # fmt: skip
        """``pulls``: the stages serve bands to decoders (``--handoff-serve``)."""
        self.default = default
        self.pulls = pulls
        self.format = fmt
        self.folder = Path(folder).resolve() if folder else None
        self.block_size = block_size
        self.layer_kinds = layer_kinds  # the model's, one char per layer (A, M, L)
        self._staging = (self.folder / STAGING / f"{os.getpid()}-{time.time_ns()}"
                         if self.folder else None)  # fmt: skip
        self._next = itertools.count()

    def __call__(self, spec: RequestSpec) -> str:
        asked = spec.handoff
        if asked is True:
            if self.format == "vllm-example":
                return self._folder(spec)
            if self.default is None:
                raise RequestRejected("handoff: true needs a default target (--handoff-to "
                                      "ADDRESS, or --handoff-format vllm-example "
                                      "--handoff-dir DIR)", "invalid")  # fmt: skip
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
            address = wire.parse_address(asked)
        except ValueError as error:
            raise RequestRejected(f"handoff: {error}", "invalid") from None
        if address.kind == "dir":
            raise RequestRejected("handoff: a dir: target is set for the whole run "
                                  "(--handoff-format vllm-example --handoff-dir DIR; then "
                                  '"handoff": true)', "invalid")  # fmt: skip
        return asked

    def _folder(self, spec: RequestSpec) -> str:
        if set(self.layer_kinds) != {"A"}:
            raise RequestRejected("handoff: vLLM's example layout holds attention-only models; "
                                  f"this one has layers {self.layer_kinds}", "invalid")  # fmt: skip
        if spec.num_tokens < self.block_size + 1:
            raise RequestRejected(f"handoff: a prompt of {spec.num_tokens} tokens has no full "
                                  f"vLLM block of {self.block_size} before its last token, so "
                                  "vLLM would load nothing", "invalid")  # fmt: skip
        return f"dir:{self._staging / str(next(self._next))}"

    def settled(self, spec: RequestSpec, target: str, ok: bool) -> None:
        """A request's handoff ended (``ok``: every stage's band went through). For a
        vLLM folder: rename the staging folders into place, or remove them."""
        if not target.startswith("dir:"):
            return
        from wavepp.handoff.vllm_example import folder_lengths, folder_name

        staging = Path(target.removeprefix("dir:"))
        if ok:
            tokens = spec.tokens.tolist()
            for n in folder_lengths(spec.num_tokens, self.block_size):
                final = self.folder / folder_name(tokens[:n], self.block_size)
                with contextlib.suppress(FileNotFoundError, FileExistsError, OSError):
                    if not final.exists():
                        os.rename(staging / str(n), final)
        shutil.rmtree(staging, ignore_errors=True)


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
