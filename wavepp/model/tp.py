"""Tensor parallelism inside a stage: how one stage's layers split over its T ranks.

The standard Megatron split, by heads and by width, so that every rank computes a
partial sum of each mixer's and each MLP's output and one all-reduce per mixer and one
per MLP (``TorchExecutor``) completes it:

- **attention** (GQA, gated, MiniMax-M2's): q/k/v (and the output gate, which q_proj
  interleaves per head) column-parallel by head, ``o_proj`` row-parallel; Qwen3-Next's
  per-head q/k norms (weight ``[head_dim]``) replicated, MiniMax-M2's norms over all
  heads split with the heads (their sums of squares are all-reduced,
  ``GQAttention``). The KV pool holds the rank's KV heads: ``[rows, KV / T, hd]``.
- **MLA** (Kimi Linear): the latent projection (``kv_a_proj_with_mqa``,
  ``kv_a_layernorm``, and ``q_a_proj`` / ``q_a_layernorm`` where present) replicated —
  every rank keeps the whole latent cache, as vLLM does, since the latent is shared by
  all heads and is what makes the cache small; ``q_proj`` / ``q_b_proj`` and
  ``kv_b_proj`` split by head, ``o_proj`` row-parallel.
- **KDA, Gated DeltaNet, gated linear attention**: by head, states and snapshots with
  them (``[H / T, dk, dv]``). KDA: q/k/v, their convolutions, ``f_b`` / ``g_b``,
  ``b_proj``, ``dt_bias`` and ``A_log`` by head; the low-rank ``f_a`` / ``g_a`` and
  the per-head-dim output norm replicated. Gated DeltaNet: ``in_proj_qkvz`` and
  ``in_proj_ba`` are grouped per key head in the checkpoint, so a contiguous run of key
  heads is a contiguous run of rows; the convolution's channels are q | k | v, each
  segment split by head; ``A_log`` / ``dt_bias`` per value head. Gated linear
  attention: q/k/v/g and the decay ``a_proj`` by head.
- **MLPs**: gate/up column-parallel, down row-parallel. **MoE**: experts spread over
  the ranks (rank r holds experts ``[r E / T, (r + 1) E / T)``, whole), the router
  replicated (every rank routes every token the same way and runs the copies its
  experts got); shared experts split like an MLP, Qwen3-Next's ``shared_expert_gate``
  replicated (a per-token scalar).
- **embeddings, the final norm and the LM head** replicated: the stage boundary and the
  logits are whole on every rank of a stage.

Tensors keep their checkpoint names on every rank (a rank's experts keep their global
numbers), so a rank could read just its slices from the checkpoint.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from wavepp.model.config import GROUPED, ModelConfig
from wavepp.transport.base import plane_error


class TPGroup(Protocol):
    """The ranks of one stage: this rank's place among them and their sum."""

    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the stage's ranks (every rank calls it, same shape)."""
        ...


class NoTP:
    """A stage on one rank: nothing is split, nothing reduced."""

    rank = 0
    size = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


NO_TP = NoTP()


