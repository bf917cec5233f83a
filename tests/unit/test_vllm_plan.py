"""The connector's pure parts, without vLLM (``wavepp.vllm.plan``, ``wavepp.vllm.pulling``):
reading ``kv_transfer_params``, the prefix it loads, the model and cache checks at start,
where each token's keys and values go in vLLM CPU's pages (the layout vLLM's CPU kernel
reads; test_vllm_pd decodes through it), and one stage's band pulled and checked."""

from __future__ import annotations

import copy
import time

import msgspec
import pytest
import torch

from tests.helpers.fake_stage import FakeStage
from wavepp.handoff import wire
from wavepp.handoff.client import build_band
from wavepp.handoff.gate import Gate
from wavepp.vllm import plan
from wavepp.vllm.pulling import PullFailed, pull_band

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2,
    "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "vocab_size": 512, "intermediate_size": 256,
}  # fmt: skip
QWEN = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
    "num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300,
    "layer_types": ["linear_attention", "linear_attention", "full_attention"],
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
}  # fmt: skip
KIMI = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
    "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 300,
    "layer_types": ["linear_attention", "full_attention"], "kv_lora_rank": 32,
    "qk_rope_head_dim": 8, "linear_num_heads": 4, "linear_head_dim": 16,
}  # fmt: skip
FP = wire.fingerprint_from_hf_config(LLAMA, "float32")
IDS = list(range(3, 103))  # 100 tokens


def params(**wavepp) -> dict:
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": None,
            "prompt_token_ids": list(IDS),
            "wavepp": {"version": 1, "request_id": "r-1",
                       "stages": ["unix:/tmp/a-stage0.sock", "tcp://127.0.0.1:9001"],
                       "num_tokens": len(IDS), "first_token": 7, "expires_in_s": 29.5,
                       **wavepp}}  # fmt: skip


def test_params_as_wavepp_answers_them_are_read():
    assert plan.is_ours(params()) and not plan.is_ours({"do_remote_prefill": True})
    assert not plan.is_ours({**params(), "do_remote_prefill": False}) and not plan.is_ours(None)
    source = plan.parse_params(params(), 512)
    assert source.request_id == "r-1" and source.num_tokens == 100
    assert source.stages == ("unix:/tmp/a-stage0.sock", "tcp://127.0.0.1:9001")
    assert source.prompt_token_ids == tuple(IDS)


@pytest.mark.parametrize("change, match", [
    (lambda p: p["wavepp"].update(stages=5), r"wavepp.stages"),
    (lambda p: p["wavepp"].update(colour="blue"), "unknown field `colour`"),
    (lambda p: p["wavepp"].update(version=2), "version 2 is not supported"),
    (lambda p: p["wavepp"].update(stages=[]), "wavepp.stages"),
    (lambda p: p["wavepp"].update(num_tokens=99), "100 prompt_token_ids but wavepp.num_tokens"),
    (lambda p: p["wavepp"].update(request_id=""), "request_id"),
    (lambda p: p["wavepp"].update(stages=["tcp://10.0.0.7:9000"]), "is not allowed"),
    (lambda p: p["wavepp"].update(stages=["dir:/tmp/x"]), "accepted forms"),
    (lambda p: p["wavepp"].update(stages=["http://x"]), "accepted forms"),
    (lambda p: p.update(prompt_token_ids=[1, "2"]), "prompt_token_ids"),
    (lambda p: p.update(prompt_token_ids=[*IDS[:-1], 512]), "outside the decoder's vocab"),
    (lambda p: p.update(prompt_token_ids=[*IDS[:-1], True]), "prompt_token_ids"),
    (lambda p: p.update(wavepp="yes"), "wavepp"),
    (lambda p: p.update(do_remote_prefill="true"), "do_remote_prefill"),
])  # fmt: skip
def test_malformed_or_hostile_params_are_refused_naming_the_field(change, match):
    p = copy.deepcopy(params())
    change(p)
    with pytest.raises(plan.ParamsError, match=match):
        plan.parse_params(p, 512)


def test_the_allow_list_widens():
    p = params(stages=["tcp://10.0.0.7:9000"])
    assert plan.parse_params(p, 512, allow=("tcp://10.0.0.",)).stages == ("tcp://10.0.0.7:9000",)
    assert plan.parse_params(p, 512, allow=("*",)).stages == ("tcp://10.0.0.7:9000",)


