"""The simulator's links: transfer times, where stages sit, and the overlap the runtime
gives a transfer (wavepp.sim.links); tensor-parallel stages (wavepp.sim.executor)."""

import time

import anyio
import pytest
import torch

from wavepp.exec.base import StageOutput
from wavepp.rounds.messages import WaveMsg, encode
from wavepp.runtime.followers import follow_waves
from wavepp.sim.executor import StageCostModel
from wavepp.sim.links import SimulatedLink, Topology
from wavepp.sim.profiles import (
    DEVICES,
    KV_BYTES,
    LINKS,
    MODELS,
    LinkProfile,
    split_layers,
    stage_pool,
    stage_weight_bytes,
)


def test_a_transfer_grows_with_bytes_and_shrinks_with_bandwidth():
    link = LINKS["nvlink4"]
    assert link.transfer_s(2e9) > link.transfer_s(1e9) > link.transfer_s(0) == link.latency_s
    assert LINKS["nvlink5"].transfer_s(1e9) < link.transfer_s(1e9) < LINKS["ib-ndr"].transfer_s(1e9)
    # 8,192 rows of d_model 7,168 in bf16 over 450 GB/s, plus its latency
    sim = SimulatedLink(_Recorder(), link, MODELS["kimi-k3-class"].d_model * KV_BYTES, 1.0)
    assert sim.transfer_s(8192) == pytest.approx(5e-6 + 8192 * 7168 * 2 / 450e9)
    assert sim.transfer_s(16384) > sim.transfer_s(8192)


def test_ring_all_reduce_cost():
    link = LinkProfile("x", 100e9, 1e-5)
    assert link.all_reduce_s(1e9, 1) == 0.0
    assert link.all_reduce_s(1e9, 8) == pytest.approx(14 * 1e-5 + 2 * 7 / 8 * 1e9 / 100e9)


def test_stages_sit_on_node_links_then_the_network():
    h200 = DEVICES["h200"]
    pp8 = Topology(h200, 8)
    assert {pp8.stage_link(s).name for s in range(7)} == {"nvlink4"}  # one node of 8
    tp4 = Topology(h200, 4, tp=4)  # 16 GPUs: stages 0-1 in node 0, 2-3 in node 1
    assert [tp4.stage_link(s).name for s in range(3)] == ["nvlink4", "ib-ndr", "nvlink4"]
    assert tp4.tp_link.name == "nvlink4"
    assert Topology(h200, 4, link="pcie5").stage_link(0).name == "pcie5"
    assert Topology(DEVICES["gb300"], 8, tp=8).stage_link(6).name == "nvlink5"  # NVL72
    with pytest.raises(ValueError, match="tile it"):
        Topology(h200, 2, tp=3)
    with pytest.raises(ValueError, match="unknown"):
        Topology(h200, 2, link="carrier-pigeon")


class _Recorder:
    """An outbound link that notes when each message arrives."""

    kind, src, dst = "local", 0, 1

    def __init__(self) -> None:
        self.arrived: list[tuple[int, float]] = []

    async def send(self, descriptor: bytes, tensor) -> None:
        self.arrived.append((len(self.arrived), time.monotonic()))

    def set_limits(self, limits) -> None: ...


class _Inbound:
    """Waves of ``tokens`` rows each, then the stop wave."""

    kind, src, dst = "local", 0, 1

    def __init__(self, waves: int, tokens: int) -> None:
        self.queue = [(encode(WaveMsg(i, tokens, [])), torch.zeros(tokens, dtype=torch.float16))
                      for i in range(waves)]  # fmt: skip
        self.queue.append((encode(WaveMsg(waves, 0, [], stop=True)), None))

    async def recv(self, max_bytes=None):
        return self.queue.pop(0)


