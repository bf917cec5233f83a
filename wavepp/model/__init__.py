"""Published model families: Kimi Linear (KDA + MLA + MoE), Qwen3-Next (Gated DeltaNet,
gated attention, MoE with a shared expert) and MiniMax-M2 (attention + MoE), loaded
from Hugging Face checkpoints as ``save_pretrained`` writes them."""

from wavepp.model.config import FAMILIES, FamilyConfig, config_from_family
from wavepp.model.family import (
    FamilyStage,
    build_family_stage,
    family_random_weights,
    family_reference_logits,
)

__all__ = [
    "FAMILIES",
    "FamilyConfig",
    "FamilyStage",
    "build_family_stage",
    "config_from_family",
    "family_random_weights",
    "family_reference_logits",
]
