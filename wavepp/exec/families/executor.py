"""The executor of a family model's stage: each layer kind declares its cache.

- Paged kinds (GQA, MLA) declare a per-token entry; the stage keeps one pool
  ``[capacity * block_size, *entry]`` per such layer, indexed by the slots the reducers
  hand out (K/V for GQA, the compressed latent for MLA).
- Recurrent kinds (KDA, Gated DeltaNet) declare their state: the delta-rule state and the
  short convolution's state. Running requests keep a live state; snapshots live in a
  preallocated pool ``[snapshot_capacity, *state]`` per layer and per state part,
  addressed by slot (``ChunkWork.snapshot_slots`` / ``resume_slot``). While the stage still
  passes block-hash keys, a key -> slot map stands in, freed by ``forget``.

Nothing here grows without bound: pools are preallocated, live states end with their
request (or ``cancel``), the key map is bounded by the snapshot pool, and the last
logits kept for inspection by ``KEEP_LOGITS``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

import anyio
import anyio.to_thread
import torch

from wavepp.exec.base import ChunkWork, StageOutput
from wavepp.exec.families.model import FamilyStage
from wavepp.state import BlockHash, RequestId

KEEP_LOGITS = 256  # last-stage logits kept for inspection, most recent requests


def _rows(query, a: int, b: int):
    """Rows a..b-1 of a projection result (a tensor or a tuple of tensors / None)."""
    if isinstance(query, tuple):
        return tuple(None if x is None else x[a:b] for x in query)
    return query[a:b]


class FamilyExecutor:
    simulated = False

    def __init__(self, modules: FamilyStage, capacity: int, block_size: int,
                 snapshot_capacity: int | None = None) -> None:  # fmt: skip
        self.m = modules
        self.cfg = modules.cfg
        self.block_size = block_size
        self.pools: dict[int, torch.Tensor] = {}  # layer -> [capacity * bs, *entry]
        self.snapshot_pools: dict[int, dict[str, torch.Tensor]] = {}  # layer -> part -> [S, ...]
        self.recurrent: list[int] = []
        self.snapshot_capacity = capacity if snapshot_capacity is None else snapshot_capacity
        for i in modules.layer_ids:
            mixer = modules.layer(i).mixer
            if mixer.paged:
                self.pools[i] = torch.zeros(capacity * block_size, *mixer.entry_shape())
            else:
                self.recurrent.append(i)
                self.snapshot_pools[i] = {
                    part: torch.zeros(self.snapshot_capacity, *shape)
                    for part, shape in mixer.state_shapes().items()
                }
        self.live: dict[RequestId, dict[int, dict[str, torch.Tensor]]] = {}
        self._key_slots: dict[BlockHash, int] = {}  # deprecated key path: hash -> slot
        self._free_slots = list(range(self.snapshot_capacity - 1, -1, -1))
        self.last_logits: OrderedDict[RequestId, torch.Tensor] = OrderedDict()

    # -- the protocol ---------------------------------------------------------------

    async def run(
        self, chunks: Sequence[ChunkWork], activations: torch.Tensor | None
    ) -> StageOutput:
        started = time.perf_counter()
        out, results = await anyio.to_thread.run_sync(self.forward, list(chunks), activations)
        return StageOutput(out, time.perf_counter() - started, results)

    def forget(self, evicted: Sequence[BlockHash]) -> None:
        """Blocks dropped by the state; on the key path their snapshots' slots free up."""
        for block in evicted:
            slot = self._key_slots.pop(block, None)
            if slot is not None:
                self._free_slots.append(slot)

    def cancel(self, rid: RequestId) -> None:
        self.live.pop(rid, None)

    def prior_cost(self) -> tuple[float, float, float, float]:
        """A rough (a, c, d, floor) prior for the cost planner: FLOPs at 10 GFLOP/s."""
        params = sum(p.numel() for p in self.m.model.layers.parameters())
        paged = sum(1 for i in self.m.layer_ids if self.cfg.kind(i) == "A")
        width = max(self.cfg.num_heads, 1) * max(self.cfg.head_dim, self.cfg.kv_lora_rank, 1)
        rate = 10e9
        return 2 * params / rate, 4 * width * paged / rate, 1e-3, 0.0

    def memory_report(self) -> dict:
        """Bytes this stage holds: the paged pools, the snapshot pools, live states."""

        def nbytes(tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors)

        live = [t for states in self.live.values() for s in states.values() for t in s.values()]
        return {
            "kv_bytes": nbytes(self.pools.values()),
            "snapshot_bytes": nbytes(t for p in self.snapshot_pools.values() for t in p.values()),
            "snapshot_capacity": self.snapshot_capacity if self.recurrent else 0,
            "live_state_bytes": nbytes(live),
        }

    # -- the math -------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, chunks: list[ChunkWork], x: torch.Tensor | None):
        """x: [tokens, d_model] from the previous stage (None on stage 0)."""
        if x is None:
            tokens = torch.cat([torch.as_tensor(c.tokens, dtype=torch.long) for c in chunks])
            x = self.m.model.embed_tokens(tokens)
        spans, at = [], 0
        for c in chunks:
            spans.append((at, at + c.end - c.start))
            at += c.end - c.start
        if at != x.shape[0]:
            raise ValueError(f"wave of {at} tokens got activations for {x.shape[0]}")
        positions = torch.cat([torch.arange(c.start, c.end) for c in chunks])  # [tokens]
        for i in self.m.layer_ids:
            layer = self.m.layer(i)
            h = layer.input_layernorm(x)
            if i in self.pools:
                mixed = self._paged(i, layer.mixer, chunks, spans, h, positions)
            else:
                mixed = torch.cat([self._recurrent(i, layer.mixer, c, h[a:b])
                                   for c, (a, b) in zip(chunks, spans, strict=True)])  # fmt: skip
            x = x + mixed
            x = x + layer.ffn(layer.post_attention_layernorm(x))
        for c in chunks:
            if c.is_last:
                self.live.pop(c.request_id, None)
        if not self.m.last:
            return x, {}
        results = {}
        for c, (_, b) in zip(chunks, spans, strict=True):
            if c.is_last:
                logits = self.m.head(x[b - 1 : b])[0]
                self.last_logits[c.request_id] = logits
                while len(self.last_logits) > KEEP_LOGITS:
                    self.last_logits.popitem(last=False)
                results[c.request_id] = (int(logits.argmax()), float(logits.max()))
        return None, results

    def _slots(self, c: ChunkWork, positions: torch.Tensor) -> torch.Tensor:
        table = torch.as_tensor(c.block_table, dtype=torch.long)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def _paged(self, i, mixer, chunks, spans, h, positions) -> torch.Tensor:
        # h: [tokens, d_model]; projections for the whole wave, attention chunk by chunk
        query, entries = mixer.project(h, positions)  # entries: [tokens, *entry]
        pool = self.pools[i]
        outs = []
        for c, (a, b) in zip(chunks, spans, strict=True):
            pool[self._slots(c, positions[a:b])] = entries[a:b]
            prefix = pool[self._slots(c, torch.arange(c.end))]  # [end, *entry]
            outs.append(mixer.attend(_rows(query, a, b), prefix, positions[a:b]))
        return torch.cat(outs)

    def _resume(self, i: int, mixer, c: ChunkWork) -> dict[str, torch.Tensor] | None:
        states = self.live.setdefault(c.request_id, {})
        if i in states:
            return states[i]
        if c.start == 0:
            return None
        slot = c.resume_slot
        if slot is None and c.prefix_key is not None:
            slot = self._key_slots.get(c.prefix_key)
        if slot is None:
            raise RuntimeError(
                f"{c.request_id}: no recurrent state to resume at token {c.start} on layer {i} "
                "(no live state, no resume_slot, no snapshot under prefix_key)"
            )
        return {part: pool[slot].clone() for part, pool in self.snapshot_pools[i].items()}

    def _save_slots(self, c: ChunkWork) -> list[int]:
        if c.snapshot_slots or not c.snapshot_points:
            if len(c.snapshot_slots) != len(c.snapshot_points):
                raise ValueError(f"{c.request_id}: {len(c.snapshot_points)} snapshot points but "
                                 f"{len(c.snapshot_slots)} slots")  # fmt: skip
            return list(c.snapshot_slots)
        slots = []
        for key in c.snapshot_keys:  # deprecated key path
            if key not in self._key_slots:
                if not self._free_slots:
                    raise RuntimeError(
                        f"snapshot pool of {self.snapshot_capacity} slots is full; "
                        "stage.py must pass snapshot_slots from the state's snapshot pool"
                    )
                self._key_slots[key] = self._free_slots.pop()
            slots.append(self._key_slots[key])
        return slots

    def _recurrent(self, i: int, mixer, c: ChunkWork, h: torch.Tensor) -> torch.Tensor:
        # h: [n, d_model] at positions c.start..c.end-1
        state = self._resume(i, mixer, c)
        cuts = tuple(k * self.block_size - c.start for k in c.snapshot_points)
        out, after, at_cuts = mixer.chunk(h, state, cuts)
        pools = self.snapshot_pools[i]
        for slot, saved in zip(self._save_slots(c), at_cuts, strict=True):
            for part, tensor in saved.items():
                pools[part][slot] = tensor
        self.live[c.request_id][i] = after
        return out
