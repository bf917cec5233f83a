"""All P stages of a real model in one process, driven wave by wave like the runtime:
the same Stage, reducers, planner and executor, with the collectives replaced by plain
MIN / AND over the stages' values."""

from __future__ import annotations

import anyio
import numpy as np
import torch

from wavepp.exec.stage import Admitted, Stage
from wavepp.exec.torch_exec import TorchExecutor
from wavepp.model import ModelConfig, build_stage
from wavepp.plan import Pending, PlanContext, static
from wavepp.plan.placement import even, given
from wavepp.rounds.admission import (
    Offer,
    RoundMode,
    StageBook,
    commit,
    fcfs_cut,
    lease_all,
    probe_points,
    serve_masks,
    settle,
)
from wavepp.rounds.messages import ChunkMsg, WaveMsg
from wavepp.state import block_hashes, empty_cache, point_from_mask


class Pipeline:
    def __init__(
        self, cfg: ModelConfig, weights, num_stages: int, block_size: int = 16,
        capacity: int = 256, snapshot_interval: int = 4, budget: int = 96,
        layers_per_stage: list[float] | None = None, dtype: torch.dtype = torch.float32,
    ) -> None:  # fmt: skip
        self.cfg, self.bs, self.budget = cfg, block_size, budget
        self.tokens: dict[str, np.ndarray] = {}
        self.stages = []
        placement = (given(layers_per_stage, cfg.num_layers) if layers_per_stage
                     else even(cfg.num_layers, num_stages))  # fmt: skip
        for s, units in enumerate(placement.spans):
            modules = build_stage(cfg, range(0), s == 0, s == num_stages - 1, weights,
                                  dtype=dtype, units=units)  # fmt: skip
            executor = TorchExecutor(modules, capacity, block_size,
                                     shared_first=placement.shared_first(s),
                                     shared_last=placement.shared_last(s))  # fmt: skip
            recurrent = any(cfg.kind(i) == "L" for i in executor.mixer_ids)
            book = StageBook(empty_cache(capacity, has_recurrent=recurrent))
            self.stages.append(Stage(s, book, executor, block_size, snapshot_interval,
                                     recurrent))  # fmt: skip
        self.wave_id = 0

    def admit(self, rid: str, tokens: np.ndarray) -> int:
        self.tokens[rid] = tokens
        offer = Offer(rid, len(tokens), block_hashes(tokens, self.bs), (len(tokens) - 1) // self.bs)
        mode = RoundMode(block_size=self.bs)
        books = [st.book for st in self.stages]
        point = min(probe_points(b.cache, [offer], mode)[0] for b in books)
        held = []
        for b in books:
            b.cache, h = lease_all(b.cache, [offer], [point], mode)
            held.append(h[0])
        base = min(held)
        mask = -1
        for b, h in zip(books, held, strict=True):
            mask &= serve_masks(b.cache, [offer], [base], [h])[0]
        agreed = point_from_mask(base, mask) or 0
        flags = []
        for b in books:
            b.cache, ok = settle(b.cache, [offer], [agreed], mode)
            flags.append(ok[0])
        admitted = fcfs_cut([min(flags)])
        for st in self.stages:
            st.book.cache, _ = commit(st.book.cache, [offer], admitted, mode)
            st.register(Admitted(offer, agreed))
        assert admitted[0], "test pools are large enough"
        return agreed

    def run(self, requests: list[tuple[str, np.ndarray]]) -> dict[str, tuple[int, int]]:
        """Admit and run the requests together; returns id -> (reuse point, first token)."""
        points = {rid: self.admit(rid, toks) for rid, toks in requests}
        queue = [Pending(rid, points[rid] * self.bs, len(t)) for rid, t in requests]
        firsts = {}
        while True:
            wave = static(queue, self.wave_id, PlanContext(self.budget, 2, 16))
            if wave is None:
                break
            self.wave_id += 1
            for chunk in wave.chunks:
                i = next(k for k, p in enumerate(queue) if p.request_id == chunk.request_id)
                queue[i] = Pending(chunk.request_id, chunk.end, chunk.num_tokens)
            queue = [p for p in queue if p.remaining]
            msg = WaveMsg(wave.wave_id, wave.budget,
                          [ChunkMsg(c.request_id, c.start, c.end, c.num_tokens, False)
                           for c in wave.chunks])  # fmt: skip
            x = None
            prompts = {c.request_id: self.tokens[c.request_id] for c in wave.chunks}
            for st in self.stages:  # stage 0 embeds the prompts, the others take activations
                output, _ = anyio.run(st.execute, msg, x, prompts if st.index == 0 else None)
                x = output.activations
            firsts.update(output.results)
        return {rid: (points[rid], firsts[rid][0]) for rid, _ in requests}

    def logits(self, rid: str):
        return self.stages[-1].executor.last_logits[rid]
