"""Device and model profiles for the simulated executor (DESIGN §6).

Device figures are datasheet peaks (dense, no sparsity) per GPU, with the share of them
a prefill really gets stated beside each profile. Model figures are the public shapes of
each family (``config.json`` on the Hugging Face Hub, or the defaults of the config class
``transformers`` ships for it); each profile names its source.

Weights are stored in one format per run (``WEIGHT_FORMATS``): it sets the bytes a wave
streams per parameter and the matrix rate of the projection and MLP/MoE GEMMs.
Attention (QK and PV), the recurrent update and the KV cache stay in bf16.

Each device profile names its links (``LINKS``): the link inside a node (NVLink) and the
network between nodes (InfiniBand), with the node's size. Bandwidths are datasheet
figures per GPU and direction; latencies are our assumption (neither datasheet nor
measured). ``wavepp.sim.links`` places the stages on them.
"""

from __future__ import annotations

import attrs

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
    """Per-layer shapes of a decoder LM.

    ``pattern`` gives each layer's mixer, repeated over the layers (or one letter per
    layer): ``A`` GQA attention, ``M`` multi-head latent attention (MLA), ``L`` linear
    attention (Gated DeltaNet, or KDA when ``linear_gate_rank`` > 0).
    """

    name: str
    num_layers: int
    pattern: str
    d_model: int
    num_heads: int  # attention query heads (A and M layers)
    num_kv_heads: int  # A layers
    head_dim: int  # A layers
    attn_q_factor: int  # 2 when the query projection also yields an output gate
    mlp_active_params: int  # active MLP/MoE parameters per layer (per token)
    mlp_total_params: int  # all MLP/MoE parameters per layer (weights read per wave)
    linear_qk_dim: int  # L layers: total key (= query) width
    linear_v_dim: int  # L layers: total value width
    linear_heads: int  # L layers: value heads (each with a head_dim x head_dim state)
    linear_head_dim: int
    vocab: int
    linear_gate_rank: int = 0  # KDA: rank of the low-rank forget and output gates (0: GDN)
    q_lora_rank: int = 0  # M layers: query down-projection rank (0: a full query projection)
    kv_lora_rank: int = 0  # M layers: the cached latent's width
    qk_nope_dim: int = 0  # M layers, per head
    qk_rope_dim: int = 0  # M layers: the shared rotary key, also cached
    v_head_dim: int = 0  # M layers, per head
    dense_layers: int = 0  # the first layers have a dense MLP instead of the MoE
    dense_mlp_params: int = 0  # parameters of that dense MLP
    sparse_topk: int = 0  # DSA: keys each query attends to at most (0: dense attention)
    indexer_width: int = 0  # DSA: indexer heads x dim, scored against every prefix key
    weight_format: str = "bf16"  # default format of the run (--weight-format overrides)
    source: str = ""  # where the shapes come from

    def kind(self, layer: int) -> str:
        return self.pattern[layer % len(self.pattern)]

    def attn_params(self) -> int:
        d, q = self.d_model, self.num_heads * self.head_dim
        return d * q * self.attn_q_factor + 2 * d * self.num_kv_heads * self.head_dim + q * d

    def mla_params(self) -> int:
        d, h = self.d_model, self.num_heads
        qk = self.qk_nope_dim + self.qk_rope_dim
        q = (d + h * qk) * self.q_lora_rank if self.q_lora_rank else d * h * qk
        kv_a = d * (self.kv_lora_rank + self.qk_rope_dim)
        return q + kv_a + self.kv_up_params() + h * self.v_head_dim * d

    def kv_up_params(self) -> int:
        """M layers: the latent's up-projection to per-head keys and values."""
        return self.kv_lora_rank * self.num_heads * (self.qk_nope_dim + self.v_head_dim)

    def linear_params(self) -> int:
        d = self.d_model
        qk, v = self.linear_qk_dim, self.linear_v_dim
        if self.linear_gate_rank:  # KDA: q, k, v, low-rank forget and output gates, beta, out
            r = self.linear_gate_rank
            return d * (2 * qk + v) + 2 * (d * r + r * v) + d * self.linear_heads + v * d
        return d * (2 * qk + 2 * v + 2 * self.linear_heads) + v * d  # q,k,v,gate,a,b,out

    def mixer_params(self, layer: int) -> int:
        kind = self.kind(layer)
        if kind == "A":
            return self.attn_params()
        if kind == "M":
            return self.mla_params()
        return self.linear_params()

    def mlp_params(self, layer: int) -> tuple[int, int]:
        """(active, total) MLP parameters of a layer."""
        if layer < self.dense_layers:
            return self.dense_mlp_params, self.dense_mlp_params
        return self.mlp_active_params, self.mlp_total_params

    def attention_pair_flops(self, layer: int) -> int:
        """FLOPs per (query, key) pair of an A or M layer: QK plus PV over all heads."""
        if self.kind(layer) == "M":
            return 2 * self.num_heads * (self.qk_nope_dim + self.qk_rope_dim + self.v_head_dim)
        return 4 * self.num_heads * self.head_dim

    def kv_bytes_per_token(self, layer: int) -> int:
        """Cached bytes per token of a layer: K and V per KV head (A); the latent plus the
        rotary key (M); nothing per token for L (its state is per request)."""
        kind = self.kind(layer)
        if kind == "A":
            return 2 * self.num_kv_heads * self.head_dim * KV_BYTES
        if kind == "M":
            return (self.kv_lora_rank + self.qk_rope_dim) * KV_BYTES
        return 0

    def kv_shards(self, layer: int, tp: int) -> int:
        """Devices of a ``tp``-way tensor-parallel stage that split a layer's per-token
        cache: A layers by KV head (replicated beyond ``num_kv_heads``); an M layer's
        latent serves every head, so each device keeps all of it."""
        if self.kind(layer) == "A":
            return min(tp, self.num_kv_heads)
        return 1 if self.kind(layer) == "M" else tp

    def total_params(self) -> int:
        """Parameters of all layers (embeddings and head excluded)."""
        return sum(self.mixer_params(i) + self.mlp_params(i)[1] for i in range(self.num_layers))

    def active_params(self) -> int:
        return sum(self.mixer_params(i) + self.mlp_params(i)[0] for i in range(self.num_layers))


