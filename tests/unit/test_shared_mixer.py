"""A mixer two stages share (``wavepp.plan.placement``): each stage attends for some of
the wave's rows and both store every token's cache, so the pair gives the logits and the
cache of one stage running the whole model; the later stage's handoff band leaves the
shared layer to the earlier's."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
import torch

from tests.helpers.waves import MODELS, waves
from wavepp.exec.torch_exec import TorchExecutor
from wavepp.handoff.base import BandJob
from wavepp.model import build_stage, random_weights
from wavepp.model.attention import PagedBatch

BS = 16


def test_query_rows_cut_chunks_and_share_row_weighs_keys():
    batch = PagedBatch([0, 32, 5], [40, 45, 6], [[3, 4, 5], [0, 1, 2], [7]], BS,
                       torch.device("cpu"))  # fmt: skip
    n = batch.num_tokens  # 40 + 13 + 1
    for lo, hi in ((0, n), (10, 47), (0, 0), (40, 53), (53, 54)):
        rows = batch.query_rows(lo, hi)
        assert rows.rows.tolist() == list(range(lo, hi))
        assert rows.positions.tolist() == batch.positions[lo:hi].tolist()
        assert rows.write_rows.tolist() == batch.write_rows[lo:hi].tolist()
    assert batch.share_row(0.0) == 0 and batch.share_row(1.0) == n
    cuts = [batch.share_row(f) for f in np.linspace(0, 1, 21)]
    assert cuts == sorted(cuts)
    keys = batch.positions + 1  # each row attends to its position + 1 keys
    m = batch.share_row(0.5)
    assert keys[:m].sum() >= keys.sum() / 2 > keys[: m - 1].sum()


def _stages(cfg, share: float):
    """One stage of the whole model, and two sharing its first attention mixer."""
    weights = random_weights(cfg, 0)
    k = cfg.pattern.index("A")
    whole = build_stage(cfg, range(cfg.num_layers), True, True, weights)
    first = build_stage(cfg, range(0), True, False, weights, units=range(0, 2 * k + 1))
    rest = build_stage(cfg, range(0), False, True, weights,
                       units=range(2 * k, 2 * cfg.num_layers))  # fmt: skip
    return (TorchExecutor(whole, 16, BS, snapshot_capacity=4),
            TorchExecutor(first, 16, BS, snapshot_capacity=4, shared_last=share),
            TorchExecutor(rest, 16, BS, snapshot_capacity=4, shared_first=share))  # fmt: skip


@pytest.mark.parametrize("share", [0.05, 0.6, 0.95])
@pytest.mark.parametrize("name", ["llama", "kimi"])
def test_two_stages_sharing_a_mixer_equal_one_stage(name, share):
    cfg = MODELS[name]
    whole, first, rest = _stages(cfg, share)
    k = cfg.pattern.index("A")  # llama: layer 0, kimi (MLA): layer 3
    for wave in waves(cfg.vocab_size):
        whole.forward(wave, None)
        x, _ = first.forward(wave, None)
        n = sum(c.end - c.start for c in wave)
        assert x.shape[0] == n + PagedBatch.build(wave, BS).share_row(share, cfg.d_model // 2)
        rest.forward(wave, x)
    assert set(rest.last_logits) == set(whole.last_logits) == {"a", "b", "c"}
    for rid, logits in whole.last_logits.items():
        torch.testing.assert_close(rest.last_logits[rid], logits, atol=1e-5, rtol=1e-5)
    for part, tensor in whole.pools[k].items():  # the shared layer's cache, whole on both
        torch.testing.assert_close(first.pools[k][part], tensor, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(rest.pools[k][part], tensor, atol=1e-6, rtol=1e-6)


def test_the_earlier_stage_hands_on_the_shared_layer():
    cfg = MODELS["llama"]
    _, first, rest = _stages(cfg, 0.5)
    job = BandJob(request_id="a", target="unix:/nowhere", num_tokens=20, block_table=(0, 1),
                  states={}, tokens=np.arange(20), first_token=1, top_logit=0.5)  # fmt: skip
    assert sorted({t.layer for t in first.band(job)}) == [-1, 0]  # the prompt, layer 0
    later = attrs.evolve(job, tokens=None)
    assert sorted({t.layer for t in rest.band(later)}) == list(range(1, cfg.num_layers))


def test_what_cannot_be_shared_is_refused():
    cfg = MODELS["recurrent-last"]  # layer 1 is recurrent (pattern "AL")
    weights = random_weights(cfg, 0)
    first = build_stage(cfg, range(0), True, False, weights, units=range(0, 3))
    with pytest.raises(ValueError, match="only an attention mixer"):
        TorchExecutor(first, 16, BS, snapshot_capacity=4, shared_last=0.5)
    llama = MODELS["llama"]
    whole = build_stage(llama, range(2), True, False, random_weights(llama, 0))
    with pytest.raises(ValueError, match="without its MLP"):
        TorchExecutor(whole, 16, BS, shared_last=0.5)
    _, _, rest = _stages(llama, 0.5)
    wave = waves(llama.vocab_size)[0]
    n = sum(c.end - c.start for c in wave)
    with pytest.raises(ValueError, match="sharing"):  # the earlier stage's rows missing
        rest.forward(wave, torch.zeros(n, llama.d_model))
    last = build_stage(llama, range(0), False, True, random_weights(llama, 0),
                       units=range(0, 2 * llama.num_layers - 1))  # fmt: skip
    with pytest.raises(ValueError, match="last stage cannot share"):
        TorchExecutor(last, 16, BS, shared_last=0.5)
