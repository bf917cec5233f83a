"""Tensor parallelism inside a stage (``wavepp.model.tp``): which counts ``--tp`` must
divide, what each rank's shard of the checkpoint holds, and — in two real processes over
Gloo — that a stage split over two ranks computes what the whole stage computes, for
Llama (with gated linear attention) and the three families (``tests/helpers/tp_worker.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest
import torch

from tests.helpers.tp_worker import CONFIGS
from wavepp.model import build_stage, random_weights
from wavepp.model.tp import check_tp, shard_weights

ROOT = Path(__file__).resolve().parents[2]


@attrs.frozen
class Place:
    """A rank's place in a TP group, for building shards without processes (a forward
    would need the sum: it raises)."""

    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("no forward here")


def test_check_tp_names_every_count_that_does_not_divide():
    # 4 heads, 2 KV heads, GDN 4 value / 2 key heads, d_ff 96, 8 experts, shared 48 wide
    cfg = CONFIGS["qwen3_next"]
    check_tp(cfg, 2)
    with pytest.raises(ValueError) as err:
        check_tp(cfg, 3)
    assert str(err.value) == (
        "--tp 3 must divide every count a stage splits over its ranks; these do not divide "
        "by 3: 4 attention heads (num_heads), 2 KV heads (num_kv_heads), 4 linear-attention "
        "heads (linear_heads), 2 linear-attention key heads (linear_k_heads), 8 experts "
        "(num_experts)"
    )
    with pytest.raises(ValueError, match=r"by 4: 2 KV heads \(num_kv_heads\), 98 MLP width"):
        check_tp(attrs.evolve(CONFIGS["llama"], d_ff=98), 4)
    with pytest.raises(ValueError, match=r"--tp 4 .* 2 KV heads"):
        build_stage(cfg, range(2), True, False, random_weights(cfg, 0), tp=Place(0, 4))


def test_shards_put_back_together_give_the_checkpoint():
    cfg = CONFIGS["qwen3_next"]
    full = random_weights(cfg, seed=0)
    shards = [shard_weights(cfg, full, r, 2) for r in range(2)]

    def joined(name, dim=0):
        return torch.cat([s[name] for s in shards], dim=dim)

    attn, gdn, moe = "model.layers.2.self_attn", "model.layers.0.linear_attn", "model.layers.0.mlp"
    assert shards[0][f"{attn}.q_proj.weight"].shape == (64, 64)  # 2 of 4 heads, q and gate
    for name in (f"{attn}.q_proj.weight", f"{attn}.k_proj.weight", f"{gdn}.in_proj_qkvz.weight",
                 f"{gdn}.in_proj_ba.weight", f"{gdn}.A_log", "model.layers.1.mlp.up_proj.weight",
                 f"{moe}.shared_expert.gate_proj.weight"):  # fmt: skip
        assert torch.equal(joined(name), full[name]), name
    for name in (f"{attn}.o_proj.weight", f"{gdn}.out_proj.weight",
                 f"{moe}.shared_expert.down_proj.weight"):  # fmt: skip
        assert torch.equal(joined(name, dim=1), full[name]), name
    # the convolution's channels: q | k | v, each split by head
    conv = full[f"{gdn}.conv1d.weight"]  # [32 + 32 + 64, 1, K]
    q, k, v = conv.split([32, 32, 64])
    assert torch.equal(shards[1][f"{gdn}.conv1d.weight"], torch.cat([q[16:], k[16:], v[32:]]))
    # replicated: the same tensors; experts: each on one rank, whole
    for name in ("model.embed_tokens.weight", "lm_head.weight", f"{attn}.q_norm.weight",
                 f"{gdn}.norm.weight", f"{moe}.gate.weight",
                 f"{moe}.shared_expert_gate.weight"):  # fmt: skip
        assert all(s[name] is full[name] for s in shards), name
    experts = [{n.split(".")[5] for n in s if ".experts." in n} for s in shards]
    assert experts == [{"0", "1", "2", "3"}, {"4", "5", "6", "7"}]
    assert torch.equal(shards[1][f"{moe}.experts.5.down_proj.weight"],
                       full[f"{moe}.experts.5.down_proj.weight"])  # fmt: skip


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_rank_builds_its_shard_with_its_share_of_the_caches(name):
    """Every tensor of a rank's stage loads from its shard (strict: names and shapes);
    caches follow the heads: GQA keeps its KV heads, MLA the whole latent, recurrent
    layers their heads' states."""
    cfg = CONFIGS[name]
    if name == "kimi_linear":
        cfg = attrs.evolve(cfg, q_lora_rank=24)  # MLA with q_a / q_b projections
    weights = random_weights(cfg, seed=0)
    layers = range(cfg.num_layers)
    whole = build_stage(cfg, layers, True, True, weights)
    for rank in range(2):
        shard = build_stage(cfg, layers, True, True, weights, tp=Place(rank, 2))
        for i in layers:
            full_mixer, mixer = whole.layer(i).mixer, shard.layer(i).mixer
            if mixer.paged:
                for part, shape in full_mixer.cache_layout().items():
                    heads = shape[0] if part == "latent" else shape[0] // 2
                    assert mixer.cache_layout()[part] == (heads, *shape[1:]), (i, part)
            else:
                for part, (a, b, *rest) in full_mixer.state_shapes().items():
                    want = (a, b // 2) if part == "conv" else (a // 2, b, *rest)
                    assert mixer.state_shapes()[part] == want, (i, part)


def test_two_ranks_compute_what_one_rank_computes(tmp_path):
    """Both ranks run every model's waves whole and sharded and check that they agree
    (tp_worker); a failed or hung rank fails the test."""
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    procs = []
    for r, log in enumerate(logs):
        with open(log, "w") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tests.helpers.tp_worker", "--rank", str(r), "--size", "2",
                 "--store", str(tmp_path / "store")],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT))  # fmt: skip
    deadline = time.monotonic() + 600  # a hang guard; the run takes seconds
    try:
        while True:
            codes = [p.poll() for p in procs]
            if None not in codes or any(codes) or time.monotonic() > deadline:
                break  # all done, one failed (the other may wait on it forever), or hung
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    report = "\n".join(f"--- rank {r} (exit {p.returncode})\n{log.read_text()[-4000:]}"
                       for r, (p, log) in enumerate(zip(procs, logs, strict=True)))  # fmt: skip
    assert all(p.returncode == 0 for p in procs), report
    for r, log in enumerate(logs):
        for name in CONFIGS:
            assert f"rank {r}: {name} TP2 matches one rank" in log.read_text(), report
