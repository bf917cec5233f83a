"""The model maths: one stack for every model WavePP computes — Llama (and WavePP's
gated-linear-attention hybrids on Llama's layout), Kimi Linear, Qwen3-Next and
MiniMax-M2 — from built-in configs with seeded weights or from checkpoints.

- ``config``: :class:`ModelConfig`, the one config type (its family, per-layer mixer
  and MLP kinds, sizes);
- ``registry``: where configs come from — ``BUILTIN`` names, Hugging Face
  ``model_type`` readers (``MODEL_TYPES``), WavePP's own layout — and the
  ``config.json`` written for one;
- ``stage``: :func:`build_stage` (one stage's layers under the checkpoint's names),
  :func:`random_weights`, :func:`reference_logits` (the plain full forward the parity
  tests compare with);
- the layers: ``common`` (RMSNorm, RoPE, SwiGLU, short convolution), ``attn`` (GQA,
  MLA), ``linear`` (gated linear attention, KDA, Gated DeltaNet) over ``delta`` (the
  chunked delta rule), ``moe``; ``fused`` (``--compile``'s Llama-shaped layers);
- ``attention`` and ``cpu_kernel``: attention straight from the paged pool;
  ``checkpoint``: weights on disk;
- ``tp``: tensor parallelism inside a stage — the TP group a stage's layers reduce over
  (``TPGroup``, ``NoTP``, ``DistTPGroup``), ``check_tp``, ``shard_weights`` (what each
  rank holds); ``build_stage(..., tp=group)`` builds a rank's share.

The layer-kind seam the executor (``wavepp.exec.torch_exec``) relies on, every mixer:

- a **paged** kind (``paged = True``) declares ``cache_layout() -> {name: entry shape}``,
  the per-token entries it keeps in the paged pool (``k``/``v`` ``[KV, hd]`` for GQA, a
  compressed ``latent`` ``[1, rank + rope]`` for MLA), and runs a whole wave with
  ``paged_forward(h [T, d_model], batch, pools, queries=None) -> [T, d_model]``:
  it writes every new token's entries, and with ``queries``
  (``PagedBatch.last_tokens``) attends for those rows only and returns ``[R, d_model]``;
- a **recurrent** kind (``paged = False``) declares ``state_shapes() -> {part: shape}``
  (the delta-rule state and the short convolution's state; one state for gated linear
  attention) and runs one chunk with
  ``chunk(h [n, d_model], state | None, cuts) -> (out, state after, [state at cut])``,
  the states at ``cuts`` (token offsets) being what snapshots keep; states are float32
  on the weights' device.

Every mixer also has ``full(h)``, the plain forward over a whole prompt.
"""

from wavepp.model.config import ModelConfig
from wavepp.model.registry import BUILTIN, config_from_hf, hf_config, llama_config
from wavepp.model.stage import build_stage, random_weights, reference_logits

__all__ = [
    "BUILTIN",
    "ModelConfig",
    "build_stage",
    "config_from_hf",
    "hf_config",
    "llama_config",
    "random_weights",
    "reference_logits",
]
