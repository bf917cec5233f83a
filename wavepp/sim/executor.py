"""The simulated executor: each wave takes the time a cost model gives (DESIGN §6).

Admission, cache effects, planning and the data plane all run for real; only the
model math is replaced by ``anyio.sleep`` of the predicted stage time (or, for a profile
measured on this machine with ``--sim-burn``, by that much CPU work on a core: ``burn``).
Every output of a run with this executor says ``simulated``.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections.abc import Sequence
from typing import Protocol

import anyio
import attrs
import numpy as np
import torch

from wavepp.exec import compute
from wavepp.exec.base import ChunkWork, StageOutput
from wavepp.rounds.messages import MAX_MESSAGE_BYTES
from wavepp.sim.profiles import (
    KV_BYTES,
    WEIGHT_FORMATS,
    DeviceProfile,
    LinkProfile,
    ModelProfile,
)
from wavepp.state import BlockHash, RequestId
from wavepp.transport.frames import DataLimits


@attrs.frozen
class WaveCost:
    seconds: float
    flops: float
    bytes: float
    peak_seconds: float = 0.0  # the same work at 100% of every datasheet peak
    all_reduce_seconds: float = 0.0  # of seconds: a tp-way stage's all-reduces


def attention_pairs(prefix: int, tokens: int, topk: int = 0) -> float:
    """(query, key) pairs of a causal chunk of ``tokens`` after ``prefix`` cached tokens;
    with ``topk`` > 0 each query sees at most ``topk`` keys (sparse attention)."""
    dense = tokens * (prefix + tokens / 2)
    if not topk or prefix + tokens <= topk:
        return dense
    if prefix >= topk:
        return float(tokens * topk)
    below = topk - prefix  # queries that still see all their keys
    return below * (prefix + below / 2) + (tokens - below) * topk


@attrs.frozen
class StageCostModel:
    """Predicted time of one wave on one stage: a roofline of FLOPs and bytes.

    A stage may span ``tp`` devices (tensor parallel, experts spread over them): each
    device does 1/``tp`` of every matmul, attention head and expert and streams its share
    of the weights and KV; after each layer's mixer and after its MLP/MoE the devices
    all-reduce the wave's activations over ``tp_link`` (a ring), which the layer waits
    for. Experts spread (EP) as SGLang's TP+EP without DP attention places them: every
    device sees every token and runs its own experts, and the MoE output's all-reduce
    combines them, so EP adds no all-to-all to the two all-reduces.
    """

    model: ModelProfile
    device: DeviceProfile
    layers: range
    is_last: bool
    weight_format: str | None = None  # None: the model's default
    tp: int = attrs.field(default=1, kw_only=True)
    tp_link: LinkProfile | None = attrs.field(default=None, kw_only=True)

    def __attrs_post_init__(self) -> None:
        if self.tp < 1 or (self.tp > 1 and self.tp_link is None):
            raise ValueError(f"a stage over {self.tp} devices needs a link for its all-reduces")

    @property
    def fmt(self) -> str:
        return self.weight_format or self.model.weight_format

    @property
    def has_recurrent(self) -> bool:
        return any(self.model.kind(layer) == "L" for layer in self.layers)

    @property
    def shared_first(self) -> float | None:
        """Whole layers: no mixer shared with the stage before."""
        return None

    def shared_rows(self, chunks: Sequence) -> int:
        """Whole layers: no rows of a mixer shared with the next stage."""
        return 0

    def cost(self, chunks: Sequence[tuple[int, int]], num_finished: int) -> WaveCost:
        """``chunks``: (start, end) token ranges; start is the chunk's attention prefix."""
        m, dev, fmt = self.model, self.device, self.fmt
        tokens = sum(end - start for start, end in chunks)
        if tokens == 0:
            return WaveCost(0.0, 0.0, 0.0)
        layers = list(self.layers)
        kinds = [m.kind(layer) for layer in layers]
        mixer = sum(m.mixer_params(layer) for layer in layers)
        mlp = [m.mlp_params(layer) for layer in layers]
        gemm = 2.0 * (mixer + sum(active for active, _ in mlp)) * tokens
        if self.is_last:
            gemm += 2.0 * m.d_model * m.vocab * num_finished  # head on each last position
        attn = 0.0
        for layer, kind in zip(layers, kinds, strict=True):
            if kind == "L":
                continue
            pairs = sum(attention_pairs(s, e - s, m.sparse_topk) for s, e in chunks)
            attn += m.attention_pair_flops(layer) * pairs
            if m.indexer_width:  # DSA's indexer scores every prefix key
                attn += 2.0 * m.indexer_width * sum(attention_pairs(s, e - s) for s, e in chunks)
            if kind == "M":  # prefill expands the cached latent of the prefix to K and V
                gemm += 2.0 * m.kv_up_params() * sum(s for s, _ in chunks)
        # Chunked linear attention: per token and value head, update and read a
        # key x value state.
        recurrent = 4.0 * tokens * m.state_elements() * kinds.count("L")
        # Bytes: every weight of the stage once (MoE: the experts the tokens can touch),
        # the cached KV of every chunk's prefix, and the activations.
        expert_bytes = 0.0
        for active, total in mlp:
            share = active / total
            expert_bytes += total * max(min(1.0, tokens * share), share)
        weights = (mixer + expert_bytes) * WEIGHT_FORMATS[fmt]
        kv = sum(start for start, _ in chunks) * sum(
            m.kv_bytes_per_token(i) / m.kv_shards(i, self.tp) for i in layers
        )
        act = tokens * m.d_model * KV_BYTES * len(kinds)  # each device holds all of them
        # One device's share of a tp-way stage (tp = 1: the whole stage).
        gemm, attn, recurrent, weights = (x / self.tp for x in (gemm, attn, recurrent, weights))
        nbytes = weights + kv + act
        compute = (
            gemm / dev.gemm_rate(fmt)
            + recurrent / (dev.peak_flops * dev.gemm_efficiency)
            + attn / (dev.peak_flops * dev.attention_efficiency)
        )
        memory = nbytes / (dev.hbm_bytes_s * dev.hbm_efficiency)
        comm = self.all_reduce_s(tokens) * 2 * len(kinds)
        seconds = max(compute, memory) + comm + dev.wave_overhead_s
        flops = gemm + attn + recurrent
        peak = comm + max(
            gemm / dev.matrix_flops(fmt) + (attn + recurrent) / dev.peak_flops,
            nbytes / dev.hbm_bytes_s,
        )
        # Roofline guard: no wave may beat the device's peaks.
        if seconds < peak:
            raise AssertionError(f"wave of {tokens} tokens predicted faster than peak")
        return WaveCost(seconds, flops, nbytes, peak, comm)

    def generic_prior(self) -> tuple[float, float, float, float]:
        """(a, c, d, floor) of ``d + max(floor, a·t + c·t·(p + t/2))`` as the torch
        executor makes its prior: the stage's FLOPs per token and per attention pair at
        one nominal rate (here the device's datasheet bf16 peak, shared over ``tp``), a
        nominal 1 ms a wave, no floor — not this model's efficiencies, memory roofline or
        overheads, which the planner must learn from the waves it observes."""
        m, rate = self.model, self.device.peak_flops * self.tp
        params = sum(m.mixer_params(i) + m.mlp_params(i)[0] for i in self.layers)
        pair = sum(m.attention_pair_flops(i) for i in self.layers if m.kind(i) != "L")
        return 2.0 * params / rate, pair / rate, 1e-3, 0.0

    def all_reduce_s(self, tokens: int) -> float:
        """One all-reduce of ``tokens`` bf16 activation rows over the stage's devices."""
        if self.tp == 1:
            return 0.0
        return self.tp_link.all_reduce_s(tokens * self.model.d_model * KV_BYTES, self.tp)


