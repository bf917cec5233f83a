"""Device and model profiles for the simulated executor (DESIGN §6).

Device figures are datasheet peaks (dense, no sparsity) per GPU, with the share of them
a prefill really gets stated beside each profile. A model is its ``config.json`` (on the
Hugging Face Hub, or the defaults of the config class ``transformers`` ships for it),
read into a ``ModelConfig`` as ``wavepp.model`` reads a checkpoint's; each profile names
its source.

Weights are stored in one format per run (``WEIGHT_FORMATS``): it sets the bytes a wave
streams per parameter and the matrix rate of the projection and MLP/MoE GEMMs.
Attention (QK and PV), the recurrent update and the KV cache stay in bf16.

Each device profile names its links (``LINKS``): the link inside a node (NVLink) and the
network between nodes (InfiniBand), with the node's size. Bandwidths are datasheet
figures per GPU and direction; latencies are our assumption (neither datasheet nor
measured). ``wavepp.sim.links`` places the stages on them.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from wavepp.model.config import ModelConfig
from wavepp.model.registry import config_from_hf

# Bytes per weight parameter. nvfp4: 4-bit values plus one FP8 (E4M3) scale per 16 values
# (the per-tensor FP32 scale is negligible); fp8: E4M3 with per-block scales (negligible).
WEIGHT_FORMATS: dict[str, float] = {"bf16": 2.0, "fp8": 1.0, "nvfp4": 0.5 + 1 / 16}
KV_BYTES = 2  # bf16 KV cache and activations


@attrs.frozen
class LinkProfile:
    """One GPU's link in one direction: datasheet bandwidth, assumed per-message latency."""

    name: str
    bytes_s: float  # per GPU and direction (datasheet)
    latency_s: float  # per message: our assumption, not a datasheet or measured figure

    def transfer_s(self, nbytes: float) -> float:
        """One message of ``nbytes`` from one GPU to another."""
        return self.latency_s + nbytes / self.bytes_s

    def all_reduce_s(self, nbytes: float, ranks: int) -> float:
        """A ring all-reduce of ``nbytes`` over ``ranks`` GPUs: 2(T-1) steps, each moving
        ``nbytes``/T per GPU, so 2(T-1)/T x bytes / bandwidth + 2(T-1) latencies."""
        if ranks <= 1:
            return 0.0
        steps = 2 * (ranks - 1)
        return steps * self.latency_s + steps / ranks * nbytes / self.bytes_s


LINKS: dict[str, LinkProfile] = {
    # NVLink 4 (H100/H200 SXM): 900 GB/s per GPU both directions together -> 450 each way.
    "nvlink4": LinkProfile("nvlink4", 450e9, 5e-6),
    # NVLink 5 (B200, B300, GB300): 1.8 TB/s per GPU both directions -> 900 each way.
    "nvlink5": LinkProfile("nvlink5", 900e9, 5e-6),
    # PCIe Gen5 x16: 32 GT/s x 16 lanes, about 64 GB/s each way.
    "pcie5": LinkProfile("pcie5", 64e9, 10e-6),
    # InfiniBand NDR, one ConnectX-7 of 400 Gb/s per GPU (HGX H100/H200/B200): 50 GB/s.
    "ib-ndr": LinkProfile("ib-ndr", 50e9, 10e-6),
    # InfiniBand XDR, one ConnectX-8 of 800 Gb/s per GPU (HGX B300, GB300 NVL72): 100 GB/s.
    "ib-xdr": LinkProfile("ib-xdr", 100e9, 10e-6),
    # RoCE over 400 GbE, one NIC per GPU: 50 GB/s.
    "roce-400": LinkProfile("roce-400", 50e9, 15e-6),
}


