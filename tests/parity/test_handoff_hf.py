"""A handed-off cache decodes in transformers exactly as the prompt itself would.

For each family (Llama, Kimi Linear: KDA + MLA + MoE, Qwen3-Next: Gated DeltaNet +
gated attention, MiniMax-M2) on a tiny checkpoint made here: the prompt's cache in
WavePP's layout — from transformers' own prefill cache, and cross-checked against
WavePP's own layers — is split into P = 1, 2 or 3 uneven bands, sent through a real
Receiver over a Unix socket, rebuilt as transformers' cache, and then
(a) the rebuilt cache's tensors equal transformers' own cache for the prompt, state bytes
included (a linear layer started from zeros would still decode fluent-looking text), and
(b) 16 greedy tokens from it equal ``generate()`` on the whole prompt.
"""

from __future__ import annotations

import tempfile

import anyio
import pytest
import torch

from tests.helpers.handoff_bands import (
    FAMILIES,
    VOCAB,
    config_dict,
    hf_prefill,
    layers_from_hf_cache,
    layers_from_wavepp,
    make_model,
    split_bands,
)
from wavepp.handoff.client import send_band
from wavepp.handoff.hf import (
    check_model,
    continue_generation,
    native_cache,
    to_transformers_cache,
)
from wavepp.handoff.receive import Receiver
from wavepp.handoff.wire import Address, fingerprint_from_hf_config

PROMPT_TOKENS = {"llama": 41, "kimi_linear": 57, "qwen3_next": 64, "minimax_m2": 70}
SPLITS = {  # uneven layer counts per stage, P = 1, 2, 3
    4: [[4], [1, 3], [2, 1, 1]],
    5: [[5], [3, 2], [1, 3, 1]],
}
NEW_TOKENS = 16


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    name = request.param
    model, path = make_model(name, tmp_path_factory.mktemp(name), seed=3)
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(3, VOCAB, (PROMPT_TOKENS[name],), generator=gen)
    cache, logits = hf_prefill(model, tokens)
    with torch.inference_mode():
        reference = model.generate(tokens[None], attention_mask=torch.ones_like(tokens[None]),
                                   max_new_tokens=NEW_TOKENS, do_sample=False)  # fmt: skip
    return {
        "name": name, "model": model, "path": path, "tokens": tokens, "cache": cache,
        "first": int(logits.argmax()), "top": float(logits.max()),
        "reference": reference[0, tokens.shape[0] :].tolist(),
    }  # fmt: skip


def receive(model, bands):
    """Send the bands (last stage first, to show order does not matter) through a real
    Receiver on a Unix socket; the assembled Handoff."""
    receiver = Receiver(config_dict(model), "float32")
    result = {}

    async def main(path):
        with anyio.fail_after(120):  # a hang guard
            async with anyio.create_task_group() as tg:
                address = await tg.start(receiver.serve, Address("unix", path=path))
                for header, payload in reversed(bands):
                    ack = await send_band(address, header, payload)
                    assert ack.ok, ack.error
                result["handoff"] = await receiver.wait(bands[0][0].request_id, 30)
                tg.cancel_scope.cancel()

    with tempfile.TemporaryDirectory() as tmp:
        anyio.run(main, f"{tmp}/h.sock")
    assert receiver.held_bytes == 0
    return result["handoff"]