class _Stage:
    """A stage whose every wave computes for ``seconds`` and notes when it started."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.started: list[float] = []
        self.last_wave_s = seconds
        self.handoffs = None  # hands nothing on

    async def begin(self, wave, prompts=None):
        return wave

    async def finish(self, wave, tensor):
        self.started.append(time.monotonic())
        await anyio.sleep(self.seconds)
        return StageOutput(tensor, self.seconds, {}), []

    def take_cache_report(self):
        return None


def test_a_stage_computes_its_next_wave_while_its_last_one_crosses_the_link():
    # A link that takes 0.3 s per wave against 0.02 s of compute: the runtime's worker
    # hands each wave to its sender and goes on, so every wave's compute starts before
    # the previous wave has arrived; the transfers queue on the link, one after another.
    slow = LinkProfile("slow", 1e12, 0.3)
    recorder = _Recorder()
    outbound = SimulatedLink(recorder, slow, MODELS["llama3-70b"].d_model * KV_BYTES, 1.0)
    stage = _Stage(0.02)

    async def run() -> None:
        with anyio.fail_after(30):  # hang guard
            await follow_waves(stage, _Inbound(3, 1), outbound, None)

    anyio.run(run)
    arrivals = [at for _, at in recorder.arrived[:3]]
    assert len(stage.started) == 3
    for k in range(2):
        assert stage.started[k + 1] < arrivals[k]  # wave k+1 computes during k's transfer
        assert arrivals[k + 1] - arrivals[k] >= slow.transfer_s(8192 * 2)  # one at a time


def _stage(model: str, device: str, stages: int, tp: int, stage: int = 0) -> StageCostModel:
    m, topology = MODELS[model], Topology(DEVICES[device], stages, tp)
    layers = split_layers(m.num_layers, stages)[stage]
    return StageCostModel(m, topology.device, layers, stage == stages - 1, tp=tp,
                          tp_link=topology.tp_link)  # fmt: skip


def test_a_tensor_parallel_stage_divides_the_work_and_pays_all_reduces():
    one = _stage("minimax-m2-class", "b300", 1, 1).cost([(0, 16384)], 1)
    eight = _stage("minimax-m2-class", "b300", 1, 8).cost([(0, 16384)], 1)
    assert one.all_reduce_seconds == 0.0
    rows = 16384 * 3072 * 2  # bf16 activations of the wave
    each = LINKS["nvlink5"].all_reduce_s(rows, 8)
    assert eight.all_reduce_seconds == pytest.approx(2 * 62 * each)  # two per layer
    assert eight.flops == pytest.approx(one.flops / 8)
    assert eight.seconds - eight.all_reduce_seconds < one.seconds / 7
    assert eight.seconds >= eight.peak_seconds  # still no faster than the peaks
    with pytest.raises(ValueError, match="needs a link"):
        StageCostModel(MODELS["minimax-m2-class"], DEVICES["b300"], range(62), True, tp=2)


def test_a_tensor_parallel_stage_splits_weights_and_the_kv_its_heads_split():
    kimi, gb300 = MODELS["kimi-k3-class"], DEVICES["gb300"]
    every = range(61)
    assert stage_weight_bytes(kimi, every, True, True, "nvfp4", tp=8) == pytest.approx(
        stage_weight_bytes(kimi, every, True, True, "nvfp4") / 8
    )
    with pytest.raises(ValueError, match="leave no KV pool"):  # 0.56 TB on one 288 GB GPU
        stage_pool(kimi, gb300, every, True, True, 64, 16, "nvfp4")
    pool = stage_pool(kimi, gb300, every, True, True, 64, 16, "nvfp4", tp=8)
    assert pool.blocks > 0 and pool.tp == 8
    minimax = MODELS["minimax-m2-class"]
    # GQA with 8 KV heads: the cache splits 8 ways at T = 8, no further at T = 16
    assert minimax.kv_shards(0, 8) == 8 and minimax.kv_shards(0, 16) == 8
    assert kimi.kv_shards(4, 8) == 1  # MLA: the latent serves every head


def test_the_run_options_place_the_stages():
    from wavepp.config import load
    from wavepp.launch.backends import backend_for
    from wavepp.launch.setup import preflight
    from wavepp.plan.placement import even

    kimi = ["--executor", "sim", "--model", "kimi-k3-class", "--sim-device", "gb300"]
    whole = even(MODELS["kimi-k3-class"].num_layers, 1)
    # 0.56 TB of weights on one GPU
    assert backend_for(load(kimi)).default_pools(1, whole) is None
    (pool,) = backend_for(load([*kimi, "--sim-tp", "8"])).default_pools(1, whole)  # TP8/EP8
    assert pool.tp == 8 and pool.blocks > 0
    with pytest.raises(SystemExit, match="tile it"):
        preflight(load(["--executor", "sim", "--sim-device", "h200", "--sim-tp", "3"]), 2)
    with pytest.raises(SystemExit, match="sim only"):
        load(["--executor", "torch", "--sim-tp", "2"])