@attrs.frozen
class DeviceProfile:
    name: str
    peak_flops: float  # dense bf16 FLOP/s (attention and recurrent math run at this rate)
    hbm_bytes_s: float  # memory bandwidth, bytes/s
    gemm_efficiency: float  # share of the format's peak a bf16/fp8 GEMM reaches
    attention_efficiency: float  # share of the bf16 peak prefill attention reaches
    wave_overhead_s: float  # launch and synchronization per wave per stage
    fp8_flops: float = 0.0  # dense FP8 FLOP/s (0: no FP8 tensor cores)
    fp4_flops: float = 0.0  # dense FP4 FLOP/s (0: no FP4 tensor cores)
    fp4_efficiency: float = 0.0  # share of the FP4 peak an NVFP4 GEMM reaches
    hbm_efficiency: float = 1.0  # share of the datasheet bandwidth a weight stream reaches
    memory_bytes: float = 0.0  # HBM capacity (datasheet), bytes
    node_link: str = "nvlink4"  # LINKS: between the GPUs of one node (NVLink domain)
    network_link: str = "ib-ndr"  # LINKS: between nodes, one NIC per GPU
    gpus_per_node: int = 8  # GPUs one node_link joins

    def matrix_flops(self, weight_format: str) -> float:
        """Dense peak of the GEMMs whose weights are in ``weight_format``."""
        peak = {"bf16": self.peak_flops, "fp8": self.fp8_flops, "nvfp4": self.fp4_flops}.get(
            weight_format
        )
        if peak is None:
            raise ValueError(
                f"weight format {weight_format!r} unknown; one of {list(WEIGHT_FORMATS)}"
            )
        if not peak:
            raise ValueError(f"device {self.name} has no {weight_format} tensor cores")
        return peak

    def gemm_rate(self, weight_format: str) -> float:
        """FLOP/s a prefill GEMM reaches with weights in ``weight_format``."""
        share = self.fp4_efficiency if weight_format == "nvfp4" else self.gemm_efficiency
        return self.matrix_flops(weight_format) * share


DEVICES: dict[str, DeviceProfile] = {
    # H100 SXM / H200: 989 TFLOP/s bf16, 1,979 fp8 (dense); 3.35 / 4.8 TB/s. GEMMs at 80%
    # (about 790 TFLOP/s: our judgement of a large bf16 GEMM, not measured here), attention
    # at 55%; these three keep the datasheet bandwidth (hbm_efficiency 1.0), as in the
    # tables simulated before the paper profiles. HGX nodes of 8 on NVLink 4, one
    # ConnectX-7 (IB NDR) per GPU.
    "h100": DeviceProfile(
        "h100", 989e12, 3.35e12, 0.80, 0.55, 0.0005, fp8_flops=1979e12, memory_bytes=80e9
    ),
    "h200": DeviceProfile(
        "h200", 989e12, 4.8e12, 0.80, 0.55, 0.0005, fp8_flops=1979e12, memory_bytes=141e9
    ),
    # B200: 2.25 PFLOP/s bf16, 4.5 fp8, 9 fp4 (dense); 8 TB/s. HGX B200: 8 on NVLink 5,
    # one ConnectX-7 (IB NDR) per GPU.
    "b200": DeviceProfile(
        "b200",
        2.25e15,
        8.0e12,
        0.80,
        0.55,
        0.0005,
        fp8_flops=4.5e15,
        fp4_flops=9e15,
        fp4_efficiency=0.70,
        memory_bytes=192e9,
        node_link="nvlink5",
    ),
    # B300 (Blackwell Ultra, HGX B300 datasheet, per GPU = system / 8): FP4 108 PFLOP/s
    # dense -> 13.5; FP8 72 sparse -> 4.5 dense; BF16 36 sparse -> 2.25 dense; HBM3e 8 TB/s.
    # Efficiencies (our judgement, not measured): bf16/fp8 GEMMs 80%, NVFP4 GEMMs 70%
    # (block-scale handling and smaller tiles), attention 55% of bf16, weight streams at
    # 85% of the HBM datasheet rate. HGX B300: 8 on NVLink 5, one ConnectX-8 (IB XDR,
    # 800 Gb/s) per GPU.
    "b300": DeviceProfile(
        "b300",
        2.25e15,
        8.0e12,
        0.80,
        0.55,
        0.0005,
        fp8_flops=4.5e15,
        fp4_flops=13.5e15,
        fp4_efficiency=0.70,
        hbm_efficiency=0.85,
        memory_bytes=288e9,
        node_link="nvlink5",
        network_link="ib-xdr",
    ),
    # GB300 (GB300 NVL72 datasheet, per GPU = rack / 72): FP4 1,080 PFLOP/s dense -> 15;
    # FP8 720 sparse -> 5 dense; BF16 360 sparse -> 2.5 dense; HBM3e 576 TB/s -> 8 TB/s.
    # Same efficiencies as B300. One NVLink 5 domain of 72 GPUs (the rack), one ConnectX-8
    # (IB XDR) per GPU beyond it.
    "gb300": DeviceProfile(
        "gb300",
        2.5e15,
        8.0e12,
        0.80,
        0.55,
        0.0005,
        fp8_flops=5e15,
        fp4_flops=15e15,
        fp4_efficiency=0.70,
        hbm_efficiency=0.85,
        memory_bytes=288e9,
        node_link="nvlink5",
        network_link="ib-xdr",
        gpus_per_node=72,
    ),
}