def _llama3_70b() -> ModelProfile:
    d, ff = 8192, 28672
    return ModelProfile(
        name="llama3-70b", num_layers=80, pattern="A", d_model=d, num_heads=64,
        num_kv_heads=8, head_dim=128, attn_q_factor=1, mlp_active_params=3 * d * ff,
        mlp_total_params=3 * d * ff, linear_qk_dim=0, linear_v_dim=0, linear_heads=0,
        linear_head_dim=0, vocab=128_256, source="meta-llama/Meta-Llama-3-70B config.json",
    )  # fmt: skip


def _qwen3_next_80b() -> ModelProfile:
    # 48 layers, full_attention_interval 4, gated attention (16 heads x 256, 2 KV heads),
    # Gated DeltaNet (16 key heads, 32 value heads, 128 dims), MoE of 512 experts x 512,
    # 10 routed + 1 shared per token.
    d, expert = 2048, 3 * 2048 * 512
    return ModelProfile(
        name="qwen3-next-80b", num_layers=48, pattern="LLLA", d_model=d, num_heads=16,
        num_kv_heads=2, head_dim=256, attn_q_factor=2, mlp_active_params=11 * expert + d * 512,
        mlp_total_params=513 * expert + d * 512, linear_qk_dim=16 * 128,
        linear_v_dim=32 * 128, linear_heads=32, linear_head_dim=128, vocab=151_936,
        source="Qwen/Qwen3-Next-80B-A3B-Instruct config.json",
    )  # fmt: skip


def _kimi_linear_48b() -> ModelProfile:
    # KimiLinearConfig defaults in transformers 5.24 (= moonshotai/Kimi-Linear-48B-A3B):
    # 27 layers, MLA at layers 4, 8, ..., 24 (0-based; 6 of 27), KDA elsewhere; MLA with
    # 32 heads, no query LoRA, latent 512, nope 128 + rope 64, v 128; KDA 32 heads x 128
    # with rank-128 gates; MoE 256 experts x 1024, 8 routed + 1 shared, layer 0 dense 9216.
    d, expert = 2304, 3 * 2304 * 1024
    pattern = "".join("M" if i and i % 4 == 0 else "L" for i in range(27))
    return ModelProfile(
        name="kimi-linear-48b", num_layers=27, pattern=pattern, d_model=d, num_heads=32,
        num_kv_heads=32, head_dim=128, attn_q_factor=1, mlp_active_params=9 * expert,
        mlp_total_params=257 * expert, linear_qk_dim=32 * 128, linear_v_dim=32 * 128,
        linear_heads=32, linear_head_dim=128, vocab=163_840, linear_gate_rank=128,
        kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128, dense_layers=1,
        dense_mlp_params=3 * d * 9216, weight_format="bf16",
        source="transformers KimiLinearConfig defaults (moonshotai/Kimi-Linear-48B-A3B)",
    )  # fmt: skip


