"""One stage's bands for the sender tests: a tiny Llama's fingerprint, two layers of k/v
rows whose values say where they are, and a job that asks for them."""

from __future__ import annotations

import torch

from wavepp.handoff import wire
from wavepp.handoff.base import BandJob, BandTensor

FP = wire.Fingerprint(architecture="LlamaForCausalLM", num_layers=2, hidden_size=8,
                      vocab_size=64, layer_kinds="AA", num_heads=2, num_kv_heads=1,
                      head_dim=4, kv_lora_rank=0, rope_dim=0, dtype="float32")  # fmt: skip


def band_of(job: BandJob) -> list[BandTensor]:
    """Two layers of k/v rows, 1 x 4 per token, with values that say where they are."""
    n = job.num_tokens
    out = []
    for layer in (0, 1):
        for j, name in enumerate(("k", "v")):
            value = torch.arange(n * 4, dtype=torch.float32).reshape(n, 1, 4) + 1000 * layer + j

            out.append(BandTensor(layer, name, "float32", (n, 1, 4), lambda v=value: v))
    return out


def job(rid: str, target: str, n: int = 10) -> BandJob:
    return BandJob(rid, target, n, (0,), {}, None, first_token=3, top_logit=1.5)