@attrs.frozen
class ModelProfile:
    """A simulated model: its ``ModelConfig`` (the one description of a model's layers,
    widths, heads and experts, as ``wavepp.model`` reads a Hugging Face ``config.json``)
    priced per layer, with what only the cost model adds.

    A layer's kind here is ``A`` (attention with a per-head KV cache), ``M`` (multi-head
    latent attention, MLA: one latent cached for every head) or ``L`` (a recurrent layer:
    Gated DeltaNet, KDA or gated linear attention, a state per request).
    """

    name: str
    config: ModelConfig
    weight_format: str = "bf16"  # default format of the run (--weight-format overrides)
    source: str = ""  # where the shapes come from
    sparse_topk: int = 0  # DSA: keys each query attends to at most (0: dense attention)
    indexer_width: int = 0  # DSA: indexer heads x dim, scored against every prefix key
    router_counted: bool = False  # the MoE router's d_model x experts weights are priced

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def d_model(self) -> int:
        return self.config.d_model

    @property
    def vocab(self) -> int:
        return self.config.vocab_size

    @property
    def pattern(self) -> str:
        return "".join(self.kind(i) for i in range(self.num_layers))

    def kind(self, layer: int) -> str:
        return "M" if self.config.mixers[layer] == "mla" else self.config.kind(layer)

    def attn_params(self, layer: int) -> int:
        c, d = self.config, self.config.d_model
        q = c.num_heads * c.head_dim
        gates = 2 if c.mixers[layer] == "gattn" else 1  # the query also yields an output gate
        return d * q * gates + 2 * d * c.num_kv_heads * c.head_dim + q * d

    def mla_params(self) -> int:
        c, d, h = self.config, self.config.d_model, self.config.num_heads
        qk = c.nope_dim + c.rope_dim
        q = (d + h * qk) * c.q_lora_rank if c.q_lora_rank else d * h * qk
        kv_a = d * (c.kv_lora_rank + c.rope_dim)
        return q + kv_a + self.kv_up_params() + h * c.v_dim * d

    def kv_up_params(self) -> int:
        """M layers: the latent's up-projection to per-head keys and values."""
        c = self.config
        return c.kv_lora_rank * c.num_heads * (c.nope_dim + c.v_dim)

    def linear_params(self, layer: int) -> int:
        c, d, heads = self.config, self.config.d_model, self.config.linear_heads
        qk = (c.linear_k_heads or heads) * c.linear_k_dim  # total key (= query) width
        v = heads * c.linear_v_dim  # total value width
        mixer = c.mixers[layer]
        if mixer == "kda":  # q, k, v, forget and output gates of rank head_dim, beta, out
            r = c.linear_k_dim
            return d * (2 * qk + v) + 2 * (d * r + r * v) + d * heads + v * d
        if mixer == "gdn":
            return d * (2 * qk + 2 * v + 2 * heads) + v * d  # q,k,v,gate,a,b,out
        return d * (2 * qk + 2 * v + heads) + v * d  # gla: q,k,v,a,gate,out

    def mixer_params(self, layer: int) -> int:
        kind = self.kind(layer)
        if kind == "A":
            return self.attn_params(layer)
        if kind == "M":
            return self.mla_params()
        return self.linear_params(layer)

    def mlp_params(self, layer: int) -> tuple[int, int]:
        """(active, total) MLP parameters of a layer: a MoE's routed experts a token
        uses against all of them, plus its shared expert (and router where counted)."""
        c, d = self.config, self.config.d_model
        if c.mlps[layer] == "dense":
            return 3 * d * c.d_ff, 3 * d * c.d_ff
        expert = 3 * d * c.d_expert
        always = 3 * d * c.shared_ff + (d * c.num_experts if self.router_counted else 0)
        return c.top_k * expert + always, c.num_experts * expert + always

    def attention_pair_flops(self, layer: int) -> int:
        """FLOPs per (query, key) pair of an A or M layer: QK plus PV over all heads."""
        c = self.config
        if self.kind(layer) == "M":
            return 2 * c.num_heads * (c.nope_dim + c.rope_dim + c.v_dim)
        return 4 * c.num_heads * c.head_dim

    def state_elements(self) -> int:
        """An L layer's recurrent state: a key x value matrix per value head."""
        c = self.config
        return c.linear_heads * c.linear_k_dim * c.linear_v_dim

    def kv_bytes_per_token(self, layer: int) -> int:
        """Cached bytes per token of a layer: K and V per KV head (A); the latent plus the
        rotary key (M); nothing per token for L (its state is per request)."""
        kind, c = self.kind(layer), self.config
        if kind == "A":
            return 2 * c.num_kv_heads * c.head_dim * KV_BYTES
        if kind == "M":
            return (c.kv_lora_rank + c.rope_dim) * KV_BYTES
        return 0

    def kv_shards(self, layer: int, tp: int) -> int:
        """Devices of a ``tp``-way tensor-parallel stage that split a layer's per-token
        cache: A layers by KV head (replicated beyond ``num_kv_heads``); an M layer's
        latent serves every head, so each device keeps all of it."""
        if self.kind(layer) == "A":
            return min(tp, self.config.num_kv_heads)
        return 1 if self.kind(layer) == "M" else tp

    def total_params(self) -> int:
        """Parameters of all layers (embeddings and head excluded)."""
        return sum(self.mixer_params(i) + self.mlp_params(i)[1] for i in range(self.num_layers))

    def active_params(self) -> int:
        return sum(self.mixer_params(i) + self.mlp_params(i)[0] for i in range(self.num_layers))


