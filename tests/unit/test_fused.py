"""``--compile``: a stage whose Llama-shaped layers run through ``torch.compile`` gives the
eager stage's logits and writes the same KV rows, cold, over a cached prefix, across a
wave of several chunks, and for a one-token wave (which runs the uncompiled functions).
Layers of other kinds are left eager."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

from wavepp.exec.base import ChunkWork
from wavepp.exec.torch_exec import TorchExecutor
from wavepp.model import BUILTIN, build_stage, random_weights
from wavepp.model.fused import fusable

BS = 16
# Inductor builds its CPU kernels with the C++ compiler in $CXX (default g++).
needs_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None,
    reason="--compile needs a C++ compiler on CPU (set CXX or install g++)",
)


def _chunk(rid: str, tokens: np.ndarray, start: int, end: int, table: list[int]) -> ChunkWork:
    return ChunkWork(rid, start, end, len(tokens), tuple(table[: -(-end // BS)]), (), False,
                     tokens=tokens[start:end])  # fmt: skip


def _waves(vocab: int) -> list[list[ChunkWork]]:
    rng = np.random.default_rng(3)
    a, b, c = (rng.integers(0, vocab, n) for n in (70, 45, 33))
    b[:32] = a[:32]  # b reuses a's first two blocks, computed in the first wave
    ta, tb, tc = list(range(0, 5)), [0, 1, 5, 6], [7, 8, 9]
    return [
        [_chunk("a", a, 0, 40, ta)],  # cold
        [_chunk("a", a, 40, 70, ta), _chunk("b", b, 32, 45, tb), _chunk("c", c, 0, 32, tc)],
        [_chunk("c", c, 32, 33, tc)],  # one token: the uncompiled path
    ]


@needs_compiler
@pytest.mark.timeout(600)
def test_compiled_stage_equals_eager():
    cfg = BUILTIN["tiny-llama"]
    stage = build_stage(cfg, range(cfg.num_layers), True, True, random_weights(cfg, 0))
    eager = TorchExecutor(stage, 16, BS)
    compiled = TorchExecutor(stage, 16, BS, compile=True)
    assert sorted(compiled.fused) == list(range(cfg.num_layers)) and not eager.fused
    for wave in _waves(cfg.vocab_size):
        eager.forward(wave, None)
        compiled.forward(wave, None)
    assert set(compiled.last_logits) == {"a", "b", "c"}
    for rid, logits in eager.last_logits.items():
        torch.testing.assert_close(compiled.last_logits[rid], logits, atol=1e-4, rtol=1e-4)
    for i, pools in eager.pools.items():
        for name, pool in pools.items():
            torch.testing.assert_close(compiled.pools[i][name], pool, atol=1e-5, rtol=1e-5)


def test_only_llama_shaped_layers_fuse():
    for name, expected in (("tiny-hybrid", "A"), ("tiny-kimi", "")):
        cfg = BUILTIN[name]
        stage = build_stage(cfg, range(cfg.num_layers), True, True, random_weights(cfg, 0))
        fused = [i for i in stage.layer_ids if fusable(stage.layer(i))]
        kinds = {cfg.kind(i) for i in fused}
        assert kinds == set(expected), (name, fused)