class DistTPGroup:
    """A stage's ranks as a ``torch.distributed`` process group (Gloo on CPU, NCCL on
    GPU), made by the runtime."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        try:
            dist.all_reduce(x, group=self.group)
        except RuntimeError as error:  # a rank of the stage gone: the watchdog names it
            raise plane_error(f"the all-reduce over this stage's {self.size} TP ranks",
                              error) from None  # fmt: skip
        return x


def check_tp(cfg: ModelConfig, size: int) -> None:
    """ValueError naming every count of ``cfg`` that ``size`` ranks cannot split evenly."""
    if size < 1:
        raise ValueError(f"--tp {size}: a stage needs at least one rank")
    counts: dict[str, int] = {}
    mixers = set(cfg.mixers)
    if mixers & {*GROUPED, "mla"}:
        counts["attention heads (num_heads)"] = cfg.num_heads
    if mixers & set(GROUPED):
        counts["KV heads (num_kv_heads)"] = cfg.num_kv_heads
    if mixers & {"gla", "kda", "gdn"}:
        counts["linear-attention heads (linear_heads)"] = cfg.linear_heads
    if "gdn" in mixers:
        counts["linear-attention key heads (linear_k_heads)"] = cfg.linear_k_heads
    if "dense" in cfg.mlps:
        counts["MLP width (d_ff)"] = cfg.d_ff
    if "moe" in cfg.mlps:
        counts["experts (num_experts)"] = cfg.num_experts
        if cfg.shared_ff:
            counts["shared-expert width (shared_ff)"] = cfg.shared_ff
    bad = [f"{n} {name}" for name, n in counts.items() if n % size]
    if bad:
        raise ValueError(f"--tp {size} must divide every count a stage splits over its ranks; "
                         f"these do not divide by {size}: {', '.join(bad)}")  # fmt: skip


def shard_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], rank: int,
                  size: int) -> dict[str, torch.Tensor]:  # fmt: skip
    """Rank ``rank``'s slice of every tensor of the full checkpoint, under the same
    names: split tensors as views of the full ones, replicated ones as they are; experts
    of other ranks left out. ValueError for a name the split does not know."""
    check_tp(cfg, size)
    out = {}
    for name, tensor in weights.items():
        rule = _rule(cfg, name, size)
        if rule is _EXPERT:
            if _expert(name) // (cfg.num_experts // size) == rank:
                out[name] = tensor
        elif rule is _REPLICATED:
            out[name] = tensor
        else:
            out[name] = _slice(tensor, rule, rank, size)
    return out


# A rule is how a tensor splits: replicated, one of an expert's (whole, on one rank),
# or (dim, segment sizes): each segment of ``dim`` (the whole dim: one segment) cut in
# ``size`` equal runs, the rank's runs concatenated.
_REPLICATED = "replicated"
_EXPERT = "expert"
_ROWS = (0, None)  # column-parallel: output rows by head / width
_COLS = (1, None)  # row-parallel: input columns by head / width

_GQA = {"q_proj.weight": _ROWS, "k_proj.weight": _ROWS, "v_proj.weight": _ROWS,
        "o_proj.weight": _COLS}  # fmt: skip
_SWIGLU = {"gate_proj.weight": _ROWS, "up_proj.weight": _ROWS, "down_proj.weight": _COLS,
           "w1.weight": _ROWS, "w3.weight": _ROWS, "w2.weight": _COLS}  # fmt: skip
_MIXER_RULES = {
    "gqa": _GQA,
    "gattn": {**_GQA, "q_norm.weight": _REPLICATED, "k_norm.weight": _REPLICATED},
    "mmattn": {**_GQA, "q_norm.weight": _ROWS, "k_norm.weight": _ROWS},
    "mla": {"q_proj.weight": _ROWS, "q_a_proj.weight": _REPLICATED,
            "q_a_layernorm.weight": _REPLICATED, "q_b_proj.weight": _ROWS,
            "kv_a_proj_with_mqa.weight": _REPLICATED, "kv_a_layernorm.weight": _REPLICATED,
            "kv_b_proj.weight": _ROWS, "o_proj.weight": _COLS},
    "gla": {"q_proj.weight": _ROWS, "k_proj.weight": _ROWS, "v_proj.weight": _ROWS,
            "g_proj.weight": _ROWS, "a_proj.weight": _ROWS, "a_proj.bias": _ROWS,
            "o_proj.weight": _COLS},
    "kda": {"q_proj.weight": _ROWS, "k_proj.weight": _ROWS, "v_proj.weight": _ROWS,
            "q_conv1d.weight": _ROWS, "k_conv1d.weight": _ROWS, "v_conv1d.weight": _ROWS,
            "f_a_proj.weight": _REPLICATED, "f_b_proj.weight": _ROWS, "dt_bias": _ROWS,
            "A_log": (2, None), "b_proj.weight": _ROWS, "g_a_proj.weight": _REPLICATED,
            "g_b_proj.weight": _ROWS, "o_norm.weight": _REPLICATED, "o_proj.weight": _COLS},
    "gdn": {"in_proj_qkvz.weight": _ROWS, "in_proj_ba.weight": _ROWS, "dt_bias": _ROWS,
            "A_log": _ROWS, "norm.weight": _REPLICATED, "out_proj.weight": _COLS},
}  # fmt: skip
_MOE_REPLICATED = ("gate.weight", "gate.e_score_correction_bias", "e_score_correction_bias",
                   "shared_expert_gate.weight")  # fmt: skip


def _expert(name: str) -> int:
    parts = name.split(".")
    return int(parts[parts.index("experts") + 1])


def _rule(cfg: ModelConfig, name: str, size: int):
    parts = name.split(".")
    if parts[:2] != ["model", "layers"]:
        return _REPLICATED  # embeddings, final norm, head (the "lm_head" outside "model")
    layer, module, rest = int(parts[2]), parts[3], ".".join(parts[4:])
    if module in ("input_layernorm", "post_attention_layernorm"):
        return _REPLICATED
    rule = None
    if module in ("self_attn", "linear_attn"):
        kind = cfg.mixers[layer]
        rule = _MIXER_RULES[kind].get(rest)
        if kind == "gdn" and rest == "conv1d.weight":  # channels q | k | v, each by head
            key, value = cfg.linear_k_heads * cfg.linear_k_dim, cfg.linear_heads * cfg.linear_v_dim
            rule = (0, (key, key, value))
    elif module in ("mlp", "block_sparse_moe"):
        if rest in _MOE_REPLICATED:
            rule = _REPLICATED
        elif rest.startswith("experts."):
            rule = _EXPERT
        else:  # the dense MLP, or the shared expert(s): like an MLP
            rule = _SWIGLU.get(rest.removeprefix("shared_experts.").removeprefix("shared_expert."))
    if rule is None:
        raise ValueError(f"{name}: no tensor-parallel split known for it")
    return rule


def _slice(tensor: torch.Tensor, rule: tuple[int, tuple[int, ...] | None], rank: int,
           size: int) -> torch.Tensor:  # fmt: skip
    dim, segments = rule
    pieces = tensor.split(list(segments), dim=dim) if segments else (tensor,)
    mine = [p.chunk(size, dim=dim)[rank] for p in pieces]
    return mine[0] if len(mine) == 1 else torch.cat(mine, dim=dim)


# -- a stage's cache, put back together (the handoff of a TP stage) ----------------------


def cache_rule(cfg: ModelConfig, layer: int, name: str):
    """How a cache tensor of ``layer`` is split over a stage's ranks, as :func:`_slice`
    splits weights: ``"replicated"`` (MLA's latent, whole on every rank) or (dim, segment
    sizes of the whole tensor). ``name``: a paged entry (``k``, ``v``, ``latent``) as
    ``[tokens, heads, dim]``, or a recurrent state part (``delta`` / ``state``
    ``[heads, dk, dv]``, ``conv`` ``[K - 1, channels]``)."""
    kind = cfg.mixers[layer]
    if name == "latent":
        return _REPLICATED
    if name in ("k", "v"):
        return (1, None)
    if name in ("delta", "state"):
        return (0, None)
    if name == "conv" and kind == "kda":
        inner = cfg.linear_heads * cfg.linear_k_dim
        return (1, (inner, inner, inner))
    if name == "conv" and kind == "gdn":
        key, value = cfg.linear_k_heads * cfg.linear_k_dim, cfg.linear_heads * cfg.linear_v_dim
        return (1, (key, key, value))
    raise ValueError(f"layer {layer} ({kind}): no tensor-parallel split known for {name!r}")


def whole_shape(rule, shard: tuple[int, ...], size: int) -> tuple[int, ...]:
    """The whole tensor's shape, from one rank's shard."""
    if rule is _REPLICATED:
        return shard
    dim = rule[0]
    return (*shard[:dim], shard[dim] * size, *shard[dim + 1 :])


def gather_shards(rule, shards: list[torch.Tensor]) -> torch.Tensor:
    """The whole tensor from every rank's shard, in rank order (the inverse of the split)."""
    if rule is _REPLICATED:
        return shards[0]
    dim, segments = rule
    if not segments:
        return torch.cat(shards, dim=dim)
    size = len(shards)
    pieces = [s.split([n // size for n in segments], dim=dim) for s in shards]
    return torch.cat([p[i] for i in range(len(segments)) for p in pieces], dim=dim)


def replicated(rule) -> bool:
    return rule is _REPLICATED
