"""The model's last layer runs its outputs only where the logits read them: a last
stage gives the same logits as one running that layer for every token
(``full_last_layer``), and writes the same cache — keys and values, latents,
recurrent states and snapshots — for every token. Waves that end no prompt, several,
or one after a single token; attention, MLA and recurrent last layers; MoE MLPs."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.waves import MODELS, waves
from wavepp.exec.torch_exec import TorchExecutor
from wavepp.model import build_stage, random_weights
from wavepp.model.attention import PagedBatch

BS = 16


@pytest.mark.parametrize("name", sorted(MODELS))
def test_last_layer_outputs_only_where_read(name):
    cfg = MODELS[name]
    stage = build_stage(cfg, range(cfg.num_layers), True, True, random_weights(cfg, 0))
    full = TorchExecutor(stage, 16, BS, snapshot_capacity=4, full_last_layer=True)
    pruned = TorchExecutor(stage, 16, BS, snapshot_capacity=4)
    ended = []
    for wave in waves(cfg.vocab_size):
        full.forward(wave, None)
        _, results = pruned.forward(wave, None)
        ended.append(sorted(results))
    assert ended == [[], ["a", "b"], ["c"]]
    assert set(pruned.last_logits) == {"a", "b", "c"}
    for rid, logits in full.last_logits.items():
        torch.testing.assert_close(pruned.last_logits[rid], logits, atol=1e-5, rtol=1e-5)
    for kept, ref in ((pruned.pools, full.pools), (pruned.snapshot_pools, full.snapshot_pools)):
        assert kept.keys() == ref.keys()
        for i, parts in ref.items():
            for part, tensor in parts.items():
                assert torch.equal(kept[i][part], tensor), (i, part)
    if name == "recurrent-last":  # the snapshot at token 32 was saved on every L layer
        assert all(pool["state"][0].abs().sum() > 0 for pool in pruned.snapshot_pools.values())


def test_a_middle_stage_passes_every_row_on():
    cfg = MODELS["llama"]
    stage = build_stage(cfg, range(2), True, False, random_weights(cfg, 0))
    x, _ = TorchExecutor(stage, 16, BS).forward(waves(cfg.vocab_size)[1], None)
    assert x.shape == (30 + 45 + 12, cfg.d_model)


def test_last_tokens_batch():
    batch = PagedBatch([0, 32, 5], [40, 45, 6], [[3, 4, 5], [0, 1, 2], [7]], BS,
                       torch.device("cpu"))  # fmt: skip
    queries = batch.last_tokens([0, 2])
    assert queries.rows.tolist() == [39, 40 + 13]
    assert queries.positions.tolist() == [39, 5]
    assert queries.write_rows.tolist() == batch.write_rows[[39, 53]].tolist()
    assert queries.starts == [39, 5] and queries.ends == [40, 6]
    empty = batch.last_tokens([])
    assert empty.num_tokens == 0 and empty.rows.numel() == 0
