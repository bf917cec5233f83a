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

# Upper bound on the elements of the per-channel pairwise decay tensor built at once.
_PAIRWISE_BUDGET = 1 << 24


def _pieces(num_tokens: int, cuts: tuple[int, ...], chunk: int) -> list[tuple[int, int]]:
    """[start, end) pieces of at most ``chunk`` tokens that end at every cut."""
    bounds = sorted({0, num_tokens, *[c for c in cuts if 0 < c < num_tokens]})
    pieces = []
    for a, b in itertools.pairwise(bounds):
        pieces.extend((s, min(b, s + chunk)) for s in range(a, b, chunk))
    return pieces


def chunk_delta(q, k, v, g, beta, state, cuts: tuple[int, ...] = (), chunk: int = 64):
    """q, k: [T, H, dk] (q scaled, both normalized); v: [T, H, dv]; beta: [T, H];
    g: [T, H] (scalar gate) or [T, H, dk] (per-channel gate), log decay <= 0;
    state: [H, dk, dv] before token 0. Returns (o: [T, H, dv], final state,
    [state after token c for c in cuts])."""
    num_tokens, heads, _ = k.shape
    dv = v.shape[-1]
    per_channel = g.dim() == 3
    pieces = _pieces(num_tokens, cuts, chunk)
    num_pieces = len(pieces)
    # Gather into [N, C] piece slots; padding points at an appended zero row (beta = 0,
    # k = 0, g = 0), which neither decays nor writes the state.
    index = torch.full((num_pieces, chunk), num_tokens, dtype=torch.long)
    for n, (a, b) in enumerate(pieces):
        index[n, : b - a] = torch.arange(a, b)

    def gather(x):  # [T, H, ...] -> [H, N, C, ...]
        padded = torch.cat([x, x.new_zeros((1, *x.shape[1:]))], dim=0)
        return padded[index].movedim(2, 0)

    qs, ks, vs, bs, gs = (gather(x.float()) for x in (q, k, v, beta, g))
    gs = gs.cumsum(2)  # [H, N, C] or [H, N, C, dk]: cumulative log decay within a piece
    k_beta = ks * bs[..., None]
    lower = torch.ones(chunk, chunk, dtype=torch.bool).tril()  # j <= i
    if per_channel:
        ut, intra = _pairwise_channel(qs, ks, k_beta, gs, lower)
        g_last = gs[:, :, -1]  # [H, N, dk]
        q_in = qs * gs.exp()
        k_out = ks * (g_last[:, :, None] - gs).exp()
        w_rhs = k_beta * gs.exp()
    else:
        diff = (gs[..., :, None] - gs[..., None, :]).masked_fill(~lower, -torch.inf)
        decay = diff.exp()  # [H, N, C, C]
        ut = (k_beta @ ks.transpose(-1, -2)) * decay
        intra = (qs @ ks.transpose(-1, -2)) * decay
        g_last = gs[:, :, -1]  # [H, N]
        q_in = qs * gs.exp()[..., None]
        k_out = ks * (g_last[:, :, None] - gs).exp()[..., None]
        w_rhs = k_beta * gs.exp()[..., None]
    # UT transform: (I + strictly-lower ut) [U | W] = [v*beta | k*beta*exp(G)], one solve.
    rhs = torch.cat([vs * bs[..., None], w_rhs], dim=-1)  # [H, N, C, dv + dk]
    solved = torch.linalg.solve_triangular(ut, rhs, upper=False, unitriangular=True)
    u, w = solved[..., :dv], solved[..., dv:]
    out = torch.empty(heads, num_pieces, chunk, dv)
    s = state.float()
    saved: dict[int, torch.Tensor] = {0: s}  # a cut at 0 is the state given
    cut_set = set(cuts)
    for n in range(num_pieces):  # carry the state piece to piece
        v_new = u[:, n] - w[:, n] @ s  # [H, C, dv]
        out[:, n] = q_in[:, n] @ s + intra[:, n] @ v_new
        if per_channel:
            s = s * g_last[:, n].exp()[..., None] + k_out[:, n].transpose(-1, -2) @ v_new
        else:
            s = s * g_last[:, n].exp()[:, None, None] + k_out[:, n].transpose(-1, -2) @ v_new
        if pieces[n][1] in cut_set:
            saved[pieces[n][1]] = s
    flat = out.movedim(0, 2).reshape(num_pieces * chunk, heads, dv)
    keep = (index < num_tokens).reshape(-1)
    o = torch.empty(num_tokens, heads, dv)
    o[index.reshape(-1)[keep]] = flat[keep]
    return o.to(v.dtype), s, [saved[c] for c in cuts]


def _pairwise_channel(qs, ks, k_beta, gs, lower):
    """Per-channel decays: ut[i, j] = sum_d kb_i k_j exp(G_i - G_j) (j < i) and
    intra[i, j] = sum_d q_i k_j exp(G_i - G_j) (j <= i), exact (every exponent <= 0),
    over groups of pieces so that the [.., C, C, dk] tensor stays bounded."""
    heads, num_pieces, chunk, dk = ks.shape
    step = max(1, _PAIRWISE_BUDGET // (heads * chunk * chunk * dk))
    ut = torch.empty(heads, num_pieces, chunk, chunk)
    intra = torch.empty_like(ut)
    strict = lower.clone().fill_diagonal_(False)
    for a in range(0, num_pieces, step):  # fixed-size groups of pieces
        sl = slice(a, a + step)
        diff = gs[:, sl, :, None, :] - gs[:, sl, None, :, :]  # [H, n, C, C, dk]
        decay = diff.masked_fill(~lower[:, :, None], -torch.inf).exp()
        kd = ks[:, sl, None, :, :] * decay  # k_j exp(G_i - G_j)
        ut[:, sl] = (k_beta[:, sl, :, None, :] * kd).sum(-1).masked_fill(~strict, 0.0)
        intra[:, sl] = (qs[:, sl, :, None, :] * kd).sum(-1)
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