def _layer_types(num_layers: int, full: Callable[[int], bool]) -> list[str]:
    return ["full_attention" if full(i) else "linear_attention" for i in range(num_layers)]


def _glm_moe_dsa(data: dict) -> ModelConfig:
    """GLM-5's ``glm_moe_dsa`` config (DeepSeek V3.2's layout: MLA on every layer, a MoE
    after ``first_k_dense_replace`` dense layers) read as the Kimi Linear layout it
    shares those layers with. No WavePP executor runs the family; the sim prices it."""
    n, dense = data["num_hidden_layers"], data["first_k_dense_replace"]
    return config_from_hf({
        **data, "model_type": "kimi_linear", "layer_types": ["full_attention"] * n,
        "mlp_layer_types": ["dense"] * dense + ["sparse"] * (n - dense),
        "num_experts": data["n_routed_experts"], "linear_num_heads": 0, "linear_head_dim": 0,
    })  # fmt: skip


def _kimi_linear(n: int, d: int, heads: int, q_lora: int | None, dense_ff: int,
                 experts: int, expert_ff: int) -> dict:  # fmt: skip
    """A Kimi Linear ``config.json``: MLA at every 4th layer after the first (0-based 4,
    8, ...), KDA with ``heads`` heads of 128 elsewhere; MLA latent 512, nope 128 + rope 64,
    v 128; a MoE of 8 routed + 1 shared expert after one dense layer."""
    return {
        "model_type": "kimi_linear", "vocab_size": 163_840, "hidden_size": d,
        "num_hidden_layers": n, "num_attention_heads": heads, "num_key_value_heads": heads,
        "layer_types": _layer_types(n, lambda i: i > 0 and i % 4 == 0),
        "mlp_layer_types": ["dense"] + ["sparse"] * (n - 1), "q_lora_rank": q_lora,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "linear_attn_config": {"num_heads": heads, "head_dim": 128},
        "intermediate_size": dense_ff, "moe_intermediate_size": expert_ff,
        "num_experts": experts, "num_experts_per_token": 8, "num_shared_experts": 1,
    }  # fmt: skip


