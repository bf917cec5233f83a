"""Attention straight from the paged KV pool, for every chunk of a wave in one call.

The contract, for any attention-like layer (GQA, MQA, MLA in absorbed form):

- A **pool** is one layer's cache, ``[capacity * block_size, KV, D]``: row
  ``slot * block_size + offset`` holds the token at ``offset`` of the block stored in
  ``slot``. WavePP's state reducers own the slots; a layer only reads the rows of the
  block tables it is given and writes the rows of the tokens it computes.
- A :class:`PagedBatch` describes one wave: per sequence (chunk) its new tokens
  ``start..end-1``, its block table, and the derived tensors (absolute positions of
  the new tokens, the pool row each one is written to, ``cu_seqlens`` of the new
  tokens, prefix lengths). Build it once per wave (:meth:`PagedBatch.build`) and pass
  the same object to every layer of the stage.
- :func:`write_paged` stores a layer's new keys (or values, or latents) at
  ``batch.write_rows``. Call it **before** :func:`paged_attention` of the same layer:
  a chunk attends to its prefix ``0..start-1`` (rows written by earlier waves, or by
  an earlier chunk of the same wave) and, causally, to itself.
- :func:`paged_attention` ``(q [T, H, D], k_pool [rows, KV, D], v_pool [rows, KV, Dv],
  batch, scale) -> [T, H, Dv]``: softmax attention of every new token over its
  sequence's positions ``0..position``. ``H`` must be a multiple of ``KV`` (grouped
  query attention; KV heads are never repeated in memory). ``Dv`` may differ from
  ``D``: for MLA's absorbed form pass ``v_pool = k_pool[..., :Dv]`` (the value is a
  leading slice of the latent entry) and MQA with ``KV = 1``.

How it runs. On CPU in fp32 or bf16, with AVX-512 and a C++ compiler, WavePP's own kernel
(``wavepp.model.cpu_kernel``) serves the whole wave in one call: each new token attends
to positions ``0..its own`` through its block table in one online-softmax pass, grouped
heads sharing each pass over their keys (bf16 read as it is, sums in fp32). Otherwise
(fp16, no AVX-512, CUDA without FlashInfer, ``WAVEPP_CPU_KERNEL=0``) each sequence
attends to its own new keys causally and to its cached prefix without a mask; the parts
are merged by log-sum-exp. The prefix is read in place: the block table is cut into runs
of consecutive slots and each run is a strided view of the pool; only runs shorter than
``_SMALL_RUN`` rows (a fragmented pool) are gathered, in pieces of up to
``_GATHER_ROWS`` rows. No ``[n, m]`` mask is built and no whole prefix is copied. The
Python side is one call per layer for the whole wave; the per-sequence work inside it is
a few kernel calls. On CUDA with FlashInfer installed, one paged-prefill call per layer
serves the wave, planned once per wave from the same block tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from wavepp.model import cpu_kernel
from wavepp.plan.placement import share_row

_SMALL_RUN = 256  # prefix runs shorter than this (rows) are gathered, not viewed in place
_GATHER_ROWS = 4096  # most rows gathered into one piece


class _Chunk(Protocol):
    start: int
    end: int
    block_table: Sequence[int]


class PagedBatch:
    """One wave's paged-attention metadata, shared by all layers of a stage.

    Tensors (on ``device``): ``positions [T]`` absolute position of each new token;
    ``write_rows [T]`` pool row of each new token; ``cu_seqlens [S+1]`` offsets of each
    sequence's new tokens; ``prefix_lens [S]`` cached tokens before each chunk;
    ``block_tables [S, max_blocks]`` (padded with 0). Python mirrors of the same
    numbers drive the CPU loop without device synchronisation.
    """

    def __init__(
        self,
        starts: list[int],
        ends: list[int],
        tables: list[list[int]],
        block_size: int,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.starts, self.ends, self.tables = starts, ends, tables
        lengths = [e - s for s, e in zip(starts, ends, strict=True)]
        self.spans: list[tuple[int, int]] = []
        at = 0
        for n in lengths:
            self.spans.append((at, at + n))
            at += n
        self.num_tokens = at
        positions = torch.cat([torch.arange(s, e) for s, e in zip(starts, ends, strict=True)]
                              or [torch.zeros(0, dtype=torch.long)])  # fmt: skip
        table = torch.zeros(len(tables), max((len(t) for t in tables), default=0), dtype=torch.long)
        for i, t in enumerate(tables):
            table[i, : len(t)] = torch.as_tensor(t, dtype=torch.long)
        seq = torch.repeat_interleave(torch.arange(len(tables)),
                                      torch.as_tensor(lengths, dtype=torch.long))
        rows = table[seq, positions // block_size] * block_size + positions % block_size
        self.positions = positions.to(device)
        self.write_rows = rows.to(device)
        self.cu_seqlens = torch.as_tensor([0] + [b for _, b in self.spans]).to(device)
        self.prefix_lens = torch.as_tensor(starts, dtype=torch.long).to(device)
        self.block_tables = table.to(device)
        self.prefix_pieces = [self._pieces(s, t) for s, t in zip(starts, tables, strict=True)]
        self.kernel_state: dict[str, Any] = {}  # per-wave kernel plans (FlashInfer, CPU)
        self.rows: torch.Tensor | None = None  # set on a batch of queries (last_tokens)

    def last_tokens(self, seqs: Sequence[int]) -> PagedBatch:
        """The last new token of each sequence in ``seqs``, as a batch of queries: one
        token a sequence, attending to its whole sequence in the pools (rows this wave
        has already written). ``rows [R]`` holds each one's row in this wave's tensors.

        For the model's last layer, whose outputs only the logits read: its keys and
        values are written for every new token, its attention and MLP run for these."""
        ends = [self.ends[s] for s in seqs]
        queries = PagedBatch([e - 1 for e in ends], ends, [self.tables[s] for s in seqs],
                             self.block_size, self.device)  # fmt: skip
        queries.rows = torch.as_tensor([self.spans[s][1] - 1 for s in seqs],
                                       dtype=torch.long).to(self.device)  # fmt: skip
        return queries

    def query_rows(self, lo: int, hi: int) -> PagedBatch:
        """This wave's new tokens ``lo..hi-1`` (rows of its tensors) as a batch of queries,
        each attending to its whole sequence up to itself in the pools (rows this wave has
        already written); ``rows`` holds their rows. A chunk the range cuts becomes the
        piece inside it. For a mixer two stages share, each running some of its rows
        (:meth:`share_row`)."""
        starts, ends, tables = [], [], []
        for (a, b), start, table in zip(self.spans, self.starts, self.tables, strict=True):
            first, stop = max(a, lo), min(b, hi)
            if first < stop:
                starts.append(start + first - a)
                ends.append(start + stop - a)
                tables.append(table)
        queries = PagedBatch(starts, ends, tables, self.block_size, self.device)
        queries.rows = torch.arange(lo, hi, dtype=torch.long).to(self.device)
        return queries

    def share_row(self, share: float, per_row: int = 0) -> int:
        """The row ``m`` that cuts a shared mixer's queries: rows ``0..m-1`` run on the
        earlier stage, ``m..`` on the later (``wavepp.plan.placement.share_row``: each
        row weighs the keys it attends to plus ``per_row``). A pure function of the
        wave's chunks, so both stages compute the same ``m`` without sending it."""
        return share_row(list(zip(self.starts, self.ends, strict=True)), share, per_row)

    @classmethod
    def build(
        cls, chunks: Sequence[_Chunk], block_size: int, device: torch.device | str = "cpu"
    ) -> PagedBatch:
        starts = [c.start for c in chunks]
        ends = [c.end for c in chunks]
        tables = [list(c.block_table) for c in chunks]
        for c, t in zip(chunks, tables, strict=True):
            if len(t) * block_size < c.end:
                raise ValueError(
                    f"block table of {len(t)} blocks cannot hold tokens up to {c.end} "
                    f"(block size {block_size})"
                )
        return cls(starts, ends, tables, block_size, torch.device(device))

    def _pieces(self, start: int, table: list[int]) -> list[tuple[int, int] | torch.Tensor]:
        """The prefix rows 0..start-1 as in-place row ranges or gathered row indices."""
        bs = self.block_size
        runs: list[list[int]] = []  # [first row, end row]
        for b in range(-(-start // bs)):
            lo = table[b] * bs
            hi = lo + min(bs, start - b * bs)
            if runs and runs[-1][1] == lo:
                runs[-1][1] = hi
            else:
                runs.append([lo, hi])
        pieces: list[tuple[int, int] | torch.Tensor] = []
        pending: list[torch.Tensor] = []
        pending_rows = 0

        def flush() -> None:
            nonlocal pending, pending_rows
            if pending:
                pieces.append(torch.cat(pending).to(self.device))
                pending, pending_rows = [], 0

        for lo, hi in runs:
            if hi - lo >= _SMALL_RUN:
                pieces.append((lo, hi))
                continue
            pending.append(torch.arange(lo, hi))
            pending_rows += hi - lo
            if pending_rows >= _GATHER_ROWS:
                flush()
        flush()
        return pieces


def write_paged(pool: torch.Tensor, batch: PagedBatch, values: torch.Tensor) -> None:
    """pool: [rows, KV, D]; values: [T, KV, D] for the wave's new tokens, in order."""
    pool.index_copy_(0, batch.write_rows, values.to(pool.dtype))


def to_queries(batch: PagedBatch, queries: PagedBatch | None, *tensors):
    """The batch a layer attends with and its per-token ``tensors`` (None passes) cut
    to that batch's query rows: ``batch`` and the tensors as they are when ``queries``
    is None, else ``queries`` (:meth:`PagedBatch.last_tokens`) and their rows."""
    if queries is None:
        return (batch, *tensors)
    return (queries, *(None if t is None else t[queries.rows] for t in tensors))


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    batch: PagedBatch,
    scale: float,
) -> torch.Tensor:
    """q: [T, H, D]; k_pool: [rows, KV, D]; v_pool: [rows, KV, Dv] -> [T, H, Dv]."""
    if q.shape[0] != batch.num_tokens:
        raise ValueError(f"{q.shape[0]} queries for a wave of {batch.num_tokens} tokens")
    if q.shape[1] % k_pool.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads do not group over {k_pool.shape[1]} KV heads")
    if not batch.num_tokens:  # a last layer whose wave ends no sequence
        return q.new_empty(0, q.shape[1], v_pool.shape[-1])
    if q.is_cuda and _flashinfer() is not None:
        return _flashinfer_attention(q, k_pool, v_pool, batch, scale)
    if cpu_kernel.fits(q, k_pool, v_pool):
        meta = batch.kernel_state.get("cpu")
        if meta is None:
            meta = cpu_kernel.wave_metadata(batch.starts, batch.spans, batch.tables)
            batch.kernel_state["cpu"] = meta
        return cpu_kernel.paged_attention(q, k_pool, v_pool, *meta, batch.block_size, scale)
    return _split_attention(q, k_pool, v_pool, batch, scale)


# -- the portable path: causal self part + unmasked prefix parts, merged by LSE --------


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    # [rows, heads, d] -> [1, heads, rows, d], a view
    return x.permute(1, 0, 2)[None]


def _values_in_keys(k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """v_pool is a leading slice of k_pool's entries (MLA's latent cache)."""
    return (
        v_pool.shape[-1] < k_pool.shape[-1]
        and v_pool.data_ptr() == k_pool.data_ptr()
        and v_pool.stride() == k_pool.stride()
    )


def _attend(q4, k4, v4, causal: bool, scale: float):
    """One dense attention with its log-sum-exp. q4: [1, H, n, D]; k4/v4: [1, KV, m, D].
    Returns (out [1, H, n, Dv], lse [1, H, n] fp32)."""
    if q4.device.type == "cpu" and k4.shape[-1] == v4.shape[-1]:
        # bf16 / fp16 attend in fp32, as WavePP's kernel sums: PyTorch's CPU flash kernel
        # in bf16 moved a tiny Kimi Linear's logits by 0.74 of their range on one prompt
        # of tests/parity/test_bf16.py, against 0.09 for a plain bf16 forward and 0.094
        # this way (an AVX2 machine, where WavePP's AVX-512 kernel does not build).
        wide = q4.dtype != torch.float32
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *((t.float() for t in (q4, k4, v4)) if wide else (q4, k4, v4)), 0.0, causal,
            scale=scale,
        )
        return (out.to(q4.dtype) if wide else out), lse.float()
    return _math_attend(q4, k4, v4, causal, scale)


def _math_attend(q4, k4, v4, causal: bool, scale: float):
    """Reference-grade fallback (CUDA without FlashInfer, Dv != D on CPU), grouped heads."""
    _, h, n, d = q4.shape
    kv = k4.shape[1]
    g = h // kv
    qg = q4.reshape(kv, g * n, d).float()  # rows of a group share their KV head
    scores = qg @ k4[0].float().transpose(-1, -2) * scale  # [KV, g*n, m]
    if causal:
        m = k4.shape[2]
        row_pos = torch.arange(n, device=q4.device).repeat(g) + (m - n)
        scores = scores.masked_fill(
            torch.arange(m, device=q4.device)[None, :] > row_pos[:, None], float("-inf")
        )
    lse = scores.logsumexp(-1)  # [KV, g*n]
    out = (scores - lse[..., None]).exp() @ v4[0].float()  # [KV, g*n, Dv]
    return out.reshape(1, h, n, -1).to(q4.dtype), lse.reshape(1, h, n)


def _split_attention(q, k_pool, v_pool, batch: PagedBatch, scale: float) -> torch.Tensor:
    latent = _values_in_keys(k_pool, v_pool)
    dv = v_pool.shape[-1]
    if latent:
        v_pool = k_pool  # attend with the whole entry as value, keep its leading slice
    out = q.new_empty(q.shape[0], q.shape[1], dv)
    for (a, b), start, pieces in zip(batch.spans, batch.starts, batch.prefix_pieces, strict=True):
        if a == b:
            continue
        q4 = _heads_first(q[a:b])
        rows = batch.write_rows[a:b]
        own_k, own_v = k_pool.index_select(0, rows), v_pool.index_select(0, rows)
        o, lse = _attend(q4, _heads_first(own_k), _heads_first(own_v), True, scale)
        parts = [(o, lse)]
        # Unmasked, the g query heads of a KV head are just more rows: [1, KV, g*n, D]
        # reads each key once per row block instead of once per head.
        h, n, kv = q4.shape[1], b - a, k_pool.shape[1]
        grouped = q4.reshape(1, kv, (h // kv) * n, q4.shape[-1])
        for piece in pieces if start else ():
            if isinstance(piece, tuple):
                k_part, v_part = k_pool[piece[0] : piece[1]], v_pool[piece[0] : piece[1]]
            else:
                k_part, v_part = k_pool.index_select(0, piece), v_pool.index_select(0, piece)
            o, lse = _attend(grouped, _heads_first(k_part), _heads_first(v_part), False, scale)
            parts.append((o.reshape(1, h, n, -1), lse.reshape(1, h, n)))
        merged = parts[0][0] if len(parts) == 1 else _merge(parts)
        out[a:b] = merged[0, :, :, :dv].transpose(0, 1)
    return out


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Combine attention over disjoint key sets from their outputs and log-sum-exps."""
    lses = torch.stack([lse for _, lse in parts])  # [P, 1, H, n]
    total = torch.logsumexp(lses, dim=0)
    acc = None
    for (o, _), lse in zip(parts, lses, strict=True):
        term = o.float() * (lse - total).exp()[..., None]
        acc = term if acc is None else acc + term
    return acc.to(parts[0][0].dtype)


# -- CUDA: FlashInfer's paged prefill, when installed ------------------------------------

_FLASHINFER: list[Any] = []


def _flashinfer():
    """The flashinfer module, or None when it is not installed (imported once)."""
    if not _FLASHINFER:
        try:
            import flashinfer  # the optional GPU extra
        except ImportError:
            flashinfer = None
        _FLASHINFER.append(flashinfer)
    return _FLASHINFER[0]


def _flashinfer_attention(q, k_pool, v_pool, batch: PagedBatch, scale: float) -> torch.Tensor:
    """One FlashInfer paged-prefill call for the whole wave (planned once per wave)."""
    flashinfer = _flashinfer()
    bs = batch.block_size
    kv_heads, d, dv = k_pool.shape[1], k_pool.shape[-1], v_pool.shape[-1]
    key = f"flashinfer:{q.shape[1]}:{kv_heads}:{d}:{dv}:{q.dtype}"
    wrapper = batch.kernel_state.get(key)
    if wrapper is None:
        workspace = batch.kernel_state.get("flashinfer:workspace")
        if workspace is None:
            workspace = torch.empty(128 << 20, dtype=torch.uint8, device=q.device)
            batch.kernel_state["flashinfer:workspace"] = workspace
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        pages = [-(-end // bs) for end in batch.ends]
        indptr = torch.tensor([0, *pages], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        indices = torch.tensor(
            [slot for t, n in zip(batch.tables, pages, strict=True) for slot in t[:n]],
            dtype=torch.int32,
        )
        last = torch.tensor([end - (n - 1) * bs for end, n in zip(batch.ends, pages,
                                                                   strict=True)],
                            dtype=torch.int32)  # fmt: skip
        extra = {"head_dim_vo": dv} if dv != d else {}
        wrapper.plan(
            batch.cu_seqlens.to(torch.int32), indptr.to(q.device), indices.to(q.device),
            last.to(q.device), q.shape[1], kv_heads, d, bs, causal=True, sm_scale=scale,
            q_data_type=q.dtype, kv_data_type=k_pool.dtype, **extra,
        )  # fmt: skip
        batch.kernel_state[key] = wrapper
    k_pages = k_pool.view(-1, bs, kv_heads, d)
    v_pages = v_pool.unflatten(0, (-1, bs))
    return wrapper.run(q, (k_pages, v_pages))
