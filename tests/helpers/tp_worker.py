"""One rank of a tensor-parallel stage pair, run by ``test_tp_shards`` as its own process.

For each model of ``CONFIGS``: two stages (P = 2) built whole and built as this rank's
shard over the Gloo group of all ranks; the same waves through both, with a reused
prefix (cached KV blocks, a recurrent state resumed from a snapshot slot) and a request
continuing from its live state. Stage 0's activations, stage 1's first tokens and
logits must agree; the shard's pools hold its heads; every wave makes exactly one
all-reduce per mixer and per MLP (plus one per MiniMax-M2 attention, for its q/k norms).
A failed check raises: the process exits non-zero.

    python -m tests.helpers.tp_worker --rank R --size T --store FILE
"""

from __future__ import annotations

import argparse
import datetime

import attrs
import numpy as np
import torch
import torch.distributed as dist

from wavepp.exec.base import ChunkWork
from wavepp.exec.torch_exec import TorchExecutor
from wavepp.model import ModelConfig, build_stage, llama_config, random_weights
from wavepp.model.tp import NO_TP, DistTPGroup

# The sizes of tests/helpers/families.py's checkpoints (and a Llama with gated linear
# attention layers), every split count even.
CONFIGS = {
    "llama": llama_config(vocab_size=300, d_model=64, num_layers=4, pattern="LA", num_heads=4,
                          num_kv_heads=2, head_dim=16, d_ff=96, linear_heads=4,
                          linear_head_dim=16),
    "kimi_linear": ModelConfig(
        family="kimi_linear", vocab_size=300, d_model=64, num_layers=5,
        mixers=("kda", "kda", "mla", "kda", "mla"), mlps=("dense",) + ("moe",) * 4,
        norm_eps=1e-5, num_heads=4, kv_lora_rank=32, nope_dim=16, rope_dim=8, v_dim=16,
        linear_heads=4, linear_k_dim=16, linear_v_dim=16, d_ff=96, num_experts=8, top_k=2,
        d_expert=32, shared_ff=32, routed_scaling=2.0, num_groups=2, topk_groups=1),
    "qwen3_next": ModelConfig(
        family="qwen3_next", vocab_size=300, d_model=64, num_layers=5,
        mixers=("gdn", "gdn", "gattn", "gdn", "gattn"), mlps=("moe", "dense", "moe", "moe", "moe"),
        num_heads=4, num_kv_heads=2, head_dim=16, rotary_dim=4, linear_heads=4,
        linear_k_heads=2, linear_k_dim=16, linear_v_dim=16, d_ff=96, num_experts=8, top_k=2,
        d_expert=32, shared_ff=48),
    "minimax_m2": ModelConfig(
        family="minimax_m2", vocab_size=300, d_model=64, num_layers=4, mixers=("mmattn",) * 4,
        mlps=("moe",) * 4, num_heads=4, num_kv_heads=2, head_dim=16, rotary_dim=8,
        num_experts=8, top_k=2, d_expert=32),
}  # fmt: skip
BS = 16
TOL = 1e-4


def waves(vocab: int) -> list[list[ChunkWork]]:
    """Wave 1: "a" (40 tokens, its state after block 2 saved to snapshot slot 0) and the
    first 20 tokens of "c". Wave 2: "c" goes on from its live state, no prompt ends (the
    last layer computes no rows). Wave 3: "b" shares a's first two blocks (reads their KV,
    resumes slot 0) and computes tokens 32..59; "c" ends."""
    rng = np.random.default_rng(3)
    a = rng.integers(0, vocab, 40)
    b = np.concatenate([a[:32], rng.integers(0, vocab, 28)])
    c = rng.integers(0, vocab, 50)
    return [
        [ChunkWork("a", 0, 40, 40, (0, 1, 2), (2,), False, snapshot_slots=(0,), tokens=a),
         ChunkWork("c", 0, 20, 50, (5, 6), (1,), False, snapshot_slots=(1,), tokens=c[:20])],
        [ChunkWork("c", 20, 36, 50, (5, 6, 7), (), False, tokens=c[20:36])],
        [ChunkWork("b", 32, 60, 60, (0, 1, 3, 4), (), False, resume_slot=0, tokens=b[32:]),
         ChunkWork("c", 36, 50, 50, (5, 6, 7, 8), (), False, tokens=c[36:])],
    ]  # fmt: skip