def _sim_models() -> dict[str, ModelProfile]:
    # Each model's config.json fields (the Hugging Face Hub's, or the defaults of the
    # config class transformers ships), read into a ModelConfig by wavepp.model.registry.
    llama3_70b = {
        "model_type": "llama", "vocab_size": 128_256, "hidden_size": 8192,
        "intermediate_size": 28_672, "num_hidden_layers": 80, "num_attention_heads": 64,
        "num_key_value_heads": 8, "rope_theta": 500_000.0, "rms_norm_eps": 1e-5,
    }  # fmt: skip
    # 48 layers, full_attention_interval 4, gated attention (16 heads x 256, 2 KV heads),
    # Gated DeltaNet (16 key heads, 32 value heads, 128 dims), MoE of 512 experts x 512,
    # 10 routed + 1 shared per token.
    qwen3_next_80b = {
        "model_type": "qwen3_next", "vocab_size": 151_936, "hidden_size": 2048,
        "intermediate_size": 5120, "num_hidden_layers": 48,
        "layer_types": _layer_types(48, lambda i: (i + 1) % 4 == 0),
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "partial_rotary_factor": 0.25, "rope_theta": 10_000_000.0,
        "linear_num_value_heads": 32, "linear_num_key_heads": 16, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "num_experts": 512, "num_experts_per_tok": 10,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    }  # fmt: skip
    # Kimi K3's config is not public. Its public relatives: Kimi K2 (moonshotai/
    # Kimi-K2-Instruct config.json: 61 layers, d 7168, MLA 64 heads with query LoRA 1536,
    # latent 512, nope 128 + rope 64, v 128; MoE 384 experts x 2048, 8 routed + 1 shared;
    # layer 0 dense 18432) and Kimi Linear (every 4th layer MLA, the rest KDA with 128-dim
    # heads and rank-128 gates). This profile is K2's shapes with Kimi Linear's mix: 15 MLA
    # + 46 KDA layers (64 heads x 128). ≈ 1.0T parameters against K3's 2.8T: compute per
    # token is K2's (≈ 32B active), the per-wave weight stream is about 2.7x smaller.
    kimi_k3_class = _kimi_linear(61, 7168, 64, 1536, 18_432, 384, 2048)
    # GlmMoeDsaConfig defaults in transformers 5.24 (glm_moe_dsa, GLM-5's architecture; the
    # paper ran GLM 5.2, whose config is not public): DeepSeek sparse attention, top-2048
    # keys per query picked by a 32 x 128 indexer.
    glm5 = {
        "model_type": "glm_moe_dsa", "vocab_size": 154_880, "hidden_size": 6144,
        "intermediate_size": 12_288, "num_hidden_layers": 78, "num_attention_heads": 64,
        "q_lora_rank": 2048, "kv_lora_rank": 512, "qk_nope_head_dim": 192,
        "qk_rope_head_dim": 64, "v_head_dim": 256, "n_routed_experts": 256,
        "num_experts_per_tok": 8, "n_shared_experts": 1, "moe_intermediate_size": 2048,
        "first_k_dense_replace": 3, "index_topk": 2048, "index_n_heads": 32,
        "index_head_dim": 128,
    }  # fmt: skip
    # MiniMaxM2Config defaults in transformers 5.24 (= MiniMaxAI/MiniMax-M2; the paper ran
    # M2.7): GQA 48 heads x 128 with 8 KV heads, MoE 256 experts x 1536, 8 routed, no
    # shared expert.
    minimax_m2 = {
        "model_type": "minimax_m2", "vocab_size": 200_064, "hidden_size": 3072,
        "intermediate_size": 1536, "num_hidden_layers": 62, "num_attention_heads": 48,
        "num_key_value_heads": 8, "head_dim": 128, "rotary_dim": 64, "rope_theta": 5e6,
        "num_local_experts": 256, "num_experts_per_tok": 8,
    }  # fmt: skip
    profiles = (
        ModelProfile("llama3-70b", config_from_hf(llama3_70b),
                     source="meta-llama/Meta-Llama-3-70B config.json"),
        # its profile has always priced the router's 2048 x 512 weights; the others' not
        ModelProfile("qwen3-next-80b", config_from_hf(qwen3_next_80b),
                     source="Qwen/Qwen3-Next-80B-A3B-Instruct config.json", router_counted=True),
        # KimiLinearConfig defaults in transformers 5.24 (= moonshotai/Kimi-Linear-48B-A3B):
        # 27 layers, MLA at layers 4, 8, ..., 24 (6 of 27), KDA 32 heads elsewhere; MoE
        # 256 experts x 1024, layer 0 dense 9216.
        ModelProfile("kimi-linear-48b",
                     config_from_hf(_kimi_linear(27, 2304, 32, None, 9216, 256, 1024)),
                     source="transformers KimiLinearConfig defaults "
                            "(moonshotai/Kimi-Linear-48B-A3B)"),
        ModelProfile("kimi-k3-class", config_from_hf(kimi_k3_class), "nvfp4",
                     "Kimi K2 shapes (moonshotai/Kimi-K2-Instruct) + Kimi Linear's 3 KDA : 1 "
                     "MLA mix"),
        ModelProfile("glm5-class", _glm_moe_dsa(glm5), "nvfp4",
                     "transformers GlmMoeDsaConfig defaults (GLM-5)",
                     sparse_topk=glm5["index_topk"],
                     indexer_width=glm5["index_n_heads"] * glm5["index_head_dim"]),
        ModelProfile("minimax-m2-class", config_from_hf(minimax_m2), "nvfp4",
                     "transformers MiniMaxM2Config defaults (MiniMaxAI/MiniMax-M2)"),
    )  # fmt: skip
    for profile in profiles:
        profile.config.validate()
    return {profile.name: profile for profile in profiles}


