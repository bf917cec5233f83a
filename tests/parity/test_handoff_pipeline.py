"""The pipeline hands each prompt's cache on, and transformers continues from it.

For each family's tiny checkpoint (made here by ``transformers``), a run under torchrun
at P = 1, 2 or 3 stages (some of two tensor-parallel ranks, whose leader puts the heads
together) with uneven layers (some stage boundaries between a layer's mixer and its MLP, one
inside an attention mixer that two stages share)
prefills prompts that reuse cached prefixes
(so handed-off blocks were computed by earlier requests), ending on and off block
boundaries; every stage sends its band to a real receiver on a Unix socket. Then, per
prompt: the received tensors equal transformers' own cache for the prompt (fp32
tolerance: the state bytes, not only the tokens), and 16 greedy tokens decoded from the
handed-off cache equal ``generate()`` on the whole prompt.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.families import VOCAB
from tests.helpers.handoff_bands import make_model
from tests.helpers.handoff_rig import ReceiverThread, run_pipeline, write_requests
from wavepp.handoff.hf import continue_generation, native_cache

pytestmark = pytest.mark.slow
TOL = 1e-4
NEW_TOKENS = 16


def prompts(seed: int) -> dict[str, list[int]]:
    """A document of 4 blocks (16 tokens each), then turns that extend it: on a block
    boundary, off it, and a turn that extends an earlier turn."""
    rng = np.random.default_rng(seed)

    def draw(n: int) -> list[int]:
        return rng.integers(3, VOCAB, n).tolist()

    doc = draw(64)
    turn = doc + draw(23)
    return {"doc": doc, "turn": turn, "aligned": doc + draw(32), "deeper": turn + draw(30)}


CASES = [  # (family, stages, layers per stage (a half: a boundary between a layer's mixer
    # and its MLP; another fraction: inside a mixer, which the two stages share), TP)
    ("llama", 3, "1.5,1.5,1", 1),
    ("kimi_linear", 1, None, 1),
    ("kimi_linear", 2, "3,2", 1),
    ("kimi_linear", 3, "1.5,1.5,2", 1),
    ("qwen3_next", 3, "2,2,1", 1),
    ("minimax_m2", 2, "1.3,2.7", 1),  # layer 1's attention shared by the two stages
    # a stage over two ranks: its leader puts the followers' heads together
    ("kimi_linear", 2, "3,2", 2),
    ("qwen3_next", 1, None, 2),
]


@pytest.mark.parametrize(("family", "stages", "split", "tp"), CASES,
                         ids=[f"{f}-P{p}" + (f"-TP{t}" if t > 1 else "")
                              for f, p, _, t in CASES])  # fmt: skip
def test_a_handed_off_cache_is_transformers_own_and_decodes_the_same(
    tmp_path, family, stages, split, tp
):
    model, path = make_model(family, tmp_path / "ckpt")
    config = model.config.to_dict()
    asked = prompts(stages)
    requests = write_requests(tmp_path / "requests.jsonl", asked, True)
    with ReceiverThread(config, "float32", tmp_path / "rx.sock") as rx:
        options = ["--concurrency", "1", "--handoff-to", rx.address]
        if split:
            options += ["--layers-per-stage", split]
        record = run_pipeline(stages * tp, str(path), requests, tmp_path / "out.json",
                              "--tp", str(tp), *options)  # fmt: skip
    by_id = {r["id"]: r for r in record["requests"]}
    assert record["handoff"] == {"done": len(asked)}
    assert by_id["deeper"]["cached_tokens"] >= 80  # reused blocks were handed off too
    assert sorted(rx.handoffs) == sorted(asked)
    for rid, tokens in asked.items():
        handoff = rx.handoffs[rid]
        assert by_id[rid]["handoff"]["status"] == "done"
        assert [s["stage"] for s in by_id[rid]["handoff"]["stages"]] == list(range(stages))
        assert handoff.tokens.tolist() == tokens
        assert handoff.first_token == by_id[rid]["first_token"]
        # the tensors: transformers' own cache for the prompt, in the wire's layout
        expected = native_cache(model, tokens)
        assert sorted(handoff.layers) == sorted(expected) == list(range(len(expected)))
        for layer, parts in expected.items():
            assert sorted(handoff.layers[layer]) == sorted(parts), (rid, layer)
            for name, want in parts.items():
                got = handoff.layers[layer][name]
                assert got.shape == want.shape, (rid, layer, name)
                diff = (got.float() - want.float()).abs().max().item()
                assert diff <= TOL * max(1.0, want.abs().max().item()), (rid, layer, name, diff)
        # the tokens: decoding from the handed-off cache = decoding the whole prompt
        ids = torch.tensor([tokens])
        with torch.inference_mode():
            full = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)  # fmt: skip
        ours = continue_generation(handoff, model, NEW_TOKENS, stop_at_eos=False)
        assert ours == full[0, len(tokens):].tolist(), rid