def assert_cache_equal(rebuilt, own, kinds: str) -> None:
    """Every layer's tensors of the rebuilt cache against transformers' own, and the
    token count ``generate`` places the next token by (per layer where transformers
    keeps one for recurrent layers too, 5.25 on)."""
    assert int(rebuilt.get_seq_length()) == int(own.get_seq_length())
    for i, kind in enumerate(kinds):
        if kind == "L" and hasattr(own.layers[i], "cumulative_length_linear"):
            assert int(rebuilt.layers[i].get_seq_length()) == int(own.layers[i].get_seq_length())
        a, b = rebuilt.layers[i], own.layers[i]
        if kind in "AM":
            assert a.keys.shape == b.keys.shape and a.values.shape == b.values.shape
            torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=0)
            torch.testing.assert_close(a.values, b.values, rtol=0, atol=0)
            assert a.get_seq_length() == b.get_seq_length()
        else:
            conv_a, conv_b = a.conv_states[0], b.conv_states[0]  # [1, C, K]
            assert conv_a.shape == conv_b.shape
            # the newest K-1 inputs are the state; the oldest column is never read again
            torch.testing.assert_close(conv_a[..., 1:], conv_b[..., 1:], rtol=0, atol=0)
            assert not conv_a[..., 0].any()
            torch.testing.assert_close(a.recurrent_states[0], b.recurrent_states[0], rtol=0,
                                       atol=0)  # fmt: skip
            assert b.recurrent_states[0].abs().max() > 0.01  # a state worth checking
            assert a.has_previous_state[0]


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_handed_off_cache_decodes_like_the_prompt(family, stages):
    model, tokens = family["model"], family["tokens"]
    kinds = fingerprint_from_hf_config(config_dict(model), "float32").layer_kinds
    sizes = SPLITS[len(kinds)][stages - 1]
    layers = layers_from_hf_cache(model, family["cache"])
    bands = split_bands(model, f"{family['name']}-{stages}", tokens, layers, family["first"],
                        family["top"], sizes)  # fmt: skip
    assert [len(h.layers) for h, _ in bands] == sizes
    handoff = receive(model, bands)
    assert torch.equal(handoff.tokens, tokens)
    assert handoff.first_token == family["first"] == family["reference"][0]
    rebuilt = to_transformers_cache(handoff, model)
    assert_cache_equal(rebuilt, family["cache"], kinds)
    got = continue_generation(handoff, model, NEW_TOKENS)
    assert got == family["reference"], f"{family['name']} P={stages}: {got} != generate()"


def test_wavepp_layers_hold_what_the_mapping_says(family):
    """The tensors WavePP's own layers compute for the prompt are transformers' cache
    under the mapping (channel order, transposes, latent split), and decode the same."""
    model, tokens = family["model"], family["tokens"]
    ours = layers_from_wavepp(family["path"], tokens)
    theirs = layers_from_hf_cache(model, family["cache"])
    assert ours.keys() == theirs.keys()
    for i in theirs:
        assert ours[i].keys() == theirs[i].keys()
        for name, tensor in theirs[i].items():
            assert ours[i][name].shape == tensor.shape, (i, name)
            torch.testing.assert_close(ours[i][name], tensor, rtol=1e-3, atol=2e-4)
    sizes = SPLITS[len(theirs)][1]
    bands = split_bands(model, "native", tokens, ours, family["first"], family["top"], sizes)
    handoff = receive(model, bands)
    assert continue_generation(handoff, model, NEW_TOKENS) == family["reference"]


def test_a_handoff_for_another_model_is_refused(family, tmp_path):
    model = family["model"]
    layers = layers_from_hf_cache(model, family["cache"])
    ((header, payload),) = split_bands(model, "x", family["tokens"], layers, family["first"],
                                       family["top"], [len(layers)])  # fmt: skip
    handoff = receive(model, [(header, payload)])
    other = make_model("llama" if family["name"] != "llama" else "minimax_m2", tmp_path)[0]
    with pytest.raises(ValueError, match="handoff fingerprint architecture"):
        check_model(handoff, other)


def test_native_cache_and_generation_options(family):
    model, tokens = family["model"], family["tokens"]
    native = native_cache(model, tokens.tolist())
    own = layers_from_hf_cache(model, family["cache"])
    assert native.keys() == own.keys()
    for i in own:
        for name, tensor in own[i].items():
            torch.testing.assert_close(native[i][name], tensor, rtol=0, atol=0)
    bands = split_bands(model, "opts", tokens, own, family["first"], family["top"], [len(own)])
    handoff = receive(model, bands)
    ids = tokens[None]
    with torch.inference_mode():
        full = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)  # fmt: skip
    exact = continue_generation(handoff, model, NEW_TOKENS, stop_at_eos=False)
    assert exact == full[0, tokens.shape[0] :].tolist() and len(exact) == NEW_TOKENS
    sampled = [continue_generation(handoff, model, 8, temperature=1.0, seed=s) for s in (5, 5)]
    assert sampled[0] == sampled[1] and sampled[0][0] == family["first"]
    assert continue_generation(handoff, model, 1) == [family["first"]]