@attrs.define
class Counted:
    """A TP group that counts its all-reduces."""

    group: DistTPGroup
    calls: int = 0

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def size(self) -> int:
        return self.group.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.group.all_reduce(x)


def expected_reduces(executor: TorchExecutor, wave: list[ChunkWork]) -> int:
    """One per mixer and per MLP (and MiniMax-M2's q/k norms); the last stage's last MLP
    runs on no rows when no prompt ends."""
    m = executor.m
    count = 0
    for i in m.layer_ids:
        layer = m.layer(i)
        count += layer.has_mixer + layer.has_ffn
        count += layer.has_mixer and m.cfg.mixers[i] == "mmattn"
    pruned = m.last and not any(c.is_last for c in wave) and m.layer(m.layer_ids[-1]).has_ffn
    return count - pruned


def check_pools(full: TorchExecutor, shard: TorchExecutor, size: int, name: str) -> None:
    """The shard's pools: its KV heads, the whole MLA latent, its recurrent heads."""
    for pools_of in ("pools", "snapshot_pools"):
        for i, pools in getattr(full, pools_of).items():
            for part, pool in pools.items():
                want = list(pool.shape)
                if part in ("k", "v", "delta", "state"):  # [rows, heads, ...]
                    want[1] //= size
                elif part == "conv":  # [slots, K - 1, channels]
                    want[2] //= size
                got = list(getattr(shard, pools_of)[i][part].shape)
                assert got == want, f"{name} layer {i} {part}: pool {got}, expected {want}"


def run_model(name: str, group: DistTPGroup) -> None:
    cfg = CONFIGS[name]
    weights = random_weights(cfg, seed=1)
    half = cfg.num_layers // 2
    spans = [(range(0, half), True, False), (range(half, cfg.num_layers), False, True)]
    tp = Counted(group)

    def pipeline(g):
        return [TorchExecutor(build_stage(cfg, layers, first, last, weights, tp=g), 16, BS,
                              snapshot_capacity=4) for layers, first, last in spans]  # fmt: skip

    full, shard = pipeline(NO_TP), pipeline(tp)
    for n, wave in enumerate(waves(cfg.vocab_size)):
        x_full, _ = full[0].forward(wave, None)
        tp.calls = 0
        x_shard, _ = shard[0].forward(wave, None)
        assert tp.calls == expected_reduces(shard[0], wave), f"{name}: {tp.calls} all-reduces"
        diff = (x_shard - x_full).abs().max().item()
        assert diff <= TOL, f"{name} wave {n}: stage 0 activations differ by {diff:.2e}"
        _, want = full[1].forward(wave, x_full)
        tp.calls = 0
        _, got = shard[1].forward(wave, x_shard)
        assert tp.calls == expected_reduces(shard[1], wave), f"{name}: {tp.calls} all-reduces"
        assert got.keys() == want.keys(), f"{name} wave {n}: {got} vs {want}"
        for rid, (token, _) in want.items():
            assert got[rid][0] == token, f"{name} {rid}: first token {got[rid][0]}, not {token}"
            ours, theirs = shard[1].last_logits[rid], full[1].last_logits[rid]
            assert theirs.abs().max() > 0.5  # logits far from zero: the check means something
            diff = (ours - theirs).abs().max().item()
            assert diff <= TOL, f"{name} {rid}: logits differ by {diff:.2e}"
    for f, s in zip(full, shard, strict=True):
        check_pools(f, s, group.size, name)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--models", default=",".join(CONFIGS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    store = dist.FileStore(args.store, args.size)
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.size,
                            timeout=datetime.timedelta(seconds=120))  # fmt: skip
    try:
        group = DistTPGroup(dist.group.WORLD)
        for name in args.models.split(","):
            run_model(name, group)
            print(f"rank {args.rank}: {name} TP{args.size} matches one rank", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
