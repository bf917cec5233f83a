"""The chunked delta rule equals the token-by-token recurrence: outputs, the final state
and the states at every cut (on the piece grid or off it), for a scalar gate (Gated
DeltaNet) and a per-channel gate (KDA)."""

import pytest
import torch
import torch.nn.functional as F

from wavepp.model.delta import chunk_delta, recurrent_delta


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("cuts", [(), (32, 64), (5, 17, 40, 77), (0, 90)])
def test_chunked_form_equals_the_recurrence(per_channel, cuts):
    gen = torch.Generator().manual_seed(len(cuts) + per_channel)
    tokens, heads, dk, dv = 90, 2, 8, 6
    q = F.normalize(torch.randn(tokens, heads, dk, generator=gen), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(tokens, heads, dk, generator=gen), dim=-1)
    v = torch.randn(tokens, heads, dv, generator=gen)
    beta = torch.rand(tokens, heads, generator=gen)
    shape = (tokens, heads, dk) if per_channel else (tokens, heads)
    g = -torch.rand(shape, generator=gen) * 0.5
    state = torch.randn(heads, dk, dv, generator=gen) * 0.1
    out, final, saved = chunk_delta(q, k, v, g, beta, state, cuts=cuts, chunk=32)
    ref_out, ref_final = recurrent_delta(q, k, v, g, beta, state)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(final, ref_final, atol=1e-5, rtol=1e-4)
    for cut, got in zip(cuts, saved, strict=True):
        at_cut = state if cut == 0 else recurrent_delta(
            q[:cut], k[:cut], v[:cut], g[:cut], beta[:cut], state)[1]  # fmt: skip
        torch.testing.assert_close(got, at_cut, atol=1e-5, rtol=1e-4)
