"""Continuous batching for the reference decode worker: one forward per step for every
sequence in flight; a sequence joins and leaves between steps.

Every supported family batches (Llama, MiniMax-M2, Kimi Linear, Qwen3-Next), in one
``DynamicCache`` of batch B, as ``generate()`` batches left-padded prompts:

- attention layers (``A``; Kimi's MLA ``M``, whose keys and values are the compressed
  latent and the shared key part): keys and values ``[B, ·, L, ·]``, each sequence
  *left*-padded with zeros to the longest one's length L; the step's 2-D attention mask
  ``[B, L + 1]`` is 0 on the padding, so a padded column gets no weight;
- recurrent layers (``L``: Kimi's KDA, Qwen3-Next's Gated DeltaNet): the conv and
  recurrent states stacked on the batch dim — they have no length, so no padding; a
  one-token step never masks them (transformers' ``create_recurrent_attention_mask``);
  their token count (``cumulative_length_linear``, what the mask sizes read) is L.

Each step feeds each sequence its last token at its own position (``position_ids`` =
its tokens so far, which RoPE reads) and takes the argmax of its logits: greedy, as
``generate(do_sample=False)`` is with the default logits processors (none for a plain
``generation_config``). A sequence leaves after its ``max_tokens`` or at an
end-of-sequence token (that token included, as ``generate`` does), or when it is
cancelled; the batch then drops its rows, and the padding columns no sequence left
needs. Everything here runs in the worker's decode thread; nothing is shared with the
event loop but what :class:`Batch`'s caller passes in and gets back.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import attrs
import torch


@attrs.define(eq=False)
class Sequence:
    """One generation: ``next_token`` goes in at position ``length`` (the tokens its
    cache holds); ``produced`` counts the tokens it has answered, the first included."""

    request_id: str
    next_token: int
    length: int
    max_tokens: int
    produced: int = 1
    cache: object = None  # its own cache until it joins the batch


def eos_ids(model) -> frozenset[int]:
    eos = model.generation_config.eos_token_id
    return frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])


class Batch:
    """The sequences in flight and their batched cache (rows in ``members`` order)."""

    def __init__(self, model) -> None:
        self.model = model
        self.eos = eos_ids(model)
        self.members: list[Sequence] = []
        self.cache = None
        self.width = 0  # L: the padded length every attention layer holds
        self.steps = 0  # forwards run
        self.largest = 0  # the most sequences one forward carried

    def __len__(self) -> int:
        return len(self.members)

    # -- joining and leaving (between steps) ------------------------------------------

    def join(self, sequence: Sequence) -> None:
        """Add a sequence whose ``cache`` is its own (``to_transformers_cache``, batch 1)."""
        own, sequence.cache = sequence.cache, None
        if not self.members:
            self.cache, self.width = own, sequence.length
            _set_width(self.cache, self.width)
            self.members.append(sequence)
            return
        width = max(self.width, sequence.length)
        for mine, theirs in zip(self.cache.layers, own.layers, strict=True):
            if _recurrent(mine):
                for name in ("conv_states", "recurrent_states"):
                    states, new = getattr(mine, name), getattr(theirs, name)
                    for i, state in states.items():
                        if state is not None:
                            states[i] = torch.cat([state, new[i]])
            else:
                mine.keys = torch.cat([_pad(mine.keys, width), _pad(theirs.keys, width)])
                mine.values = torch.cat([_pad(mine.values, width), _pad(theirs.values, width)])
        self.width = width
        _set_width(self.cache, width)
        self.members.append(sequence)

    def leave(self, gone: Seq[Sequence]) -> None:
        """Drop these sequences' rows, and the padding columns no remaining row needs."""
        gone_ids = {id(s) for s in gone}
        keep = [i for i, s in enumerate(self.members) if id(s) not in gone_ids]
        if len(keep) == len(self.members):
            return
        self.members = [self.members[i] for i in keep]
        if not self.members:
            self.cache, self.width = None, 0
            return
        rows = torch.tensor(keep, dtype=torch.long)
        width = max(s.length for s in self.members)
        for layer in self.cache.layers:
            if _recurrent(layer):
                for states in (layer.conv_states, layer.recurrent_states):
                    for i, state in states.items():
                        if state is not None:
                            states[i] = state.index_select(0, rows.to(state.device))
            else:
                cut = self.width - width
                layer.keys = layer.keys.index_select(0, rows.to(layer.keys.device))[..., cut:, :]
                layer.values = layer.values.index_select(0, rows.to(layer.values.device))[
                    ..., cut:, :]  # fmt: skip
        self.width = width
        _set_width(self.cache, width)

    # -- one step ----------------------------------------------------------------------

    def step(self) -> list[int]:
        """One forward for every member: each one's next token, in ``members`` order.
        Members' ``next_token``, ``length`` and ``produced`` move on; the caller decides
        who leaves (:meth:`finished`)."""
        model, members = self.model, self.members
        device = model.device
        ids = torch.tensor([[s.next_token] for s in members], device=device)
        mask = torch.zeros(len(members), self.width + 1, dtype=torch.long, device=device)
        for row, s in enumerate(members):
            mask[row, self.width - s.length :] = 1
        positions = torch.tensor([[s.length] for s in members], device=device)
        with torch.inference_mode():
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                        cache=self.cache, use_cache=True)  # fmt: skip
        tokens = out.logits[:, -1].float().argmax(-1).tolist()
        self.width += 1
        self.steps += 1
        self.largest = max(self.largest, len(members))
        for s, token in zip(members, tokens, strict=True):
            s.next_token, s.length, s.produced = token, s.length + 1, s.produced + 1
        return tokens

    def finished(self, sequence: Sequence, token: int) -> bool:
        return sequence.produced >= sequence.max_tokens or token in self.eos


def _recurrent(layer) -> bool:
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    if isinstance(layer, LinearAttentionCacheLayerMixin):
        return True
    if not hasattr(layer, "keys"):
        raise ValueError(f"cannot batch a {type(layer).__name__} cache layer")
    return False


def _pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, H, T, D]`` left-padded with zeros to ``[B, H, width, D]``."""
    missing = width - tensor.shape[-2]
    if missing == 0:
        return tensor
    return torch.nn.functional.pad(tensor, (0, 0, missing, 0))


def _set_width(cache, width: int) -> None:
    """Recurrent layers count the tokens behind their state: the padded width here, as
    the attention layers hold (the mask's sizes read it where layer 0 is recurrent)."""
    for layer in cache.layers:
        seen = getattr(layer, "cumulative_length_linear", None)
        if isinstance(seen, torch.Tensor):
            seen.fill_(width)
