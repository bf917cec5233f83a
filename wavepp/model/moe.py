"""Mixture-of-experts MLPs of the three families, under their checkpoint names.

Routing:
- ``kimi``: sigmoid scores, top-k over scores + correction bias within the best expert
  groups, weights renormalized and scaled by ``routed_scaling_factor``; shared experts.
- ``qwen``: softmax, top-k, optionally renormalized; a shared expert behind a sigmoid gate.
- ``minimax``: sigmoid scores, top-k over scores + correction bias, renormalized.

Over a stage's tensor-parallel ranks (``tp``, ``wavepp.model.tp``) the experts are
spread (rank r holds experts ``[r E / T, (r + 1) E / T)``, under their global numbers):
every rank routes every token over all experts, runs the copies routed to its own, adds
its slice of the shared expert(s) and returns that partial sum; the executor reduces it
once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from wavepp.model.common import SwiGLU
from wavepp.model.tp import NO_TP, TPGroup

_EXPERT_NAMES = {
    "kimi": ("w1", "w3", "w2"),
    "minimax": ("w1", "w3", "w2"),
    "qwen": ("gate_proj", "up_proj", "down_proj"),
}


class Router(nn.Module):
    def __init__(self, d_model: int, num_experts: int, with_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, d_model))
        if with_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))


class SparseMoE(nn.Module):
    def __init__(
        self,
        routing: str,
        d_model: int,
        d_expert: int,
        num_experts: int,
        top_k: int,
        shared_ff: int = 0,
        norm_topk: bool = True,
        scaling: float = 1.0,
        num_groups: int = 1,
        topk_groups: int = 1,
        tp: TPGroup = NO_TP,
    ) -> None:
        super().__init__()
        if routing not in _EXPERT_NAMES:
            raise ValueError(f"unknown routing {routing!r}; known: {sorted(_EXPERT_NAMES)}")
        if num_experts % num_groups:
            raise ValueError(f"{num_experts} experts do not split into {num_groups} groups")
        self.routing, self.top_k, self.num_experts = routing, top_k, num_experts
        self.norm_topk, self.scaling = norm_topk, scaling
        self.num_groups, self.topk_groups = num_groups, topk_groups
        self.gate = Router(d_model, num_experts, with_bias=routing == "kimi")
        if routing == "minimax":
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))
        names = _EXPERT_NAMES[routing]
        local = num_experts // tp.size
        self.first_expert, self.num_local_experts = tp.rank * local, local
        self.experts = nn.ModuleDict({
            str(e): SwiGLU(d_model, d_expert, names)
            for e in range(self.first_expert, self.first_expert + local)
        })  # fmt: skip
        shared_ff //= tp.size
        if routing == "kimi" and shared_ff:
            self.shared_experts = SwiGLU(d_model, shared_ff)
        if routing == "qwen" and shared_ff:
            self.shared_expert = SwiGLU(d_model, shared_ff)
            self.shared_expert_gate = nn.Linear(d_model, 1, bias=False)
        self.shared_ff = shared_ff
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None

    def prepare(self) -> None:
        """Stack the experts' weights once the checkpoint is loaded."""
        gate, up, down = _EXPERT_NAMES[self.routing]
        experts = list(self.experts.values())  # this rank's, in order
        self._stacked = (
            torch.stack(
                [torch.cat([getattr(e, gate).weight, getattr(e, up).weight]) for e in experts]
            ),  # [E, 2 I, D]
            torch.stack([getattr(e, down).weight for e in experts]),  # [E, D, I]
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [n, D] -> (weights [n, k], expert ids [n, k])."""
        logits = F.linear(x.float(), self.gate.weight.float())  # [n, E]
        if self.routing == "qwen":
            probs = logits.softmax(-1)
            weights, ids = probs.topk(self.top_k, dim=-1)
            if self.norm_topk:
                weights = weights / weights.sum(-1, keepdim=True)
            return weights.to(x.dtype), ids
        scores = logits.sigmoid()
        if self.routing == "minimax":
            _, ids = (scores + self.e_score_correction_bias).topk(self.top_k, dim=-1, sorted=False)
            weights = scores.gather(1, ids)
            return weights / weights.sum(-1, keepdim=True), ids
        choice = scores + self.gate.e_score_correction_bias
        n, groups = x.shape[0], self.num_groups
        if groups > 1:
            group_scores = choice.view(n, groups, -1).topk(2, dim=-1)[0].sum(-1)  # [n, groups]
            best = group_scores.topk(self.topk_groups, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = choice.masked_fill(
                ~keep.repeat_interleave(self.num_experts // groups, 1), -torch.inf
            )
        ids = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [n, D]
        if self._stacked is None:
            self.prepare()
        gate_up, down = self._stacked
        weights, ids = self.route(x)
        flat = ids.reshape(-1)  # [n k]: the expert of each routed copy
        experts = self.num_local_experts
        if experts == self.num_experts:
            order = flat.argsort(stable=True)
            copies = order  # the routed copies, grouped by expert
        else:  # the copies routed to this rank's experts, numbered from 0 here
            mine = torch.nonzero((flat >= self.first_expert)
                                 & (flat < self.first_expert + experts)).squeeze(1)  # fmt: skip
            flat = flat[mine] - self.first_expert
            order = flat.argsort(stable=True)
            copies = mine[order]
        token = copies // self.top_k  # token of each routed copy, grouped by expert
        counts = torch.bincount(flat, minlength=experts)
        out = torch.zeros_like(x)
        scale = weights.reshape(-1)[copies, None].to(x.dtype)  # [copies, 1]
        widest = int(counts.max())
        if widest * experts <= 2 * flat.numel():
            # Balanced enough: all experts in one batched matmul over padded groups.
            starts = torch.cumsum(counts, 0) - counts
            rank = torch.arange(flat.numel(), device=x.device) - starts[flat[order]]
            padded = x.new_zeros(experts, widest, x.shape[1])  # [E, widest, D]
            padded[flat[order], rank] = x[token]
            g, u = torch.bmm(padded, gate_up.transpose(1, 2)).chunk(2, dim=-1)
            y = torch.bmm(F.silu(g) * u, down.transpose(1, 2))[flat[order], rank]
            out.index_add_(0, token, y * scale)
        else:
            at = 0
            for e, count in enumerate(counts.tolist()):  # one matmul pair per expert hit
                if not count:
                    continue
                rows = slice(at, at + count)
                at += count
                g, u = F.linear(x[token[rows]], gate_up[e]).chunk(2, dim=-1)
                y = F.linear(F.silu(g) * u, down[e]) * scale[rows]
                out.index_add_(0, token[rows], y)
        if self.routing == "kimi" and self.shared_ff:
            out = out + self.shared_experts(x)
        if self.routing == "qwen" and self.shared_ff:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
