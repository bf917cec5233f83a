"""Waves of chunks with real tokens for one whole-model stage, and the models they run on:
whose last layer is GQA (llama), MLA with a MoE MLP (kimi), or gated linear attention."""

from __future__ import annotations

import numpy as np

from wavepp.exec.base import ChunkWork
from wavepp.model import BUILTIN, llama_config

# The last layer: GQA (llama), MLA with a MoE MLP (kimi), gated linear attention.
RECURRENT_LAST = llama_config(vocab_size=512, d_model=64, num_layers=4, pattern="AL",
                              num_heads=4, num_kv_heads=2, head_dim=16, d_ff=128,
                              linear_heads=2, linear_head_dim=16)  # fmt: skip
MODELS = {"llama": BUILTIN["tiny-llama"], "kimi": BUILTIN["tiny-kimi"],
          "recurrent-last": RECURRENT_LAST}  # fmt: skip


def _chunk(rid, tokens, start, end, table, points=(), slots=()) -> ChunkWork:
    return ChunkWork(rid, start, end, len(tokens), tuple(table), points, False,
                     snapshot_slots=slots, tokens=tokens[start:end])  # fmt: skip


def waves(vocab: int) -> list[list[ChunkWork]]:
    """Three waves of three requests over blocks 0..10 (16 tokens each): the first ends no
    prompt (a snapshot at block 2 of ``a``), the second ends ``a`` and ``b``, the third
    is ``c``'s last token alone."""
    rng = np.random.default_rng(5)
    a, b, c = (rng.integers(0, vocab, n) for n in (70, 45, 33))
    ta, tb, tc = list(range(0, 5)), [5, 6, 7], [8, 9, 10]
    return [
        [_chunk("a", a, 0, 40, ta, (2,), (0,)), _chunk("c", c, 0, 20, tc)],  # ends none
        [_chunk("a", a, 40, 70, ta), _chunk("b", b, 0, 45, tb), _chunk("c", c, 20, 32, tc)],
        [_chunk("c", c, 32, 33, tc)],  # one token, ending c
    ]
