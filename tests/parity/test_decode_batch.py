"""The decode worker's batch (``wavepp.decode.batch``) decodes, for every family, what
``generate()`` decodes from each prompt alone: five sequences of different prompt and
output lengths joining at different steps and leaving as they finish (at their
``max_tokens`` or an end-of-sequence token), so the batch holds rows of different
lengths left-padded — attention keys, values and Kimi's MLA latents — and stacked
recurrent states."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.handoff_bands import FAMILIES, VOCAB, hf_prefill, make_model
from wavepp.decode.batch import Batch, Sequence
from wavepp.handoff.assembly import Handoff
from wavepp.handoff.hf import from_transformers_cache, to_transformers_cache
from wavepp.handoff.wire import fingerprint_from_hf_config

SHAPES = [(5, 12), (40, 3), (17, 20), (29, 7), (9, 15)]  # (prompt tokens, max_tokens)


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_sequences_decode_like_generate_alone(family, tmp_path):
    model, _ = make_model(family, tmp_path / family, seed=4)
    fingerprint = fingerprint_from_hf_config(model.config.to_dict(), "float32")
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(i))
               for i, (n, _) in enumerate(SHAPES)]  # fmt: skip
    want = []
    for tokens, (_, new) in zip(prompts, SHAPES, strict=True):
        with torch.inference_mode():
            full = model.generate(tokens[None], attention_mask=torch.ones_like(tokens[None]),
                                  max_new_tokens=new, do_sample=False)  # fmt: skip
        want.append(full[0, tokens.shape[0] :].tolist())
    batch, got, waiting, step = Batch(model), {}, list(range(len(SHAPES))), 0
    while waiting or len(batch):
        if waiting and step % 2 == 0:  # one joins every other step
            i = waiting.pop(0)
            cache, logits = hf_prefill(model, prompts[i])
            handoff = Handoff(f"r{i}", prompts[i], int(logits.argmax()), float(logits.max()),
                              from_transformers_cache(cache, model), fingerprint, 1)  # fmt: skip
            got[i] = [handoff.first_token]
            if SHAPES[i][1] > 1 and handoff.first_token not in batch.eos:
                batch.join(
                    Sequence(
                        f"r{i}",
                        handoff.first_token,
                        handoff.num_tokens,
                        SHAPES[i][1],
                        cache=to_transformers_cache(handoff, model),
                    )
                )
        if len(batch):
            members = list(batch.members)
            tokens = batch.step()
            for sequence, token in zip(members, tokens, strict=True):
                got[int(sequence.request_id[1:])].append(token)
            batch.leave([s for s, t in zip(members, tokens, strict=True)
                         if batch.finished(s, t)])  # fmt: skip
        step += 1
    assert batch.largest >= 3  # rows of different lengths shared steps
    for i in range(len(SHAPES)):
        assert got[i] == want[i], (family, i, SHAPES[i])
