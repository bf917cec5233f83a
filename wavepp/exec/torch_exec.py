"""The torch executor: one stage of a real decoder LM over a paged pool (DESIGN §6).

Each layer kind declares its cache (the seam in ``wavepp.model``):

- a **paged** kind names the per-token entries it keeps (K/V for GQA, the compressed
  latent for MLA); the stage holds one pool ``[capacity * block_size, *entry]`` per
  entry and layer, indexed by the slots the state reducers hand out, and the kind runs
  the whole wave over it in one call per layer (``wavepp.model.attention``);
- a **recurrent** kind names its state parts (the delta-rule state and the short
  convolution's state; or one state for gated linear attention). Running requests keep
  a live state; snapshots live in a preallocated pool ``[snapshot_capacity, *part]``
  per layer and part, addressed by slot: ``ChunkWork.snapshot_slots`` to save into,
  ``resume_slot`` to resume from.

The cache effects are exactly the ones the reducers decided: this class only reads and
writes the slots it is told. Nothing grows without bound: pools are preallocated, live
states end with their request (or ``cancel``), the last logits kept for inspection by
``KEEP_LOGITS``.

Weights, pools and states live on one device (recurrent states in fp32, pools in the
weights' dtype). A wave's token-wise work (projections, MLP, experts) runs on all its
chunks at once; paged attention reads the pool through the block tables of all chunks;
the recurrence runs chunk by chunk, chunk-parallel inside. On the last stage, the
model's last layer writes its cache for every token and computes its outputs only for
the last token of each prompt the wave ends, the rows the logits read
(``full_last_layer``: for every token). Every wave runs on one thread of the executor's
own, so the event loop keeps admitting while it computes.

A stage split over tensor-parallel ranks (``build_stage(..., tp=group)``) runs the same
waves on each of its ranks: each rank's mixers and MLPs give partial sums over its
heads, widths and experts, completed by one all-reduce over ``modules.tp`` per mixer and
one per MLP; pools and snapshots hold the rank's heads (``wavepp.model.tp``).
"""

from __future__ import annotations

import asyncio
import ctypes
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from functools import cache, partial

import anyio
import numpy as np
import torch
from torch import nn

from wavepp.dtypes import name_of
from wavepp.exec import compute
from wavepp.exec.base import ChunkWork, StageOutput
from wavepp.handoff.base import BandTensor
from wavepp.model import cpu_kernel
from wavepp.model.attention import PagedBatch, to_queries
from wavepp.model.fused import FusedLayer, fusable
from wavepp.rounds.messages import MAX_MESSAGE_BYTES
from wavepp.state import BlockHash, RequestId
from wavepp.transport.frames import DataLimits

_HUGE = 2 << 20  # bytes in a transparent huge page on x86-64
_MADV_HUGEPAGE = 14
_LIBC: list = []


def _libc():
    """The C library of this process (loaded once), or None where ctypes cannot."""
    if not _LIBC:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _LIBC.append(libc)
        except (OSError, AttributeError):
            _LIBC.append(None)
    return _LIBC[0]


def huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux for transparent huge pages under ``tensor``'s whole 2 MiB pages
    (``madvise(MADV_HUGEPAGE)``); False where the call is not available or refused.
    Call it before the memory is first touched."""
    start = tensor.data_ptr()
    lo = -(-start // _HUGE) * _HUGE
    hi = (start + tensor.numel() * tensor.element_size()) // _HUGE * _HUGE
    if _libc() is None or hi <= lo:
        return False
    return _libc().madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_KEEP_FREED = 1 << 30  # bytes of freed heap kept before any is returned to the system


def keep_freed_memory() -> bool:
    """Ask glibc to keep the memory a wave frees for the next wave: activations of up to
    32 MiB come from the heap rather than fresh mappings, and up to 1 GiB of freed heap
    stays mapped (process-wide). Waves run on a thread of their own, whose arena
    otherwise gave its freed activations back and faulted them in again: a P = 1 run of
    vllm_compare's short-suffix row took 681K page faults and ran at 78-85K tok/s, with
    this 135K and 81-104K (three runs each, interleaved). False where glibc is absent."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
                and libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_FREED))  # fmt: skip