def _kimi_k3_class() -> ModelProfile:
    # Kimi K3's config is not public. Its public relatives: Kimi K2 (moonshotai/
    # Kimi-K2-Instruct config.json: 61 layers, d 7168, MLA 64 heads with query LoRA 1536,
    # latent 512, nope 128 + rope 64, v 128; MoE 384 experts x 2048, 8 routed + 1 shared;
    # layer 0 dense 18432) and Kimi Linear (every 4th layer MLA, the rest KDA with 128-dim
    # heads and rank-128 gates). This profile is K2's shapes with Kimi Linear's mix: 15 MLA
    # + 46 KDA layers (64 heads x 128). ≈ 1.0T parameters against K3's 2.8T: compute per
    # token is K2's (≈ 32B active), the per-wave weight stream is about 2.7x smaller.
    d, expert = 7168, 3 * 7168 * 2048
    pattern = "".join("M" if i and i % 4 == 0 else "L" for i in range(61))
    return ModelProfile(
        name="kimi-k3-class", num_layers=61, pattern=pattern, d_model=d, num_heads=64,
        num_kv_heads=64, head_dim=128, attn_q_factor=1, mlp_active_params=9 * expert,
        mlp_total_params=385 * expert, linear_qk_dim=64 * 128, linear_v_dim=64 * 128,
        linear_heads=64, linear_head_dim=128, vocab=163_840, linear_gate_rank=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128,
        dense_layers=1, dense_mlp_params=3 * d * 18432, weight_format="nvfp4",
        source="Kimi K2 shapes (moonshotai/Kimi-K2-Instruct) + Kimi Linear's 3 KDA : 1 MLA mix",
    )  # fmt: skip


def _glm5_class() -> ModelProfile:
    # GlmMoeDsaConfig defaults in transformers 5.24 (glm_moe_dsa, GLM-5's architecture; the
    # paper ran GLM 5.2, whose config is not public): 78 layers, d 6144, MLA 64 heads with
    # query LoRA 2048, latent 512, nope 192 + rope 64, v 256; DeepSeek sparse attention,
    # top-2048 keys per query picked by a 32 x 128 indexer; MoE 256 experts x 2048,
    # 8 routed + 1 shared; first 3 layers dense 12288.
    d, expert = 6144, 3 * 6144 * 2048
    return ModelProfile(
        name="glm5-class", num_layers=78, pattern="M", d_model=d, num_heads=64,
        num_kv_heads=64, head_dim=64, attn_q_factor=1, mlp_active_params=9 * expert,
        mlp_total_params=257 * expert, linear_qk_dim=0, linear_v_dim=0, linear_heads=0,
        linear_head_dim=0, vocab=154_880, q_lora_rank=2048, kv_lora_rank=512,
        qk_nope_dim=192, qk_rope_dim=64, v_head_dim=256, dense_layers=3,
        dense_mlp_params=3 * d * 12288, sparse_topk=2048, indexer_width=32 * 128,
        weight_format="nvfp4", source="transformers GlmMoeDsaConfig defaults (GLM-5)",
    )  # fmt: skip


def _minimax_m2_class() -> ModelProfile:
    # MiniMaxM2Config defaults in transformers 5.24 (= MiniMaxAI/MiniMax-M2; the paper ran
    # M2.7): 62 layers, d 3072, GQA 48 heads x 128 with 8 KV heads, MoE 256 experts x 1536,
    # 8 routed, no shared expert.
    d, expert = 3072, 3 * 3072 * 1536
    return ModelProfile(
        name="minimax-m2-class", num_layers=62, pattern="A", d_model=d, num_heads=48,
        num_kv_heads=8, head_dim=128, attn_q_factor=1, mlp_active_params=8 * expert,
        mlp_total_params=256 * expert, linear_qk_dim=0, linear_v_dim=0, linear_heads=0,
        linear_head_dim=0, vocab=200_064, weight_format="nvfp4",
        source="transformers MiniMaxM2Config defaults (MiniMaxAI/MiniMax-M2)",
    )  # fmt: skip


MODELS: dict[str, ModelProfile] = {
    m.name: m
    for m in (
        _llama3_70b(),
        _qwen3_next_80b(),
        _kimi_linear_48b(),
        _kimi_k3_class(),
        _glm5_class(),
        _minimax_m2_class(),
    )
}


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
    over ``tp`` devices: a ``head_dim x head_dim`` state per value head of each L layer,
    fp32, the heads split over the devices."""
    per_layer = model.linear_heads * model.linear_head_dim**2 * STATE_BYTES
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