MODELS: dict[str, ModelProfile] = _sim_models()


def stage_weight_bytes(
    model: ModelProfile, layers: range, first: bool, last: bool,
    weight_format: str | None = None, tp: int = 1,
) -> float:  # fmt: skip
    """Bytes of one device's weights on a stage: its layers in the weight format, plus the
    embedding table on the first stage and the LM head on the last (both bf16), split
    over the ``tp`` devices of the stage (tensor-parallel shards, experts spread)."""
    fmt = weight_format or model.weight_format
    params = sum(model.mixer_params(i) + model.mlp_params(i)[1] for i in layers)
    table = model.vocab * model.d_model * KV_BYTES
    return (params * WEIGHT_FORMATS[fmt] + table * (int(first) + int(last))) / tp


def kv_block_bytes(model: ModelProfile, layers: range, block_size: int, tp: int = 1) -> float:
    """Bytes one cached block of ``block_size`` tokens takes on one device of a stage
    holding ``layers`` over ``tp`` devices (A and M layers; L layers keep per-request
    states, not per-token caches)."""
    return block_size * sum(model.kv_bytes_per_token(i) / model.kv_shards(i, tp) for i in layers)


STATE_BYTES = 4  # recurrent states (and their snapshots) kept in fp32
POOL_HEADROOM = 0.9  # share of HBM the weights and caches may take (activations, workspace)


