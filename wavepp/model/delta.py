"""Chunk-parallel gated delta rule (Gated DeltaNet and Kimi Delta Attention).

Per head, with a k-dim x v-dim state S, for t = 1..T:

    S_t = diag(exp(g_t)) S_{t-1}                       (decay; g_t <= 0)
    S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T          (delta rule)
    o_t = S_t^T q_t

``g`` is one scalar per head (Gated DeltaNet) or one per key channel (KDA). The prefill
path (:func:`chunk_delta`) cuts the sequence into pieces of at most ``chunk`` tokens and
processes each piece in the chunked WY / UT-transform form: one triangular solve per
piece for the whole piece's pseudo-values, matrix products for the outputs, and a loop
over pieces only to carry the state. Pieces also end at the requested ``cuts`` so that
the state there (a block boundary where a snapshot is taken) comes out exactly.
:func:`recurrent_delta` is the token-by-token recurrence, the reference.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

# Decay factors below exp(-20) ~ 2e-9 are taken as exactly 0: they change nothing a
# float32 sum can hold, and left alone they turn into subnormal numbers, which make
# every CPU matrix product that touches them many times slower.
_LOG_FLOOR = -20.0


def _decay(log_decay: torch.Tensor) -> torch.Tensor:
    """exp(log_decay), flushed to 0 below exp(_LOG_FLOOR); log_decay <= 0 (or -inf)."""
    return torch.where(log_decay > _LOG_FLOOR, log_decay, -torch.inf).exp_()


def _pieces(num_tokens: int, cuts: tuple[int, ...], chunk: int) -> list[tuple[int, int]]:
    """[start, end) pieces of at most ``chunk`` tokens that end at every cut."""
    bounds = sorted({0, num_tokens, *[c for c in cuts if 0 < c < num_tokens]})
    pieces = []
    for a, b in itertools.pairwise(bounds):
        pieces.extend((s, min(b, s + chunk)) for s in range(a, b, chunk))
    return pieces


def chunk_delta(q, k, v, g, beta, state, cuts: tuple[int, ...] = (), chunk: int = 32):
    """q, k: [T, H, dk] (q scaled, both normalized); v: [T, H, dv]; beta: [T, H];
    g: [T, H] (scalar gate) or [T, H, dk] (per-channel gate), log decay <= 0;
    state: [H, dk, dv] before token 0. Returns (o: [T, H, dv], final state,
    [state after token c for c in cuts])."""
    num_tokens, heads, dk = k.shape
    dv = v.shape[-1]
    per_channel = g.dim() == 3
    pieces = _pieces(num_tokens, cuts, chunk)
    num_pieces = len(pieces)
    regular = all(a == n * chunk for n, (a, _) in enumerate(pieces))  # no cut off the grid
    # Everything piece-major, [N, H, C, .], so each step of the state loop reads
    # contiguous tiles. One packed copy of the inputs; padding (beta = 0, k = 0, g = 0)
    # neither decays nor writes the state.
    packed = torch.cat(
        [
            q.float(),
            k.float(),
            v.float(),
            beta.float()[..., None],
            g.float() if per_channel else g.float()[..., None],
        ],
        dim=-1,
    )  # [T, H, 2 dk + dv + 1 + gd]; fmt: skip
    if regular:
        padded = F.pad(packed, (0, 0, 0, 0, 0, num_pieces * chunk - num_tokens))
        slots = padded.view(num_pieces, chunk, heads, -1)
        index = None
    else:
        bounds = torch.tensor(pieces, dtype=torch.long, device=k.device)  # [N, 2]
        index = bounds[:, :1] + torch.arange(chunk, device=k.device)  # token of each slot
        index = index.masked_fill_(index >= bounds[:, 1:], num_tokens)  # padding slots
        slots = F.pad(packed, (0, 0, 0, 0, 0, 1))[index]  # [N, C, H, .]
    slots = slots.transpose(1, 2).contiguous()  # [N, H, C, .]
    qs, ks, vs, bs, gs = slots.split([dk, dk, dv, 1, dk if per_channel else 1], dim=-1)
    gs = gs.cumsum(2) if per_channel else gs[..., 0].cumsum(2)  # log decay within a piece
    k_beta = ks * bs
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).tril()  # j <= i
    if per_channel:
        ut, intra = _pairwise_channel(qs, ks, k_beta, gs, lower)
        g_last = gs[:, :, -1]  # [N, H, dk]
        g_exp = _decay(gs)
        q_in = qs * g_exp
        k_out = ks * _decay(g_last[:, :, None] - gs)
        w_rhs = k_beta * g_exp
        decay_last = _decay(g_last)[..., None]  # [N, H, dk, 1]
    else:
        diff = (gs[..., :, None] - gs[..., None, :]).masked_fill_(~lower, -torch.inf)
        decay = _decay(diff)  # [N, H, C, C]
        ut = (k_beta @ ks.transpose(-1, -2)).mul_(decay)
        intra = (qs @ ks.transpose(-1, -2)).mul_(decay)
        g_last = gs[:, :, -1]  # [N, H]
        g_exp = _decay(gs)[..., None]
        q_in = qs * g_exp
        k_out = ks * _decay(g_last[:, :, None] - gs)[..., None]
        w_rhs = k_beta * g_exp
        decay_last = _decay(g_last)[..., None, None]  # [N, H, 1, 1]
    # UT transform: (I + strictly-lower ut) [U | W] = [v*beta | k*beta*exp(G)], one solve.
    rhs = torch.cat([vs * bs, w_rhs], dim=-1)  # [N, H, C, dv + dk]
    solved = torch.linalg.solve_triangular(ut, rhs, upper=False, unitriangular=True)
    u, w = solved[..., :dv], solved[..., dv:]
    out = torch.empty(num_pieces, heads, chunk, dv, device=k.device)
    s = state.float()
    saved: dict[int, torch.Tensor] = {0: s}  # a cut at 0 is the state given
    cut_set = set(cuts)
    for n in range(num_pieces):  # carry the state piece to piece
        v_new = torch.baddbmm(u[n], w[n], s, alpha=-1)  # [H, C, dv]
        torch.baddbmm(intra[n] @ v_new, q_in[n], s, out=out[n])
        s = torch.baddbmm(s * decay_last[n], k_out[n].transpose(-1, -2), v_new)
        if pieces[n][1] in cut_set:
            saved[pieces[n][1]] = s
    flat = out.transpose(1, 2).reshape(num_pieces * chunk, heads, dv)
    o = flat[:num_tokens] if index is None else flat[(index < num_tokens).reshape(-1)]
    return o.to(v.dtype), s, [saved[c] for c in cuts]


def _pairwise_channel(qs, ks, k_beta, gs, lower, sub: int = 8):
    """Per-channel decays: ut[i, j] = sum_d kb_i k_j exp(G_i - G_j) (j < i) and
    intra[i, j] = sum_d q_i k_j exp(G_i - G_j) (j <= i). qs, ks, k_beta, gs: [H, N, C, dk].

    Within a sub-chunk of ``sub`` tokens the decays are taken pairwise (exact). Across
    sub-chunks J < I they factor through r, the last token of J:
    exp(G_i - G_j) = exp(G_i - G_r) exp(G_r - G_j), both factors <= 1 (no overflow), so
    the off-diagonal blocks are matrix products."""
    heads, num_pieces, chunk, dk = ks.shape
    sub = min(sub, chunk)
    nsub = chunk // sub
    blocks = (heads, num_pieces, nsub, sub, dk)
    g_ref = gs[:, :, sub - 1 :: sub]  # [H, N, nsub, dk]: G at the last token of each J
    # rows i (all tokens) against each reference r_J; clamped where i <= r_J (masked later)
    row_decay = _decay((gs[:, :, None] - g_ref[:, :, :, None]).clamp_(max=0.0))  # [.,nsub,C,dk]
    k_ref = ks.view(blocks) * _decay(g_ref[:, :, :, None] - gs.view(blocks))  # [.,nsub,c,dk]
    left = torch.stack([k_beta, qs])[:, :, :, None]  # [2, H, N, 1, C, dk]
    prod = (left * row_decay) @ k_ref.transpose(-1, -2)  # [2, H, N, nsub, C, c]
    across = torch.arange(chunk, device=ks.device)
    across = across[:, None] // sub > across[None, :] // sub  # sub-chunk I > J
    full = prod.permute(0, 1, 2, 4, 3, 5).reshape(2, heads, num_pieces, chunk, chunk) * across
    # diagonal sub-chunks, exact; exponents clamped at 0 above the diagonal (masked below)
    g_sub = gs.view(blocks)
    kd = _decay((g_sub[..., :, None, :] - g_sub[..., None, :, :]).clamp_(max=0.0))
    kd.mul_(ks.view(blocks)[..., None, :, :])  # [H, N, nsub, c(i), c(j), dk]: k_j e^(G_i - G_j)
    rhs = torch.stack([k_beta.view(blocks), qs.view(blocks)], dim=-1)  # [H, N, nsub, c, dk, 2]
    diag = (kd @ rhs).movedim(-1, 0)  # [2, H, N, nsub, c(i), c(j)]
    grid = full.view(2, heads, num_pieces, nsub, sub, nsub, sub)
    torch.diagonal(grid, dim1=3, dim2=5).copy_(diag.permute(0, 1, 2, 4, 5, 3))
    ut = full[0].masked_fill_(~lower.clone().fill_diagonal_(False), 0.0)
    intra = full[1].masked_fill_(~lower, 0.0)
    return ut, intra


def recurrent_delta(q, k, v, g, beta, state):
    """Token-by-token reference. Same arguments as :func:`chunk_delta`; returns (o, state)."""
    s = state.float().clone()
    outs = []
    for t in range(k.shape[0]):
        decay = g[t].float().exp()
        s = s * (decay[..., None] if g.dim() == 3 else decay[:, None, None])
        kt, vt = k[t].float(), v[t].float()
        delta = (vt - torch.einsum("hd,hde->he", kt, s)) * beta[t].float()[:, None]
        s = s + kt[:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hd,hde->he", q[t].float(), s))
    return torch.stack(outs).to(v.dtype), s