KEEP_LOGITS = 256  # last-stage logits kept for inspection, most recent requests
State = dict[str, torch.Tensor]  # one recurrent layer's state, by part


class TorchExecutor:
    simulated = False

    def __init__(self, modules: nn.Module, capacity: int, block_size: int,
                 snapshot_capacity: int | None = None, compile: bool = False,
                 full_last_layer: bool = False, shared_first: float | None = None,
                 shared_last: float | None = None) -> None:  # fmt: skip
        """``modules``: a stage (``build_stage``) already on its device in its dtype; the
        pools and states follow it. ``snapshot_capacity``: slots of the snapshot pool
        (default ``capacity``: at most one snapshot per cached block). ``compile``: run
        Llama-shaped layers' token-wise work through ``torch.compile``
        (``wavepp.model.fused``), compiled here, before the first wave.
        ``full_last_layer``: run the model's last layer for every token, as a plain
        forward does; by default its cache entries (keys and values, latents, recurrent
        states) are computed for every token and its outputs (attention, MLP) only for
        the last token of each prompt that ends in the wave, the only rows the logits
        read. ``shared_first`` / ``shared_last``: the stage's first (last) layer is one
        whose attention it shares with the stage before (after) it, at that share of the
        rows' work (``wavepp.plan.placement``); see :meth:`forward`."""
        self.m = modules
        self.tp = modules.tp  # the stage's tensor-parallel ranks: sums partial outputs
        # layers whose mixer (and cache) this stage holds: all of its layers, but the
        # last when a stage boundary falls between that layer's mixer and its MLP
        self.mixer_ids = [i for i in modules.layer_ids if modules.layer(i).has_mixer]
        self.full_last_layer = full_last_layer
        self.shared_first, self.shared_last = shared_first, shared_last
        self._check_shared()
        self.cfg = modules.cfg
        self.block_size = block_size
        weight = next(modules.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        # Built now (a C++ build of about 15 s, once per machine), not in a wave.
        self.attention_kernel = (cpu_kernel.describe(self.device, self.dtype)
                                 if any(m.paged for m in self._mixers()) else None)  # fmt: skip
        self.snapshot_capacity = capacity if snapshot_capacity is None else snapshot_capacity
        self.pools: dict[int, dict[str, torch.Tensor]] = {}  # layer -> entry -> [rows, ...]
        self.snapshot_pools: dict[int, dict[str, torch.Tensor]] = {}  # layer -> part -> [S, ..]
        for i in self.mixer_ids:
            mixer = modules.layer(i).mixer
            if mixer.paged:
                self.pools[i] = {
                    name: self._zeros((capacity * block_size, *shape), self.dtype)
                    for name, shape in mixer.cache_layout().items()
                }
            else:
                self.snapshot_pools[i] = {
                    part: self._zeros((self.snapshot_capacity, *shape), torch.float32)
                    for part, shape in mixer.state_shapes().items()
                }
        self.recurrent = list(self.snapshot_pools)
        self.has_recurrent = any(self.cfg.kind(i) == "L" for i in self.mixer_ids)
        self.live: dict[RequestId, dict[int, State]] = {}  # running requests' states
        # ended requests that hand their cache on: their states after the last token,
        # until the stage's sender takes them (take_final) or the request is cancelled
        self.finals: dict[RequestId, dict[int, State]] = {}
        self.last_logits: OrderedDict[RequestId, torch.Tensor] = OrderedDict()
        if self.device.type == "cpu":
            keep_freed_memory()
        self.fused: dict[int, FusedLayer] = {}  # layer -> its compiled form (--compile)
        self.compile = compile
        if compile:  # a shared layer runs eagerly: the fused form attends every row
            shared = self._shared_layers()
            self.fused = {i: FusedLayer(modules.layer(i)) for i in modules.layer_ids
                          if fusable(modules.layer(i)) and i not in shared}  # fmt: skip
            self._warm_compiled()

    def _mixers(self):
        return [self.m.layer(i).mixer for i in self.mixer_ids]

    def _shared_layers(self) -> set[int]:
        """The layers whose mixer this stage shares with a neighbour."""
        ids = self.m.layer_ids
        first = [ids[0]] if self.shared_first is not None else []
        return set(first + ([ids[-1]] if self.shared_last is not None else []))

    def _check_shared(self) -> None:
        """A shared layer's mixer is paged attention, held here (with its cache); the
        stage before holds only that mixer of the layer, the stage after its MLP too."""
        for share in (self.shared_first, self.shared_last):
            if share is not None and not 0.0 <= share <= 1.0:
                raise ValueError(f"a shared mixer's share is {share}, not within 0..1")
        if self.tp.size > 1 and self._shared_layers():
            raise ValueError("a mixer shared by two stages cannot also be split over "
                             "tensor-parallel ranks")  # fmt: skip
        for i in self._shared_layers():
            layer = self.m.layer(i)
            if not (layer.has_mixer and layer.mixer.paged):
                raise ValueError(f"layer {i}: only an attention mixer (a paged cache) can be "
                                 "shared by two stages")  # fmt: skip
        if self.shared_last is not None and self.m.last:
            raise ValueError("the last stage cannot share a mixer with a stage after it")
        if self.shared_last is not None and self.m.layer(self.m.layer_ids[-1]).has_ffn:
            raise ValueError("the stage before a shared mixer ends with it, without its MLP")
        if self.shared_first is not None and self.m.first:
            raise ValueError("stage 0 cannot share a mixer with a stage before it")

    # -- the protocol ---------------------------------------------------------------

    async def run(
        self, chunks: Sequence[ChunkWork], activations: torch.Tensor | None
    ) -> StageOutput:
        started = time.perf_counter()
        # every wave on the process's compute thread (wavepp.exec.compute)
        future = compute.submit(self.forward, list(chunks), activations)
        with anyio.CancelScope(shield=True):  # a cancelled run still owns the stage's state
            out, results = await asyncio.wrap_future(future)
        return StageOutput(out, time.perf_counter() - started, results)

    def forget(self, evicted: Sequence[BlockHash]) -> None:
        """Nothing is kept for a block: the state owns every KV and snapshot slot."""

    def prior_cost(self) -> tuple[float, float, float, float]:
        """A rough (a, c, d, floor) prior for the cost planner: FLOPs at 10 GFLOP/s."""
        params = sum(p.numel() for p in self.m.model.layers.parameters())
        for m in self.m.model.layers.modules():  # a token only runs top_k of the experts
            if hasattr(m, "experts") and hasattr(m, "top_k"):
                inactive = 1.0 - m.top_k / m.num_experts
                params -= int(inactive * sum(p.numel() for p in m.experts.parameters()))
        cfg = self.cfg
        width = cfg.num_heads // self.tp.size * max(cfg.head_dim, cfg.kv_lora_rank, 1)
        rate = 10e9
        return 2 * params / rate, 4 * width * len(self.pools) / rate, 1e-3, 0.0

    def cancel(self, rid: RequestId) -> None:
        self.live.pop(rid, None)
        self.finals.pop(rid, None)
        self.last_logits.pop(rid, None)

    def limits(self, budget: int) -> DataLimits:
        """Waves of ``budget`` rows of ``[tokens, d_model]`` in the weights' dtype; after a
        mixer shared with the stage before, up to as many rows of that mixer's outputs
        besides (:meth:`forward`)."""
        rows = budget * (2 if self.shared_first is not None else 1)
        return DataLimits.for_run(rows, self.cfg.d_model, self.dtype, MAX_MESSAGE_BYTES)

    def describe(self) -> list[str]:
        lines = [f"attention by {self.attention_kernel}" if self.attention_kernel
                 else "no softmax-attention layers, so no attention kernel"]  # fmt: skip
        if self.compile:
            held = len(self.m.layer_ids)
            eager = held - len(self.fused)
            lines.append(f"{len(self.fused)} of {held} layers compiled"
                         + (f"; {eager} not Llama-shaped or split with a neighbour, run "
                            "eagerly" if eager else ""))  # fmt: skip
        return lines

    def finish(self) -> str:
        """Nothing runs beside this executor."""
        return ""

    # -- handoff --------------------------------------------------------------------

    def take_final(self, rid: RequestId) -> dict[int, State]:
        """The recurrent states after a handed-off request's last token, by layer."""
        return self.finals.pop(rid, {})

    def band(self, job) -> list[BandTensor]:
        """This stage's band of an ended request's cache (``wavepp.handoff.send``):
        every paged entry's rows of tokens 0..T-1 read through its block table (reused
        prefix blocks included), every recurrent layer's state after the last token, and
        on stage 0 the token ids. Read lazily, one tensor at a time."""
        n = job.num_tokens

        # the rows as an index, built the first time a tensor is read through a copy (a
        # GPU stage's, a vLLM folder's); the CPU path sends the pool's runs instead
        @cache
        def rows() -> torch.Tensor:
            return pool_rows(job.block_table, self.block_size, n).to(self.device)

        out = []
        if job.tokens is not None:
            ids = np.asarray(job.tokens, dtype=np.int32)
            out.append(BandTensor(-1, "tokens", "int32", (n,), lambda: torch.from_numpy(ids)))
        runs = _row_runs(job.block_table, self.block_size, n)
        # a mixer shared with the stage before: that stage's band carries its cache
        skip = self.m.layer_ids[0] if self.shared_first is not None else None
        for i in self.mixer_ids:
            if i == skip:
                continue
            if i in self.pools:
                for name, pool in self.pools[i].items():
                    # on the CPU the bytes go out from the pool's blocks: a view per run
                    pieces = (partial(_pool_pieces, pool, runs) if pool.device.type == "cpu"
                              else None)  # fmt: skip
                    out.append(BandTensor(i, name, name_of(pool.dtype), (n, *pool.shape[1:]),
                                          partial(_gather, pool, rows), pieces))  # fmt: skip
            else:
                states = job.states.get(i)
                if states is None:
                    raise RuntimeError(f"{job.request_id}: no final state of layer {i} to hand on")
                for part, state in states.items():
                    out.append(BandTensor(i, part, "float32", tuple(state.shape),
                                          partial(_as_cpu_float, state)))  # fmt: skip
        return out

    def memory_report(self) -> dict[str, int]:
        """Bytes this stage holds, by kind; the pools are allocated up front."""

        def size(tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors)

        live = [t for states in self.live.values() for s in states.values() for t in s.values()]
        return {
            "weights_bytes": size(self.m.parameters()),
            "kv_pool_bytes": size(t for pool in self.pools.values() for t in pool.values()),
            "snapshot_bytes": size(
                t for pool in self.snapshot_pools.values() for t in pool.values()
            ),
            "snapshot_capacity": self.snapshot_capacity if self.recurrent else 0,
            "live_state_bytes": size(live),
        }

    # -- the math -------------------------------------------------------------------

    @torch.inference_mode()
    def _warm_compiled(self) -> None:
        """Compile now (a throwaway wave over the pool's first block), not in a measured
        wave; the rows it writes belong to no block the state has handed out yet."""
        if not self.fused:
            return
        # An odd token count, so that no model dimension shares its symbol when the
        # dynamic shapes are traced (which would recompile at the first real wave).
        n = min(self.block_size, 16) - 1
        if n < 2:  # one-token waves never take the compiled path
            return
        batch = PagedBatch([0], [n], [[0]], self.block_size, self.device)
        x = torch.zeros(n, self.cfg.d_model, device=self.device, dtype=self.dtype)
        for i, fused in self.fused.items():
            fused(x, batch, self.pools[i])
        for pool in self.pools.values():
            for tensor in pool.values():
                tensor[:n].zero_()

    def _zeros(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed pool. On CPU, transparent huge pages are asked for first (before the
        pages are touched): block tables scatter a request's blocks over the pool, and
        2 MiB pages spare the TLB (the kernel's attention over scattered tables took
        0.96-0.98x the time when this landed; see the git log)."""
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=self.device)
        pool = torch.empty(shape, dtype=dtype)
        huge_pages(pool)
        return pool.zero_()

    @torch.inference_mode()
    def forward(self, chunks: list[ChunkWork], x: torch.Tensor | None):
        """x: [tokens, d_model] from the previous stage (None on stage 0).

        A mixer two stages share (``shared_last`` here, ``shared_first`` on the next
        stage) is cut by rows (:meth:`PagedBatch.share_row`, each row weighing the keys
        it attends to plus ``d_model / 2`` for its output projection): both stages store
        every token's keys and values, the earlier attends for rows ``0..m-1`` and the
        later for the rest. The earlier sends ``[tokens + m, d_model]``: the residual before the
        mixer, then rows ``0..m-1`` after it; the later adds its rows' outputs to the
        rest."""
        if x is None:
            tokens = torch.cat([torch.as_tensor(c.tokens, dtype=torch.long) for c in chunks])
            x = self.m.model.embed_tokens(tokens.to(self.device))
        batch = PagedBatch.build(chunks, self.block_size, self.device)
        done = None  # shared_first: rows 0..m-1 after the shared mixer, from the stage before
        if self.shared_first is not None:
            m = batch.share_row(self.shared_first, self.cfg.d_model // 2)
            if x.shape[0] != batch.num_tokens + m:
                raise ValueError(f"wave of {batch.num_tokens} tokens sharing {m} rows got "
                                 f"activations for {x.shape[0]}")  # fmt: skip
            x, done = x[: batch.num_tokens], x[batch.num_tokens :]
        elif batch.num_tokens != x.shape[0]:
            raise ValueError(f"wave of {batch.num_tokens} tokens got activations for {x.shape[0]}")
        x = x.to(self.device, self.dtype)  # x: [tokens, d_model]
        ending = [s for s, c in enumerate(chunks) if c.is_last]  # sequences whose logits we read
        # The model's last layer: outputs only at those sequences' last tokens (R rows).
        pruned = self.m.last and not self.full_last_layer
        final = batch.last_tokens(ending) if pruned else None
        for i in self.m.layer_ids:
            queries = final if i == self.m.layer_ids[-1] else None
            if i in self.fused:
                x = self.fused[i](x, batch, self.pools[i], queries)
                continue
            layer = self.m.layer(i)
            if done is not None and i == self.m.layer_ids[0]:
                x = self._mix_shared(i, layer, x, batch, done)
            elif self.shared_last is not None and i == self.m.layer_ids[-1]:
                x = self._mix_shared(i, layer, x, batch, None)
            elif layer.has_mixer:
                x = self._mix(i, layer, x, chunks, batch, queries)
            if layer.has_ffn and x.shape[0]:
                x = x + self.tp.all_reduce(layer.ffn(layer.post_attention_layernorm(x)))
        for c in chunks:
            if c.is_last:
                states = self.live.pop(c.request_id, None)
                if c.handoff and states:  # a stage without recurrent layers keeps none
                    self.finals[c.request_id] = states
        if not self.m.last:
            return x, {}
        results = {}
        if ending:
            last = x if pruned else x[[batch.spans[s][1] - 1 for s in ending]]
            logits = self.m.head(last).float()  # [finished, vocab]
            top, best = logits.max(-1)
            for row, c in enumerate(c for c in chunks if c.is_last):
                self.last_logits[c.request_id] = logits[row]
                self.last_logits.move_to_end(c.request_id)
                results[c.request_id] = (int(best[row]), float(top[row]))
            while len(self.last_logits) > KEEP_LOGITS:
                self.last_logits.popitem(last=False)
        return None, results

    def _mix(self, i: int, layer: nn.Module, x: torch.Tensor, chunks: list[ChunkWork],
             batch: PagedBatch, queries: PagedBatch | None) -> torch.Tensor:  # fmt: skip
        """x + the layer's mixer over its input norm: [T, d_model], or the query rows'
        [R, d_model] with ``queries`` (the model's last layer)."""
        h = layer.input_layernorm(x)
        mixer = layer.mixer
        if mixer.paged:
            mixed = mixer.paged_forward(h, batch, self.pools[i], queries)
        else:
            mixed = torch.cat([self._recurrent(i, mixer, c, h[a:b])
                               for c, (a, b) in zip(chunks, batch.spans, strict=True)])  # fmt: skip
            _, mixed = to_queries(batch, queries, mixed)
        _, x = to_queries(batch, queries, x)
        return x + self.tp.all_reduce(mixed)

    def _mix_shared(self, i: int, layer: nn.Module, x: torch.Tensor, batch: PagedBatch,
                    done: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        """A shared mixer (:meth:`forward`): every token's cache entries, and the outputs
        of this stage's rows. ``done`` (on the later stage): the earlier stage's rows
        after the mixer; without it (the earlier stage) the result is the residual before
        the mixer followed by this stage's rows after it, ``[tokens + m, d_model]``."""
        later = done is not None
        n = batch.num_tokens
        # a row's other work, its output projection, in keys' worth (PagedBatch.share_row)
        m = batch.share_row(self.shared_first if later else self.shared_last,
                            self.cfg.d_model // 2)  # fmt: skip
        rows = batch.query_rows(m, n) if later else batch.query_rows(0, m)
        mixed = layer.mixer.paged_forward(layer.input_layernorm(x), batch, self.pools[i], rows)
        if later:
            return torch.cat([done.to(x.device, x.dtype), x[m:] + mixed])
        return torch.cat([x, x[:m] + mixed])

    def _resume(self, i: int, c: ChunkWork) -> State | None:
        """The state before token c.start: live, from a snapshot slot, or None (zeros)."""
        states = self.live.setdefault(c.request_id, {})
        if i in states:
            return states[i]
        if c.start == 0:
            return None
        slot = c.resume_slot
        if slot is None:
            raise RuntimeError(
                f"{c.request_id}: no recurrent state to resume at token {c.start} on layer {i} "
                "(no live state, no resume_slot)"
            )
        return {part: pool[slot].clone() for part, pool in self.snapshot_pools[i].items()}

    def _save_slots(self, c: ChunkWork) -> tuple[int, ...]:
        """The snapshot slots of c.snapshot_points, one each."""
        if len(c.snapshot_slots) != len(c.snapshot_points):
            raise ValueError(f"{c.request_id}: {len(c.snapshot_points)} snapshot points but "
                             f"{len(c.snapshot_slots)} slots")  # fmt: skip
        return c.snapshot_slots

    def _recurrent(self, i: int, mixer: nn.Module, c: ChunkWork, h: torch.Tensor) -> torch.Tensor:
        # h: [n, d_model] at positions c.start..c.end-1
        state = self._resume(i, c)
        cuts = tuple(k * self.block_size - c.start for k in c.snapshot_points)
        out, after, at_cuts = mixer.chunk(h, state, cuts)
        pools = self.snapshot_pools[i]
        for slot, saved in zip(self._save_slots(c), at_cuts, strict=True):
            for part, tensor in saved.items():
                pools[part][slot] = tensor
        self.live[c.request_id][i] = after
        return out


def _gather(pool: torch.Tensor, rows: Callable[[], torch.Tensor]) -> torch.Tensor:
    # pool: [rows, *entry] -> [tokens, *entry] on the CPU, contiguous
    return pool.index_select(0, rows()).cpu().contiguous()


def _as_cpu_float(state: torch.Tensor) -> torch.Tensor:
    return state.detach().to("cpu", torch.float32).contiguous()


def pool_rows(block_table: Sequence[int], block_size: int, num_tokens: int) -> torch.Tensor:
    """The pool rows of tokens 0..num_tokens-1 of a request with this block table."""
    num_blocks = -(-num_tokens // block_size)
    if len(block_table) < num_blocks:
        raise ValueError(f"block table of {len(block_table)} blocks for {num_tokens} tokens")
    slots = torch.as_tensor(list(block_table[:num_blocks]), dtype=torch.long)
    rows = slots[:, None] * block_size + torch.arange(block_size)
    return rows.reshape(-1)[:num_tokens]


def _row_runs(block_table, block_size: int, num_tokens: int) -> list[tuple[int, int]]:
    """Tokens 0..num_tokens-1 as runs [start, end) of consecutive pool rows."""
    runs: list[tuple[int, int]] = []
    for b in range(-(-num_tokens // block_size)):
        start = block_table[b] * block_size
        end = start + min(block_size, num_tokens - b * block_size)
        if runs and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], end)
        else:
            runs.append((start, end))
    return runs


def _pool_pieces(pool: torch.Tensor, runs: list[tuple[int, int]]) -> Iterator[memoryview]:
    """The bytes of ``runs`` of a CPU pool's rows ([rows, *entry], contiguous), in order:
    one view of the pool per run, no copy. The sender hands them to ``sendmsg`` as they
    are, up to ``IOV_MAX`` a call, and the kernel's copy into the socket is the only one
    (a gather into a buffer first would be a second, under the GIL, serial with the send)."""
    whole = pool.reshape(-1).view(torch.uint8).numpy().data
    row = whole.nbytes // pool.shape[0]
    for a, b in runs:
        yield whole[a * row : b * row]
