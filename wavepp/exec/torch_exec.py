"""The torch executor: one stage of a real decoder LM over a paged KV pool (DESIGN §6).

Per stage it holds, for every attention layer, a KV pool ``[capacity * block, KV, hd]``
indexed by the slots the state reducers hand out, and, for linear-attention layers,
the live recurrent state of each running request plus snapshots at block boundaries
keyed by the hash of the block they follow. The cache effects are exactly the ones the
reducers decided: this class only reads and writes the slots and snapshots it is told.

Weights, pools and recurrent states live on one device in one dtype. A wave's
token-wise work (projections, RoPE, MLP) runs on all its chunks at once; attention
reads the pool through the block tables of all chunks in one call per layer
(``wavepp.exec.attention``, its metadata built once per wave); the recurrence runs
chunk by chunk. The forward runs in a worker thread, so the event loop keeps
admitting while it computes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import anyio
import anyio.to_thread
import torch

from wavepp.exec.attention import PagedBatch, paged_attention, write_paged
from wavepp.exec.base import ChunkWork, StageOutput
from wavepp.exec.model import Attention, GatedLinearAttention, StageModules, rope_tables
from wavepp.state import BlockHash, RequestId


class TorchExecutor:
    simulated = False

    def __init__(self, modules: StageModules, capacity: int, block_size: int) -> None:
        """``modules`` already on their device in their dtype (``build_stage``); the pools
        and states follow them."""
        self.m = modules
        self.cfg = modules.cfg
        self.block_size = block_size
        cfg = self.cfg
        weight = next(modules.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        # The attention kernel over the paged pool (swappable: the benchmark compares it
        # with the old copying path).
        self.attention = paged_attention
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i in modules.layer_ids:
            if cfg.kind(i) == "A":
                shape = (capacity * block_size, cfg.num_kv_heads, cfg.head_dim)
                self.kv[i] = (self._zeros(shape), self._zeros(shape))  # [slot*bs+off, KV, hd]
        self.recurrent = [i for i in modules.layer_ids if cfg.kind(i) == "L"]
        self.live: dict[RequestId, dict[int, torch.Tensor]] = {}  # running requests' states
        self.snapshots: dict[BlockHash, dict[int, torch.Tensor]] = {}
        self.last_logits: dict[RequestId, torch.Tensor] = {}  # last stage, for inspection

    # -- the protocol ---------------------------------------------------------------

    async def run(
        self, chunks: Sequence[ChunkWork], activations: torch.Tensor | None
    ) -> StageOutput:
        started = time.perf_counter()
        out, results = await anyio.to_thread.run_sync(self.forward, list(chunks), activations)
        return StageOutput(out, time.perf_counter() - started, results)

    def forget(self, evicted: Sequence[BlockHash]) -> None:
        for block in evicted:
            self.snapshots.pop(block, None)

    def prior_cost(self) -> tuple[float, float, float, float]:
        """A rough (a, c, d, floor) prior for the cost planner: FLOPs at 10 GFLOP/s."""
        params = sum(p.numel() for p in self.m.model.layers.parameters())
        attn = sum(1 for i in self.m.layer_ids if self.cfg.kind(i) == "A")
        rate = 10e9
        return (
            2 * params / rate,
            4 * self.cfg.num_heads * self.cfg.head_dim * attn / rate,
            1e-3,
            0.0,
        )

    def cancel(self, rid: RequestId) -> None:
        self.live.pop(rid, None)
        self.last_logits.pop(rid, None)

    def memory_report(self) -> dict[str, int]:
        """Bytes this stage holds, by kind (the KV pools are allocated up front)."""

        def size(tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors)

        return {
            "weights_bytes": size(self.m.parameters()),
            "kv_pool_bytes": size(t for pair in self.kv.values() for t in pair),
            "snapshot_bytes": size(t for s in self.snapshots.values() for t in s.values()),
            "num_snapshots": len(self.snapshots),
            "live_state_bytes": size(t for s in self.live.values() for t in s.values()),
        }

    # -- the math -------------------------------------------------------------------

    def _zeros(self, shape) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def forward(self, chunks: list[ChunkWork], x: torch.Tensor | None):
        """x: [tokens, d_model] from the previous stage (None on stage 0)."""
        if x is None:
            tokens = torch.cat([torch.as_tensor(c.tokens, dtype=torch.long) for c in chunks])
            x = self.m.model.embed_tokens(tokens.to(self.device))
        batch = PagedBatch.build(chunks, self.block_size, self.device)
        if batch.num_tokens != x.shape[0]:
            raise ValueError(f"wave of {batch.num_tokens} tokens got activations for {x.shape[0]}")
        x = x.to(self.device, self.dtype)  # x: [tokens, d_model]
        tables = None
        if self.kv:
            cfg = self.cfg
            tables = rope_tables(batch.positions, cfg.head_dim, cfg.rope_theta, self.dtype)
        for i in self.m.layer_ids:
            layer = self.m.layer(i)
            h = layer.input_layernorm(x)
            mixer = layer.mixer
            if isinstance(mixer, Attention):
                mixed = self._attention(i, mixer, batch, h, tables)
            else:
                mixed = torch.cat(
                    [
                        self._recurrence(i, mixer, c, h[a:b])
                        for c, (a, b) in zip(chunks, batch.spans, strict=True)
                    ]
                )
            x = x + mixed
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        for c in chunks:
            if c.is_last:
                self.live.pop(c.request_id, None)
        if not self.m.last:
            return x, {}
        results = {}
        ends = [b - 1 for c, (_, b) in zip(chunks, batch.spans, strict=True) if c.is_last]
        if ends:
            logits = self.m.head(x[ends]).float()  # [finished, vocab]
            top, best = logits.max(-1)
            for row, c in enumerate(c for c in chunks if c.is_last):
                self.last_logits[c.request_id] = logits[row]
                results[c.request_id] = (int(best[row]), float(top[row]))
        return None, results

    def _attention(self, i: int, mixer: Attention, batch: PagedBatch, h: torch.Tensor,
                   tables) -> torch.Tensor:  # fmt: skip
        # h: [T, d_model], the wave's new tokens; their prefixes are in the pool.
        q, k, v = mixer.qkv(h, batch.positions, tables)  # q: [T, H, hd]; k, v: [T, KV, hd]
        keys, values = self.kv[i]
        write_paged(keys, batch, k)
        write_paged(values, batch, v)
        out = self.attention(q, keys, values, batch, mixer.cfg.head_dim**-0.5)  # [T, H, hd]
        return mixer.o_proj(out.reshape(out.shape[0], -1))

    def _recurrence(
        self, i: int, mixer: GatedLinearAttention, c: ChunkWork, h: torch.Tensor
    ) -> torch.Tensor:
        states = self.live.setdefault(c.request_id, {})
        if i not in states:
            if c.prefix_key is not None:
                states[i] = self.snapshots[c.prefix_key][i].clone()
            elif c.start == 0:
                states[i] = self._zeros(mixer.state_shape())
            else:
                raise RuntimeError(f"{c.request_id}: no state to resume at token {c.start}")
        q, k, v, a = mixer.project(h)
        bs = self.block_size
        saves = dict(zip(c.snapshot_points, c.snapshot_keys, strict=True))
        outs, state, at = [], states[i], c.start
        while at < c.end:  # pieces end on block boundaries, where snapshots are taken
            stop = min(c.end, (at // bs + 1) * bs)
            a0, a1 = at - c.start, stop - c.start
            o, state = mixer.scan(q[a0:a1], k[a0:a1], v[a0:a1], a[a0:a1], state)
            outs.append(o)
            if stop % bs == 0 and stop // bs in saves:
                self.snapshots.setdefault(saves[stop // bs], {})[i] = state.clone()
            at = stop
        states[i] = state
        return mixer.finish(h, torch.cat(outs))
