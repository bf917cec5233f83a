"""What a TP leader posts to its stage's followers (``wavepp.exec.tp``): the chunks survive
the wire exactly, a follower refuses a post it cannot run before it runs it, the digests
tell two different streams apart; and the options refuse what TP does not do."""

import numpy as np
import pytest

from wavepp.config import load
from wavepp.exec.base import ChunkWork
from wavepp.exec.torch_exec import TorchExecutor
from wavepp.exec.tp import (
    _ENCODER,
    Post,
    PostError,
    RunPost,
    TPLayout,
    _Digest,
    _posted,
    _work,
    check_chunks,
)
from wavepp.launch.setup import preflight
from wavepp.model import BUILTIN, build_stage, random_weights
from wavepp.rounds.messages import CodecError, decode_untrusted
from wavepp.state import RequestId


@pytest.fixture(scope="module")
def executor():
    cfg = BUILTIN["tiny-hybrid"]  # GQA and gated linear attention: pools and snapshots
    stage = build_stage(cfg, range(4), True, False, random_weights(cfg, 0))
    return TorchExecutor(stage, capacity=8, block_size=16, snapshot_capacity=4)


def chunk(**fields) -> ChunkWork:
    base = dict(request_id=RequestId("r"), start=16, end=40, num_tokens=48,
                block_table=(3, 5, 7), snapshot_points=(2,), free=False, snapshot_slots=(1,),
                resume_slot=0, tokens=np.arange(24) + 100)  # fmt: skip
    return ChunkWork(**{**base, **fields})


def test_a_chunk_survives_the_wire_exactly():
    work = chunk(handoff=True)
    raw = _ENCODER.encode(RunPost([_posted(work)]))
    post = decode_untrusted(raw, Post)
    back = _work(post.chunks[0])
    for field in ("request_id", "start", "end", "num_tokens", "block_table", "snapshot_points",
                  "free", "snapshot_slots", "resume_slot", "handoff"):  # fmt: skip
        assert getattr(back, field) == getattr(work, field), field
    assert back.tokens.tolist() == work.tokens.tolist()


def test_garbage_is_refused_undecoded():
    with pytest.raises(CodecError):
        decode_untrusted(b"\x92\xa3run\x91\x93", Post)
    with pytest.raises(CodecError):
        decode_untrusted(_ENCODER.encode(["launch", []]), Post)


@pytest.mark.parametrize("fields,message", [
    ({"start": 41}, "tokens 41..40"),
    ({"block_table": (3, 5)}, "2 blocks cannot hold 40 tokens"),
    ({"block_table": (3, 5, 8)}, "slot outside the pool of 8"),
    ({"snapshot_slots": (4,)}, "snapshot slot outside the pool of 4"),
    ({"resume_slot": -1}, "snapshot slot outside"),
    ({"tokens": np.arange(23)}, "needs the chunk's 24 tokens"),
    ({"tokens": np.arange(24) + 500}, "outside the vocabulary of 512"),
])  # fmt: skip
def test_a_follower_refuses_what_it_cannot_run(executor, fields, message):
    posted = _posted(chunk(**fields))
    with pytest.raises(PostError, match=message):
        check_chunks([posted], executor, None)


def test_activations_must_match_the_waves_tokens(executor):
    posted = [_posted(chunk()), _posted(chunk(request_id=RequestId("s")))]
    check_chunks(posted, executor, 48)
    with pytest.raises(PostError, match="a wave of 48 tokens came with activations for 47"):
        check_chunks(posted, executor, 47)


def test_digests_tell_streams_apart(executor):
    one, two, three = _Digest(), _Digest(), _Digest()
    a, b = _ENCODER.encode(RunPost([_posted(chunk())])), _ENCODER.encode(RunPost([]))
    for digest, stream in ((one, [a, b]), (two, [a, b]), (three, [b, a])):
        for raw in stream:
            digest.ran(raw, None)
    assert one.final(executor) == two.final(executor) != three.final(executor)


def test_layout_of_the_ranks():
    layout = TPLayout(world=8, tp=2, rank=5)
    assert (layout.stages, layout.stage, layout.tp_rank) == (4, 2, 1)
    assert layout.leaders == [0, 2, 4, 6] and layout.members(2) == [4, 5]
    with pytest.raises(ValueError, match="--tp 3 does not divide the 8 ranks"):
        TPLayout(world=8, tp=3, rank=0)


def test_options_refuse_what_tp_does_not_do():
    with pytest.raises(SystemExit, match="--tp 3 does not divide the 4 ranks"):
        preflight(load(["--tp", "3"]), 4)
    with pytest.raises(SystemExit, match="the sim models tensor parallelism with --sim-tp"):
        load(["--tp", "2", "--executor", "sim"])
    with pytest.raises(SystemExit, match="--tp must be ≥ 1"):
        load(["--tp", "0"])
    # four ranks as two stages of two: the split of layers is over the stages
    with pytest.raises(SystemExit, match="gives 3 counts for 2 stages"):
        preflight(load(["--tp", "2", "--layers-per-stage", "3,3,2"]), 4)
    preflight(load(["--tp", "2", "--layers-per-stage", "4,4"]), 4)


def test_a_stages_cache_is_put_back_together_from_its_ranks_shards():
    import torch

    from wavepp.model.tp import _slice, cache_rule, gather_shards, replicated, whole_shape

    cfg = BUILTIN["tiny-kimi"]  # KDA (conv channels q | k | v) and MLA (latent)
    kda, mla = cfg.mixers.index("kda"), cfg.mixers.index("mla")
    inner = cfg.linear_heads * cfg.linear_k_dim
    cases = {("conv", kda): torch.randn(3, 3 * inner), ("delta", kda): torch.randn(4, 8, 8),
             ("k", mla): torch.randn(5, 4, 8)}  # fmt: skip
    for (name, layer), whole in cases.items():
        rule = cache_rule(cfg, layer, name)
        shards = [_slice(whole, rule, rank, 2) for rank in range(2)]
        assert whole_shape(rule, tuple(shards[0].shape), 2) == tuple(whole.shape)
        assert torch.equal(gather_shards(rule, shards), whole), name
    # the conv state's channels are q | k | v, each split by head: ranks' shards side by
    # side are not the whole state
    conv = cases[("conv", kda)]
    rule = cache_rule(cfg, kda, "conv")
    assert not torch.equal(torch.cat([_slice(conv, rule, r, 2) for r in range(2)], dim=1), conv)
    assert replicated(cache_rule(cfg, mla, "latent"))
