"""Every executor fills the whole Executor protocol: the runtime probes nothing."""

import inspect

import pytest

from wavepp.exec.base import Executor
from wavepp.exec.torch_exec import TorchExecutor
from wavepp.model import BUILTIN, build_stage, random_weights
from wavepp.sim.executor import SimExecutor, StageCostModel
from wavepp.sim.profiles import DEVICES, MODELS, split_layers

NAMES = ["run", "forget", "cancel", "memory_report", "prior_cost", "limits", "take_final",
         "band", "describe", "finish"]


def torch_executor():
    cfg = BUILTIN["tiny-hybrid"]
    return TorchExecutor(build_stage(cfg, range(4), True, False, random_weights(cfg, 0)), 4, 16)


def sim_executor():
    model = MODELS["llama3-70b"]
    layers = split_layers(model.num_layers, 2)[0]
    return SimExecutor(StageCostModel(model, DEVICES["h200"], layers, False))


def test_the_protocol_names_every_call_the_runtime_makes():
    declared = {n for n, _ in inspect.getmembers(Executor) if not n.startswith("_")}
    assert set(NAMES) <= declared


@pytest.mark.parametrize("make", [torch_executor, sim_executor])
def test_executors_fill_the_protocol(make):
    ex = make()
    assert isinstance(ex, Executor)
    for name in NAMES:
        assert callable(getattr(ex, name)), name
    assert inspect.iscoroutinefunction(ex.run)
    report = ex.memory_report()
    assert {"weights_bytes", "kv_pool_bytes"} <= set(report)
    assert all(isinstance(v, int) and v >= 0 for v in report.values())
    a, c, d, floor = ex.prior_cost()
    assert a > 0 and c >= 0 and d >= 0 and floor >= 0
    ex.cancel("never-seen")  # unknown requests are a no-op
    assert isinstance(ex.simulated, bool) and isinstance(ex.has_recurrent, bool)
    assert ex.limits(512).max_tokens == 512
    assert ex.take_final("never-seen") == {}
    assert all(isinstance(line, str) for line in ex.describe())
    assert ex.finish() == ""


def test_torch_memory_report_counts_the_pool():
    ex = torch_executor()
    # tiny-hybrid layers 0..3 are LLLA: one attention layer, K and V of 4 blocks x 16 rows
    assert ex.memory_report()["kv_pool_bytes"] == 2 * 4 * 16 * 2 * 32 * 4
