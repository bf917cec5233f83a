"""Handing caches on, as a run sets it up: where a request's bands go, and the model
fingerprint every band carries (``docs/handoff.md``)."""

from __future__ import annotations

import json
from pathlib import Path

from wavepp.errors import RequestRejected
from wavepp.handoff import wire
from wavepp.workload import RequestSpec

FORMATS = ("wavepp", "vllm-example")


class HandoffTargets:
    """Rank 0: the address a request's cache goes to, checked at intake.

    A request names an address (``unix:/path``, ``tcp://host:port``) or asks for the
    run's default (``True``): ``--handoff-to``, or with ``--handoff-format vllm-example``
    the request's own folder under ``--handoff-dir``, named as vLLM's ``ExampleConnector``
    names it (a hash of the block-aligned prompt, ``--handoff-block-size``).
    """

    def __init__(self, default: str | None, fmt: str, folder: str | None, block_size: int,
                 layer_kinds: str) -> None:  # fmt: skip
        self.default = default
        self.format = fmt
        self.folder = folder
        self.block_size = block_size
        self.layer_kinds = layer_kinds  # the model's, one char per layer (A, M, L)

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
        from wavepp.handoff.vllm_example import folder_name

        if set(self.layer_kinds) != {"A"}:
            raise RequestRejected("handoff: vLLM's example layout holds attention-only models; "
                                  f"this one has layers {self.layer_kinds}", "invalid")  # fmt: skip
        if spec.num_tokens <= self.block_size:
            raise RequestRejected(f"handoff: a prompt of {spec.num_tokens} tokens has no full "
                                  f"vLLM block of {self.block_size} before its last token",
                                  "invalid")  # fmt: skip
        name = folder_name(spec.tokens.tolist(), self.block_size)
        return f"dir:{Path(self.folder).resolve() / name}"


def model_hf_config(model: str, cfg) -> dict | None:
    """The Hugging Face ``config.json`` dict of the model this run computes with (a
    checkpoint directory's own, or the built-in model's equivalent); None for WavePP's
    own gated-linear-attention layout, which no Hugging Face class decodes."""
    from wavepp.exec.families import FamilyConfig
    from wavepp.exec.families.config import kimi_hf_config

    path = Path(model) / "config.json"
    if path.exists():
        return json.loads(path.read_text())
    if isinstance(cfg, FamilyConfig):
        return kimi_hf_config(cfg) if cfg.family == "kimi_linear" else None
    if set(cfg.pattern) == {"A"}:
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "num_hidden_layers": cfg.num_layers, "hidden_size": cfg.d_model,
            "vocab_size": cfg.vocab_size, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        }  # fmt: skip
    return None


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