class StageCost(Protocol):
    """What the simulated executor asks of a stage's cost model (``StageCostModel``
    from a datasheet, ``wavepp.sim.measured.MeasuredStageCost`` from a profile)."""

    is_last: bool
    has_recurrent: bool  # the stage holds recurrent mixers
    shared_first: float | None  # the share of a mixer shared with the stage before

    def cost(self, chunks: Sequence[tuple[int, int]], num_finished: int) -> WaveCost: ...

    def shared_rows(self, chunks: Sequence) -> int:
        """Rows of a mixer shared with the next stage sent on besides the wave's."""
        ...

    def generic_prior(self) -> tuple[float, float, float, float]: ...


# asyncio's epoll selector rounds every timeout up to the next millisecond, so a sleep
# ends half a millisecond late on average: on a 27 ms wave, 2% of the stage's time
# idle that no device would idle. A wave sleeps this much less than its time, so that
# on average it ends when predicted (what remains late is the event loop's own work).
TIMER_ROUNDING_S = 0.5e-3


BURN_BLOCK = bytes(64 << 10)  # hashed in ~40 us here, the GIL let go meanwhile


def burn_rate(seconds: float = 0.2, repeats: int = 5) -> float:
    """Blocks a second this thread hashes (``burn``'s unit of work): the median of
    ``repeats`` tries of ``seconds`` each."""
    rates = []
    for _ in range(repeats):
        blocks, started = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - started) < seconds:
            hashlib.sha256(BURN_BLOCK).digest()
            blocks += 1
        rates.append(blocks / elapsed)
    return sorted(rates)[len(rates) // 2]


def burn(seconds: float, rate: float | None = None) -> None:
    """Hold a core for ``seconds`` of work, hashing a block that ``hashlib`` hashes with
    the GIL let go: ``seconds`` x ``rate`` blocks (``rate``: blocks a second measured
    with the profile, so the work takes longer when the machine is slower than it was
    then, as a torch wave does), or without a rate this thread's CPU time. A wave so spent
    holds a core as a torch wave does: ranks sharing the machine's cores, and the rank's
    own host work, stretch its wall time as they stretch a real wave's."""
    if rate:
        for _ in range(max(1, round(seconds * rate))):
            hashlib.sha256(BURN_BLOCK).digest()
        return
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        hashlib.sha256(BURN_BLOCK).digest()


class SimExecutor:
    """Sleeps the predicted time of each wave, times a seeded noise factor; passes a
    token-sized tensor along. The stage is charged the predicted time; the sleep aims to
    end then (``TIMER_ROUNDING_S``).

    ``noise`` is the coefficient of variation of a wave's time about the prediction (a
    lognormal factor of mean 1), drawn from ``rng``: a real stage's identical waves are
    not equally long, and a planner that learns from wave times must see that.

    ``burn``: each wave spends its time as work on the process's compute thread
    (:func:`burn`, at ``burn_rate`` blocks a second) instead of sleeping, and the stage is
    charged the wall time that took (a profile measured on this machine: the machine's
    contention and its speed now then play out)."""

    simulated = True

    def __init__(self, cost_model: StageCost, time_scale: float = 1.0,
                 noise: float = 0.0, rng: np.random.Generator | None = None,
                 burn: bool = False, burn_rate: float | None = None) -> None:  # fmt: skip
        if time_scale <= 0:
            raise ValueError(f"time scale must be positive, got {time_scale}")
        if noise < 0:
            raise ValueError(f"noise must be ≥ 0, got {noise}")
        self.cost_model = cost_model
        self.has_recurrent = cost_model.has_recurrent
        self.time_scale = time_scale
        self.sigma = math.sqrt(math.log1p(noise * noise))  # lognormal with CV = noise
        self.rng = rng if rng is not None else np.random.default_rng(0)
        self.burn = burn
        self.burn_rate = burn_rate

    async def run(
        self, chunks: Sequence[ChunkWork], activations: torch.Tensor | None
    ) -> StageOutput:
        charged = [(c.start, c.end) for c in chunks if not c.free]
        finished = sum(1 for c in chunks if c.is_last and not c.free)
        seconds = self.cost_model.cost(charged, finished).seconds * self.time_scale
        if seconds and self.sigma:
            seconds *= float(self.rng.lognormal(-self.sigma**2 / 2, self.sigma))
        if seconds and self.burn:
            started = time.perf_counter()
            future = compute.submit(burn, seconds, self.burn_rate)
            with anyio.CancelScope(shield=True):  # the core's work, once started, is done
                await asyncio.wrap_future(future)
            seconds = time.perf_counter() - started
        elif seconds:
            await anyio.sleep(max(seconds - TIMER_ROUNDING_S, 0.0))
        tokens = sum(c.end - c.start for c in chunks)
        # activations: [tokens] float16, a stand-in for the [tokens, d_model] hidden states
        # (and the rows of a mixer shared with the next stage, as the torch stage sends)
        rows = tokens + self.cost_model.shared_rows(chunks)
        out = None if self.cost_model.is_last else torch.zeros(rows, dtype=torch.float16)
        results = {c.request_id: (-1, 0.0) for c in chunks if c.is_last}
        return StageOutput(out, seconds, results)  # real seconds

    def forget(self, evicted: Sequence[BlockHash]) -> None:
        """Nothing is stored for a simulated block."""

    def cancel(self, request_id: RequestId) -> None:
        """Nothing is stored for a simulated request."""

    def memory_report(self) -> dict[str, int]:
        return {"weights_bytes": 0, "kv_pool_bytes": 0}

    def limits(self, budget: int) -> DataLimits:
        """``[tokens]`` float16 stand-ins, twice the rows after a shared mixer."""
        rows = budget * (2 if self.cost_model.shared_first else 1)
        return DataLimits.for_run(rows, None, torch.float16, MAX_MESSAGE_BYTES)

    def take_final(self, request_id: RequestId) -> dict:
        """No state is kept for a simulated request."""
        return {}

    def band(self, job) -> list:
        raise RuntimeError(f"{job.request_id}: a simulated stage holds no cache to hand on")

    def describe(self) -> list[str]:
        return []

    def finish(self) -> str:
        """Nothing runs beside this executor."""
        return ""

    def prior_cost(self) -> tuple[float, float, float, float]:
        """The cost planner's prior, (a, c, d, floor) in real seconds: the cost model's
        generic prior (FLOPs at a nominal rate, as the torch executor's), never its own
        predictions — the planner learns this stage's times from the waves it observes,
        as on real hardware."""
        a, c, d, floor = self.cost_model.generic_prior()
        k = self.time_scale
        return a * k, c * k, d * k, floor * k