def test_only_the_agreeing_prefix_is_loaded_in_whole_blocks():
    source = plan.parse_params(params(), 512)
    assert plan.agreed_tokens(IDS, source, 32) == 96
    assert plan.agreed_tokens([*IDS, 5, 6], source, 32) == 96  # the decoder's prompt is longer
    assert plan.agreed_tokens(IDS[:64], source, 32) == 64
    assert plan.agreed_tokens(IDS[:40] + [1] * 60, source, 32) == 32
    assert plan.agreed_tokens(IDS[:31] + [1] * 69, source, 32) == 0
    assert plan.agreed_tokens([1, *IDS[1:]], source, 32) == 0
    assert plan.agreed_tokens(IDS, source, 64) == 64


def test_without_token_ids_the_shorter_prompt_is_claimed_for_the_band_to_check():
    """vLLM's chat endpoint takes ``prompt_token_ids`` out of the parameters (and decodes
    from them): the whole blocks of the shorter prompt are claimed, and stage 0's token
    ids in its band are what the decoder's are checked against."""
    p = params()
    del p["prompt_token_ids"]
    source = plan.parse_params(p, 512)
    assert source.prompt_token_ids is None and source.num_tokens == 100
    assert plan.agreed_tokens(IDS, source, 32) == 96
    assert plan.agreed_tokens(IDS[:70], source, 32) == 64
    assert plan.agreed_tokens([1] * 200, source, 32) == 96  # the band's ids decide


def test_the_token_digest_is_of_int32_ids():
    assert plan.token_digest([1, 2, 3]) == plan.token_digest(torch.tensor([1, 2, 3]).numpy())
    assert plan.token_digest([1, 2, 3]) != plan.token_digest([1, 2, 4])
    assert plan.token_digest([]) != plan.token_digest([0])


def test_the_model_is_checked_at_start_and_hybrid_families_refused():
    assert plan.decoder_fingerprint(LLAMA, torch.float32, "auto") == FP
    assert plan.decoder_fingerprint(LLAMA, torch.bfloat16, "bfloat16").dtype == "bfloat16"
    with pytest.raises(plan.ModelRefused, match="Qwen3NextForCausalLM has linear-attention"):
        plan.decoder_fingerprint(QWEN, torch.float32, "auto")
    with pytest.raises(plan.ModelRefused, match=r"linear-attention .* and MLA latent layers"):
        plan.decoder_fingerprint(KIMI, torch.float32, "auto")
    with pytest.raises(plan.ModelRefused, match="kv cache dtype 'fp8'"):
        plan.decoder_fingerprint(LLAMA, torch.float32, "fp8")
    with pytest.raises(plan.ModelRefused, match="model_type 'qwen2' is not supported"):
        plan.decoder_fingerprint({**LLAMA, "model_type": "qwen2"}, torch.float32, "auto")


def test_layer_names():
    assert plan.layer_index("model.layers.3.self_attn.attn") == 3
    assert plan.layer_index("model.layers.12.attn") == 12
    for bad in ("lm_head", "model.layers.1.experts.2.attn"):
        with pytest.raises(ValueError, match="cannot tell the layer"):
            plan.layer_index(bad)


def test_the_cache_layout_is_checked():
    cache = torch.zeros(8, 2, 32, 64)
    plan.cpu_pages(cache, FP, 32, "vec", "layer 0")
    for bad, match in [(torch.zeros(8, 4, 32, 64), r"\[blocks, 2, 32, 64\]"),
                       (torch.zeros(8, 2, 32, 64, dtype=torch.float16), "float16"),
                       (torch.zeros(8, 2, 64, 32).transpose(2, 3), "not contiguous")]:  # fmt: skip
        with pytest.raises(plan.ModelRefused, match=match):
            plan.cpu_pages(bad, FP, 32, "vec", "layer 0")
    with pytest.raises(plan.ModelRefused, match="'amx' packs pages"):
        plan.cpu_pages(cache, FP, 32, "amx", "layer 0")
    with pytest.raises(plan.ModelRefused, match="multiple of 32"):
        plan.cpu_pages(torch.zeros(8, 2, 16, 64), FP, 16, "vec", "layer 0")


def page_cells(k: torch.Tensor, v: torch.Tensor, b: int) -> torch.Tensor:
    """vLLM CPU's ``vec`` page, built by hand: a (block, head) page is the block's keys
    [D, B] column-major then its values [B, D]; seen as [blocks, H, B, 2D], token t's cell
    is [t // B, :, t % B]. Returns the cells token-major, [T, H, 2D]."""
    tokens, heads, head_dim = k.shape
    blocks = tokens // b
    k, v = (x.reshape(blocks, b, heads, head_dim) for x in (k, v))
    pages = torch.cat([k.permute(0, 2, 3, 1).reshape(blocks, heads, -1),
                       v.transpose(1, 2).reshape(blocks, heads, -1)], dim=2)  # fmt: skip
    cells = pages.reshape(blocks, heads, b, 2 * head_dim).transpose(1, 2)
    return cells.reshape(tokens, heads, 2 * head_dim)


