"""The model's last layer runs its outputs only where the logits read them: a last
stage gives the same logits as one running that layer for every token
(``full_last_layer``), and writes the same cache — keys and values, latents,
recurrent states and snapshots — for every token. Waves that end no prompt, several,
or one after a single token; attention, MLA and recurrent last layers; MoE MLPs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from wavepp.exec.base import ChunkWork
from wavepp.exec.torch_exec import TorchExecutor
from wavepp.model import BUILTIN, build_stage, llama_config, random_weights
from wavepp.model.attention import PagedBatch

BS = 16
# The last layer: GQA (llama), MLA with a MoE MLP (kimi), gated linear attention.
RECURRENT_LAST = llama_config(vocab_size=512, d_model=64, num_layers=4, pattern="AL",
                              num_heads=4, num_kv_heads=2, head_dim=16, d_ff=128,
                              linear_heads=2, linear_head_dim=16)  # fmt: skip
MODELS = {"llama": BUILTIN["tiny-llama"], "kimi": BUILTIN["tiny-kimi"],
          "recurrent-last": RECURRENT_LAST}  # fmt: skip


def _chunk(rid, tokens, start, end, table, points=(), slots=()) -> ChunkWork:
    return ChunkWork(rid, start, end, len(tokens), tuple(table), points, False,
                     snapshot_slots=slots, tokens=tokens[start:end])  # fmt: skip


def _waves(vocab: int) -> list[list[ChunkWork]]:
    rng = np.random.default_rng(5)
    a, b, c = (rng.integers(0, vocab, n) for n in (70, 45, 33))
    ta, tb, tc = list(range(0, 5)), [5, 6, 7], [8, 9, 10]
    return [
        [_chunk("a", a, 0, 40, ta, (2,), (0,)), _chunk("c", c, 0, 20, tc)],  # ends none
        [_chunk("a", a, 40, 70, ta), _chunk("b", b, 0, 45, tb), _chunk("c", c, 20, 32, tc)],
        [_chunk("c", c, 32, 33, tc)],  # one token, ending c
    ]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_last_layer_outputs_only_where_read(name):
    cfg = MODELS[name]
    stage = build_stage(cfg, range(cfg.num_layers), True, True, random_weights(cfg, 0))
    full = TorchExecutor(stage, 16, BS, snapshot_capacity=4, full_last_layer=True)
    pruned = TorchExecutor(stage, 16, BS, snapshot_capacity=4)
    ended = []
    for wave in _waves(cfg.vocab_size):
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
    x, _ = TorchExecutor(stage, 16, BS).forward(_waves(cfg.vocab_size)[1], None)
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