def snapshot_bytes(model: ModelProfile, layers: range, tp: int = 1) -> float:
    """Bytes of one recurrent-state snapshot on one device of a stage holding ``layers``
    over ``tp`` devices: a key x value state per value head of each L layer, fp32, the
    heads split over the devices."""
    per_layer = model.state_elements() * STATE_BYTES
    return per_layer * sum(1 for i in layers if model.kind(i) == "L") / tp


@attrs.frozen
class StagePool:
    """One stage's KV pool sized from its device memory (the sim's default pools); every
    figure is one device's where the stage spans several (``tp``)."""

    blocks: int  # KV blocks the pool holds
    memory_bytes: float  # the device's HBM
    weight_bytes: float  # this stage's weights (embeddings on the first, head on the last)
    block_bytes: float  # per block: its KV plus 1/interval of a snapshot (recurrent stages)
    tp: int = 1  # devices of the stage

    def describe(self) -> str:
        each = f" per device of {self.tp}" if self.tp > 1 else ""
        return (f"{self.blocks:,} blocks = ({self.memory_bytes / 1e9:,.0f} GB x "
                f"{POOL_HEADROOM:.0%} - {self.weight_bytes / 1e9:,.1f} GB weights) / "
                f"{self.block_bytes / 1e6:,.3f} MB per block{each}")  # fmt: skip


def stage_pool(
    model: ModelProfile, device: DeviceProfile, layers: range, first: bool, last: bool,
    block_size: int, snapshot_interval: int, weight_format: str | None = None, tp: int = 1,
) -> StagePool:  # fmt: skip
    """The KV pool a stage's device memory leaves: ``(memory x POOL_HEADROOM - this
    stage's weights) / bytes per block``, per device where the stage spans ``tp``
    devices (each holds its share of the weights and of every block). On a stage with
    L layers each block also carries 1/``snapshot_interval`` of a snapshot (one snapshot
    per interval), so pools differ between stages as their weights and layer kinds do."""
    weights = stage_weight_bytes(model, layers, first, last, weight_format, tp)
    per_block = kv_block_bytes(model, layers, block_size, tp)
    per_block += snapshot_bytes(model, layers, tp) / max(snapshot_interval, 1)
    room = device.memory_bytes * POOL_HEADROOM - weights
    if device.memory_bytes <= 0 or per_block <= 0 or room < per_block:
        raise ValueError(
            f"{model.name} layers {layers.start}..{layers.stop - 1} on {device.name}: "
            f"{weights / 1e9:,.1f} GB of weights leave no KV pool in "
            f"{device.memory_bytes / 1e9:,.0f} GB x {POOL_HEADROOM:.0%}; use more stages "
            "or --capacity-blocks"
        )
    return StagePool(int(room // per_block), device.memory_bytes, weights, per_block, tp)


def split_layers(num_layers: int, num_stages: int, counts: list[int] | None = None) -> list[range]:
    """Layers of each stage: even by default (earlier stages take the remainder)."""
    if counts is None:
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (1 if s < extra else 0) for s in range(num_stages)]
    if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 1:
        raise ValueError(
            f"layers per stage {counts} must be {num_stages} positive counts summing to "
            f"{num_layers}"
        )
    starts = [sum(counts[:s]) for s in range(num_stages)]
    return [range(start, start + n) for start, n in zip(starts, counts, strict=True)]