def test_tokens_land_where_vllms_cpu_kernel_reads_them():
    """Blocks written at scattered ids hold each token's keys and values where vLLM CPU's
    ``vec`` kernel reads them (:func:`page_cells`)."""
    torch.manual_seed(0)
    b, blocks = 32, [5, 2, 7]
    k, v = torch.randn(96, 2, 32), torch.randn(96, 2, 32)
    cache = torch.zeros(8, 2, b, 64)
    plan.write_pages(plan.cpu_pages(cache, FP, b, "vec", "l"), blocks, k, v)
    rows = page_cells(k, v, b)  # [96, H, 2D]: token t's cell of its block
    for t in range(96):
        assert torch.equal(cache[blocks[t // b], :, t % b], rows[t]), t
    untouched = [i for i in range(8) if i not in blocks]
    assert not cache[untouched].any()
    with pytest.raises(ValueError, match="3 blocks of 32"):
        plan.write_pages(plan.cpu_pages(cache, FP, b, "vec", "l"), blocks, k[:90], v[:90])


# -- one stage's band pulled (a fake stage on a Unix socket) ---------------------------


def _band(rid, tokens, fp=FP, layers=(0, 1)):
    t = len(tokens)
    tensors = {(-1, "tokens"): torch.tensor(tokens, dtype=torch.int32)}
    for layer in layers:
        for name in ("k", "v"):
            tensors[(layer, name)] = torch.full((t, 2, 32), float(layer))
    return build_band(rid, 0, 1, fp, tensors, t, first_token=1)


def test_a_band_is_checked_before_anything_is_taken(tmp_path):
    tokens = IDS[:40]
    bands = {"ok": _band("ok", tokens),
             "bf16": _band("bf16", tokens, msgspec.structs.replace(FP, dtype="bfloat16")),
             "long": _band("long", [*tokens, 5])}  # fmt: skip
    stage = FakeStage(tmp_path / "s.sock", bands)
    gate = Gate(LLAMA, "float32", FP, 1 << 30)
    try:
        taken = []

        def take(spec, tensor):
            taken.append((spec.layer, spec.name, tensor.clone()))

        def pull(rid, t=40, **kw):
            return pull_band(stage.address, wire.Pull(rid, 0, FP), gate, num_stages=1,
                             num_tokens=t, take=take, deadline=time.monotonic() + 30,
                             **kw)  # fmt: skip

        header = pull("ok")
        assert header.layers == [0, 1]
        assert [(la, n) for la, n, _ in taken] == [(-1, "tokens"), (0, "k"), (0, "v"),
                                                   (1, "k"), (1, "v")]  # fmt: skip
        assert taken[0][2].tolist() == tokens and taken[3][2].eq(1.0).all()
        taken.clear()
        with pytest.raises(PullFailed, match="fingerprint dtype: the band has 'bfloat16'"):
            pull("bf16")
        with pytest.raises(PullFailed, match="the band's num_tokens is 41, kv_transfer_params "
                                             "name 40"):  # fmt: skip
            pull("long")
        assert taken == []  # nothing of a refused band was handed on

        def refuse(spec, tensor):
            raise wire.WireError("the band's prompt differs")

        with pytest.raises(PullFailed, match="prompt differs"):
            pull_band(stage.address, wire.Pull("ok", 0, FP), gate, num_stages=1, num_tokens=40,
                      take=refuse, deadline=time.monotonic() + 30)  # fmt: skip
        # a band the decoder needs none of: refused at its header, nothing taken
        assert pull("ok", refuse="the decoder needs none of it").layers == [0, 1]
        assert taken == []
        deadline = time.monotonic() + 10
        while stage.counts["acked refused"] < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stage.counts["acked ok"] == 1 and stage.counts["acked refused"] == 4
    finally:
        stage.close()
    with pytest.raises(PullFailed, match="cannot connect"):
        pull_band(stage.address, wire.Pull("ok", 0, FP), gate, num_stages=1, num_tokens=40,
                  take=lambda s, t: None, deadline=time.monotonic() + 5)  # fmt: skip
