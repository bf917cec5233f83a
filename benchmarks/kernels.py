"""Per-layer-kind benchmark: WavePP's prefill path of each family layer against
``transformers``' own PyTorch fallback of the same layer, same weights, same input.

For each kind a one-layer model is made by ``transformers`` with unit-scale random
weights, saved with ``save_pretrained`` and loaded by WavePP; both then run on the same
hidden states (one prompt, no cache). Rows ``kda-kernel`` / ``gdn-kernel`` time the
chunked delta rule alone (WavePP's ``chunk_delta`` against transformers'
``chunk_kimi_delta_attention`` / ``torch_chunk_gated_delta_rule``, both from the
layer's own q, k, v, gate and beta, both normalizing q and k); the other rows time
whole layers, whose projections and convolutions are the same matrix products on both
sides. Printed per row: best-of-N CPU seconds of each (one thread, interleaved runs),
the ratio transformers / WavePP (> 1: WavePP faster) and the max abs difference of the
outputs. ``python -m benchmarks.kernels [--tokens 2048] [--repeats 7]``.

Needs ``transformers`` (the ``dev`` extra).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import torch

from wavepp.model import build_stage
from wavepp.model.checkpoint import load_checkpoint


def _configs(width: int):
    import transformers

    kimi = dict(vocab_size=256, hidden_size=width, intermediate_size=2 * width,
                moe_intermediate_size=width // 2, num_attention_heads=8, num_key_value_heads=8,
                kv_lora_rank=256, q_lora_rank=None, qk_rope_head_dim=32, qk_nope_head_dim=64,
                v_head_dim=64, num_local_experts=16, num_experts_per_tok=4, n_shared_experts=1,
                linear_head_dim=128, linear_num_heads=width // 128, num_hidden_layers=1,
                pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    qwen = dict(vocab_size=256, hidden_size=width, intermediate_size=2 * width,
                moe_intermediate_size=width // 2, shared_expert_intermediate_size=width,
                num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                linear_num_key_heads=width // 256, linear_num_value_heads=width // 128,
                linear_key_head_dim=128, linear_value_head_dim=128, num_experts=16,
                num_experts_per_tok=4, pad_token_id=0)  # fmt: skip
    return {
        # kind: (config class, model class, config, attribute of layer 0 to compare)
        "kda": (transformers.KimiLinearConfig, transformers.KimiLinearForCausalLM,
                {**kimi, "layer_types": ["linear_attention"], "mlp_layer_types": ["dense"]},
                "self_attn"),
        "mla": (transformers.KimiLinearConfig, transformers.KimiLinearForCausalLM,
                {**kimi, "layer_types": ["full_attention"], "mlp_layer_types": ["dense"]},
                "self_attn"),
        "kimi-moe": (transformers.KimiLinearConfig, transformers.KimiLinearForCausalLM,
                     {**kimi, "layer_types": ["full_attention"], "mlp_layer_types": ["sparse"]},
                     "mlp"),
        "gdn": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM,
                {**qwen, "layer_types": ["linear_attention"]}, "linear_attn"),
        "gated-attn": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM,
                       {**qwen, "layer_types": ["full_attention"]}, "self_attn"),
        "qwen-moe": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM,
                     {**qwen, "layer_types": ["full_attention"]}, "mlp"),
    }  # fmt: skip


def _time_pair(ours, theirs, repeats: int) -> tuple[float, float]:
    """Best-of-``repeats`` CPU seconds of each (one intra-op thread, so CPU time is the
    work done; other processes on a shared machine do not inflate it), runs
    interleaved."""
    ours(), theirs()  # warm-up
    ours_s, theirs_s = [], []
    for _ in range(repeats):
        for fn, times in ((ours, ours_s), (theirs, theirs_s)):
            t0 = time.process_time()
            fn()
            times.append(time.process_time() - t0)
    return min(ours_s), min(theirs_s)


def _callables(hf, cfg, attr: str, ours_layer, h: torch.Tensor):
    """(WavePP's prefill path, transformers' forward) of layer 0 on h: [1, tokens, width]."""
    hf_layer = hf.model.layers[0]
    if attr == "mlp":
        return (lambda: ours_layer.ffn(h[0])), (lambda: hf_layer.mlp(h)[0])
    if cfg.kind(0) == "L":
        mixer = ours_layer.mixer
        return (lambda: mixer.chunk(h[0], None, ())[0]), (lambda: getattr(hf_layer, attr)(h)[0])
    positions = torch.arange(h.shape[1])
    mixer = ours_layer.mixer

    def ours_fn():
        query, entries = mixer.project(h[0], positions)
        return mixer.attend(query, entries, positions)

    rotary = getattr(hf.model, "rotary_emb", None)
    extra = {} if rotary is None else {"position_embeddings": rotary(h, positions[None])}

    def hf_fn():
        return getattr(hf_layer, attr)(h, attention_mask=None, **extra)[0][0]

    return ours_fn, hf_fn


def _kernel_callables(kind: str, mixer, h: torch.Tensor):
    """(WavePP's chunk_delta, transformers' chunked torch fallback) of the delta rule alone,
    on the layer's own q, k, v, gate and beta for h: [1, tokens, width]; both include the
    q/k L2 normalization."""
    from wavepp.model.common import l2norm, short_conv
    from wavepp.model.delta import chunk_delta

    with torch.inference_mode():
        x, extras = mixer._inputs(h[0])
        y, _ = short_conv(x, mixer.zero_state()["conv"], mixer.conv_weight())
        _, _, v, g, beta = mixer._mix(y, extras)
    n, state = h.shape[1], mixer.zero_state()["delta"]
    if kind == "kda":
        from transformers.models.kimi_linear.modeling_kimi_linear import (
            chunk_kimi_delta_attention as theirs,
        )

        q, k, _ = y.float().view(n, 3, mixer.num_heads, mixer.dk).unbind(1)
        q_ours, k_ours = q, k
    else:
        from transformers.models.qwen3_next.modeling_qwen3_next import (
            torch_chunk_gated_delta_rule as theirs,
        )

        q = y[:, : mixer.key_dim].reshape(n, mixer.num_k_heads, mixer.dk).float()
        k = y[:, mixer.key_dim : 2 * mixer.key_dim].reshape(n, mixer.num_k_heads, mixer.dk).float()
        r = mixer.num_heads // mixer.num_k_heads
        q_ours, k_ours = q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)

    def ours():
        q1 = l2norm(q_ours) * mixer.dk**-0.5
        return chunk_delta(q1, l2norm(k_ours), v, g, beta, state)[0]

    def hf():
        return theirs(q[None], k[None], v[None], g=g[None], beta=beta[None],
                      output_final_state=True, use_qk_l2norm_in_kernel=True)[0][0]  # fmt: skip

    return ours, hf


def run(kinds: list[str], tokens: int, repeats: int, width: int, seed: int) -> list[dict]:
    import transformers  # noqa: F401

    torch.set_num_threads(1)
    configs = _configs(width)
    rows = []
    for kind in kinds:
        config_cls, model_cls, args, attr = configs[kind.removesuffix("-kernel")]
        torch.manual_seed(seed)
        hf = model_cls(config_cls(**args)).eval()
        _redraw(hf, seed)
        with tempfile.TemporaryDirectory() as tmp:
            hf.save_pretrained(tmp)
            cfg, weights = load_checkpoint(tmp)
        ours_layer = build_stage(cfg, range(1), True, True, weights).layer(0)
        h = torch.randn(1, tokens, width, generator=torch.Generator().manual_seed(seed))
        if kind.endswith("-kernel"):
            ours_fn, hf_fn = _kernel_callables(kind.removesuffix("-kernel"), ours_layer.mixer, h)
        else:
            ours_fn, hf_fn = _callables(hf, cfg, attr, ours_layer, h)
        with torch.inference_mode():
            diff = (ours_fn() - hf_fn()).abs().max().item()
            ours_s, hf_s = _time_pair(ours_fn, hf_fn, repeats)
        rows.append({"kind": kind, "tokens": tokens, "wavepp_s": ours_s, "transformers_s": hf_s,
                     "ratio": hf_s / ours_s, "max_abs_diff": diff})  # fmt: skip
    return rows


@torch.no_grad()
def _redraw(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name or name.endswith(("A_log", "dt_bias")):
            continue
        p.copy_(p.shape[-1] ** -0.5 * torch.randn(p.shape, generator=generator))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.kernels",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--width", type=int, default=512, help="hidden size (multiple of 256)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kinds",
        default="kda-kernel,gdn-kernel,kda,gdn,mla,gated-attn,kimi-moe,qwen-moe",
        help="rows: kda-kernel, gdn-kernel (the chunked delta rules alone), and whole "
        "layers: kda, gdn, mla, gated-attn, kimi-moe, qwen-moe",
    )
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args(argv)
    rows = run(args.kinds.split(","), args.tokens, args.repeats, args.width, args.seed)
    print(f"{'kind':<12}{'tokens':>8}{'wavepp s':>11}{'transformers s':>16}{'ratio':>8}"
          f"{'max diff':>11}")  # fmt: skip
    for r in rows:
        print(f"{r['kind']:<12}{r['tokens']:>8}{r['wavepp_s']:>11.4f}{r['transformers_s']:>16.4f}"
              f"{r['ratio']:>8.2f}{r['max_abs_diff']:>11.1e}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
