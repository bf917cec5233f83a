"""The fields of a model's config file, checked before anything is built from them.

A ``config.json`` (or WavePP's ``wavepp_config.json``) is input: a field of the wrong
type, out of range or not finite is refused here, naming the file and the field, rather
than reaching a tensor's shape or a norm's epsilon. :func:`checked_fields` checks every
field WavePP reads that the file holds (the readers in ``wavepp.model.registry`` give
the defaults of those it lacks) and returns the fields with integral numbers as ints
(``1e9`` in JSON is a float). Fields WavePP does not read are not looked at.
"""

from __future__ import annotations

import math
from collections.abc import Callable


class CheckpointError(ValueError):
    """A model directory WavePP cannot run, in one line naming the file and the field or
    tensor."""


# One rule per kind of field: (what it must be, whether a value is one).
_Rule = tuple[str, Callable[[object], bool]]


def _integer(value: object) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, float) and math.isfinite(value) and value.is_integer())


POSITIVE: _Rule = ("a positive integer", lambda v: _integer(v) and v >= 1)
COUNT: _Rule = ("an integer ≥ 0", lambda v: _integer(v) and v >= 0)
SCALE: _Rule = ("a finite number > 0", lambda v: isinstance(v, int | float)
                and not isinstance(v, bool) and math.isfinite(v) and v > 0)  # fmt: skip
FRACTION: _Rule = ("a number in (0, 1]", lambda v: isinstance(v, int | float)
                   and not isinstance(v, bool) and 0 < v <= 1)  # fmt: skip
FLAG: _Rule = ("true or false", lambda v: isinstance(v, bool))
TEXT: _Rule = ("a string", lambda v: isinstance(v, str))
LIST: _Rule = ("a list", lambda v: isinstance(v, list))
TABLE: _Rule = ("an object", lambda v: isinstance(v, dict))

FIELDS: dict[str, _Rule] = {
    # Hugging Face names (every family WavePP reads)
    "model_type": TEXT, "hidden_act": TEXT,
    "vocab_size": POSITIVE, "hidden_size": POSITIVE, "num_hidden_layers": POSITIVE,
    "num_attention_heads": POSITIVE, "num_key_value_heads": POSITIVE, "head_dim": POSITIVE,
    "intermediate_size": POSITIVE, "moe_intermediate_size": POSITIVE,
    "kv_lora_rank": POSITIVE, "q_lora_rank": POSITIVE, "qk_nope_head_dim": POSITIVE,
    "qk_rope_head_dim": POSITIVE, "v_head_dim": POSITIVE, "rotary_dim": POSITIVE,
    "linear_num_heads": POSITIVE, "linear_head_dim": COUNT,
    "linear_num_value_heads": POSITIVE, "linear_num_key_heads": POSITIVE,
    "linear_key_head_dim": POSITIVE, "linear_value_head_dim": POSITIVE,
    "linear_conv_kernel_dim": POSITIVE, "decoder_sparse_step": POSITIVE,
    "num_experts": COUNT, "num_local_experts": COUNT, "num_experts_per_tok": COUNT,
    "num_experts_per_token": COUNT, "num_shared_experts": COUNT, "n_shared_experts": COUNT,
    "shared_expert_intermediate_size": COUNT, "num_expert_group": POSITIVE,
    "n_group": POSITIVE, "topk_group": POSITIVE,
    "rms_norm_eps": SCALE, "rope_theta": SCALE, "routed_scaling_factor": SCALE,
    "partial_rotary_factor": FRACTION,
    "tie_word_embeddings": FLAG, "attention_bias": FLAG, "mlp_bias": FLAG,
    "norm_topk_prob": FLAG, "moe_renormalize": FLAG,
    "layer_types": LIST, "mlp_layer_types": LIST, "mlp_only_layers": LIST,
    "rope_parameters": TABLE, "rope_scaling": TABLE, "linear_attn_config": TABLE,
    # WavePP's own layout (wavepp.model.registry.llama_config)
    "d_model": POSITIVE, "num_layers": POSITIVE, "num_heads": POSITIVE,
    "num_kv_heads": POSITIVE, "d_ff": POSITIVE, "linear_heads": COUNT, "norm_eps": SCALE,
    "tie_embeddings": FLAG, "pattern": TEXT,
}  # fmt: skip
# Inside the tables above: RoPE's parameters, Kimi Linear's linear-attention block.
INNER: dict[str, dict[str, _Rule]] = {
    "rope_parameters": {"rope_theta": SCALE, "partial_rotary_factor": FRACTION,
                        "rope_type": TEXT, "type": TEXT},
    "rope_scaling": {"rope_theta": SCALE, "partial_rotary_factor": FRACTION,
                     "rope_type": TEXT, "type": TEXT},
    "linear_attn_config": {"num_heads": POSITIVE, "head_dim": POSITIVE,
                           "short_conv_kernel_size": POSITIVE},
}  # fmt: skip
# Counts that become Python objects (a layer's modules, an expert's), not just shapes:
# bounded before anything is built, so a config of absurd sizes is refused, not run out of
# memory describing it.
MAXIMA = {"num_hidden_layers": 4096, "num_layers": 4096, "num_experts": 16384,
          "num_local_experts": 16384}  # fmt: skip
# Fields a file may set to null, meaning "the default" (as transformers writes them).
NULLABLE = frozenset({"head_dim", "num_key_value_heads", "q_lora_rank", "rotary_dim",
                      "rope_parameters", "rope_scaling", "linear_attn_config", "topk_group",
                      "num_expert_group", "n_group", "mlp_only_layers",
                      "partial_rotary_factor"})  # fmt: skip


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check(file: str, where: str, value: object, rule: _Rule) -> object:
    what, ok = rule
    if not ok(value):
        raise CheckpointError(f"{file}: field {where}: {_shown(value)} is not {what}")
    return int(value) if rule in (POSITIVE, COUNT) else value


def checked_fields(data: object, file: str) -> dict:
    """``data`` (a config file's JSON) with every field WavePP reads checked, integral
    numbers as ints; :class:`CheckpointError` naming ``file`` and the first bad field."""
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: not a JSON object but {type(data).__name__}")
    out = dict(data)
    for key, value in data.items():
        rule = FIELDS.get(key)
        if rule is None:
            continue
        if value is None:
            if key not in NULLABLE:
                raise CheckpointError(f"{file}: field {key}: null is not {rule[0]}")
            continue
        out[key] = _check(file, key, value, rule)
        if key in MAXIMA and out[key] > MAXIMA[key]:
            raise CheckpointError(f"{file}: field {key}: {out[key]:,} is more than "
                                  f"{MAXIMA[key]:,}")  # fmt: skip
        for inner, inner_rule in INNER.get(key, {}).items():
            if out[key].get(inner) is not None:
                out[key] = {**out[key], inner: _check(file, f"{key}.{inner}", out[key][inner],
                                                      inner_rule)}  # fmt: skip
    return out
