"""The measured device profile (wavepp.sim.measured), its fit (wavepp.sim.calibrate),
the sim's seeded noise and the planner's generic prior."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import anyio
import attrs
import numpy as np
import pytest

from wavepp.config import RunConfig
from wavepp.exec.base import ChunkWork
from wavepp.launch.backends import DatasheetBackend, backend_for
from wavepp.plan.placement import WaveShape, share_row
from wavepp.sim.calibrate import fit_part, nnls
from wavepp.sim.executor import SimExecutor, StageCostModel, attention_pairs
from wavepp.sim.measured import (
    MAX_FILE_BYTES,
    MeasuredProfile,
    MeasuredStageCost,
    PartCost,
    ProfileError,
    load_profile,
    parse_profile,
)
from wavepp.sim.profiles import DEVICES, MODELS, split_layers


def profile(scale: float = 1.0, overhead: float = 1e-4) -> MeasuredProfile:
    parts = {
        "mixer:kda": PartCost(1e-4 * scale, 2e-6 * scale, 0.0, 1e-7, 0.0),
        "mixer:mla": PartCost(1e-4 * scale, 1e-6 * scale, 3e-9 * scale, 1e-7, 2e-9),
        "mlp:dense": PartCost(5e-5 * scale, 1e-6 * scale, 0.0, 2e-7, 0.0),
        "mlp:moe": PartCost(2e-4 * scale, 3e-6 * scale, 0.0, 1e-7, 0.0),
        "last_layer": PartCost(3e-4 * scale, 2e-6 * scale, 3e-9 * scale, 3e-7, 2e-9),
        "embed": PartCost(1e-5, 1e-8, 0.0),
        "head": PartCost(2e-5, 1e-6, 0.0),
    }
    return MeasuredProfile(
        "tiny-kimi", 128, 512, ("kda", "kda", "kda", "mla") * 2, ("dense",) + ("moe",) * 7, 4,
        parts, overhead, 0.02, {"cpu": "test"},
    )  # fmt: skip


def test_a_profile_round_trips_through_its_json(tmp_path):
    p = profile()
    path = tmp_path / "p.json"
    path.write_text(json.dumps(p.to_json([{"chunks": 1}])))
    back = load_profile(str(path))
    assert attrs_equal(back, p)
    assert json.loads(path.read_text())["schema"] == "wavepp.sim.measured/1"


def attrs_equal(a: MeasuredProfile, b: MeasuredProfile) -> bool:
    fields = ("model", "d_model", "vocab", "mixers", "mlps", "act_bytes", "parts",
              "wave_overhead_s", "noise", "machine", "link")  # fmt: skip
    return all(getattr(a, f) == getattr(b, f) for f in fields)


def _broken(change) -> dict:
    data = profile().to_json()
    change(data)
    return data


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda d: d.update(schema="wavepp.sim.measured/0"), "schema"),
        (lambda d: d["parts"].pop("mlp:moe"), "no fit for ['mlp:moe']"),
        (lambda d: d["parts"]["head"].update(token_s=-1.0), "token_s must be ≥ 0"),
        (lambda d: d["parts"]["head"].update(token_s=float("nan")), "finite number"),
        (lambda d: d["parts"]["head"].update(wave_s=True), "finite number"),
        (lambda d: d["parts"]["head"].update(extra=1.0), "must hold only"),
        (lambda d: d.update(layers=[["conv", "dense"]]), "layers must be"),
        (lambda d: d.update(d_model=0), "d_model must be a positive integer"),
        (lambda d: d.update(link={"bytes_s": 0, "latency_s": 0}), "bytes_s must be positive"),
        (lambda d: d.update(wave_overhead_s="1"), "wave_overhead_s must be a finite number"),
        (lambda d: d.update(machine=[]), "machine must be an object"),
        (lambda d: d.update(machine={"cores": 0}), "machine cores must be a positive integer"),
        (lambda d: d.update(machine={"threads": "2"}), "machine threads must be a positive"),
    ],
)
def test_a_malformed_profile_is_refused_with_its_reason(change, says):
    with pytest.raises(ProfileError, match=re_escape(says)):
        parse_profile(_broken(change), "p.json")


def re_escape(text: str) -> str:
    return re.escape(text)


def test_a_file_that_is_not_a_profile_is_refused_before_use(tmp_path):
    for content, says in ((b"{not json", "not JSON"), (b"[1, 2]", "not a JSON object"),
                          (b" " * (MAX_FILE_BYTES + 1), "more than a profile's")):  # fmt: skip
        path = tmp_path / f"bad{len(content)}.json"
        path.write_bytes(content)
        with pytest.raises(ProfileError, match=re_escape(says)):
            load_profile(str(path))
    with pytest.raises(ProfileError, match="cannot read it"):
        load_profile(str(tmp_path / "missing.json"))


def test_the_run_loads_measured_file_and_refuses_another_model(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile().to_json()))
    c = RunConfig(executor="sim", model="tiny-kimi", sim_device=f"measured:{path}")
    assert backend_for(c).profile.d_model == 128
    datasheet = backend_for(RunConfig(executor="sim", model="qwen3-next-80b"))
    assert isinstance(datasheet, DatasheetBackend)
    with pytest.raises(SystemExit, match="measured with 'tiny-kimi', not --model 'tiny-llama'"):
        backend_for(RunConfig(executor="sim", model="tiny-llama",
                              sim_device=f"measured:{path}"))  # fmt: skip
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit, match=r"--sim-device: .*schema"):
        backend_for(RunConfig(executor="sim", model="tiny-kimi", sim_device=f"measured:{bad}"))


def test_a_measured_stage_prices_its_units_from_the_fits():
    p = profile()
    chunks = [(0, 512), (1024, 1280)]
    tokens, pairs = 768, attention_pairs(0, 512) + attention_pairs(1024, 256)
    first = MeasuredStageCost(p, range(0, 4), True, False).cost(chunks, 0).seconds
    want = (p.wave_overhead_s + p.parts["embed"].seconds(tokens, 0)
            + p.parts["mixer:kda"].seconds(tokens, pairs) * 2
            + p.parts["mlp:dense"].seconds(tokens, pairs)
            + p.parts["mlp:moe"].seconds(tokens, pairs))  # fmt: skip
    assert first == pytest.approx(want)
    # the last stage: layer 7 is one entry (the last layer), the head per finished row
    last = MeasuredStageCost(p, range(13, 16), False, True)
    want = (p.wave_overhead_s + p.parts["mlp:moe"].seconds(tokens, pairs)
            + p.parts["last_layer"].seconds(tokens, pairs) + p.parts["head"].seconds(2, 0))
    assert last.cost(chunks, 2).seconds == pytest.approx(want)
    # a slower machine's profile predicts slower waves; an empty wave costs nothing
    slow = MeasuredStageCost(profile(scale=2.0), range(0, 4), True, False)
    assert slow.cost(chunks, 0).seconds > first
    assert slow.cost([], 0).seconds == 0.0


def test_unit_costs_feed_the_torch_placement_with_each_part_as_a_stage():
    p = profile()
    mixers, mlps, last, embed, head = p.unit_costs(WaveShape(2, 256, 512))
    assert len(mixers) == len(mlps) == 7
    pairs = 2 * attention_pairs(512, 256)
    assert mixers[3] == pytest.approx(p.parts["mixer:mla"].seconds(512, pairs) + 1e-4)
    assert head == pytest.approx(p.parts["head"].seconds(2, 0) + 1e-4)
    assert last > mlps[0] and embed > 0


def test_a_shared_mixer_is_priced_as_the_torch_placement_prices_it():
    p = profile()
    shape = WaveShape(2, 256, 512)
    rowless = p.rowless_costs(shape)  # layer 3 is MLA; KDA layers cannot be shared
    assert [r is None for r in rowless] == [True, True, True, False, True, True, True]
    assert rowless[3] == pytest.approx(p.parts["mixer:mla"].seconds(512, 0) + 1e-4)
    chunks = [(512, 768)] * 2
    pairs = 2 * attention_pairs(512, 256)
    mla = p.parts["mixer:mla"]
    for share in (0.25, 0.7):  # layer 3's mixer (unit 6) shared: units 4..6, then 6..8
        before = MeasuredStageCost(p, range(4, 7), False, False, shared_last=share)
        after = MeasuredStageCost(p, range(6, 9), False, False, shared_first=share)
        dense = MeasuredStageCost(p, range(4, 6), False, False).cost(chunks, 0).seconds
        assert before.cost(chunks, 0).seconds == pytest.approx(
            dense + mla.seconds(512, share * pairs))
        rest = MeasuredStageCost(p, range(7, 9), False, False).cost(chunks, 0).seconds
        assert after.cost(chunks, 0).seconds == pytest.approx(
            rest + mla.seconds(512, (1 - share) * pairs))
        # the stage before sends the shared rows on, as the torch stage does
        works = [ChunkWork(f"r{i}", 512, 768, 768, (), (), False) for i in range(2)]
        m = share_row(chunks, share, p.d_model // 2)
        assert 0 < m < 512 and before.shared_rows(works) == m and after.shared_rows(works) == 0
        sent = anyio.run(SimExecutor(before).run, works, None)
        assert sent.activations.shape == (512 + m,)


def test_the_fit_recovers_synthetic_coefficients():
    rng = np.random.default_rng(0)
    truth = (2e-4, 3e-6, 5e-10, 4e-4)  # wave, token, pair, chunk
    points = []
    for n, t, prefix in ((1, 128, 0), (1, 512, 0), (1, 2048, 0), (1, 256, 1792), (1, 1024, 1024),
                         (2, 256, 4096), (4, 512, 0), (8, 256, 0), (16, 64, 1984)):  # fmt: skip
        tokens, pairs = n * t, n * attention_pairs(prefix, t)
        seconds = truth[0] + truth[1] * tokens + truth[2] * pairs + truth[3] * n
        points.append((tokens, pairs, n, seconds * (1 + 0.001 * rng.standard_normal())))
    for got, want in zip(fit_part(points), truth, strict=True):
        assert got == pytest.approx(want, rel=0.05)
    # a part whose work does not grow with the prefix nor with the chunks: both terms 0
    flat = [(tk, pr, n, truth[0] + truth[1] * tk) for tk, pr, n, _ in points]
    wave, token, pair, chunk = fit_part(flat, prefix=False, per_chunk=False)
    assert (pair, chunk) == (0.0, 0.0)
    assert (wave, token) == (pytest.approx(truth[0]), pytest.approx(truth[1]))


def test_a_profile_written_before_the_chunk_term_reads_it_as_zero(tmp_path):
    data = profile().to_json()
    for fit in data["parts"].values():
        del fit["chunk_s"]
    parsed = parse_profile(data, "old.json")
    assert all(part.chunk_s == 0.0 for part in parsed.parts.values())
    assert parsed.parts["mixer:kda"].seconds(100, 0, 4) == pytest.approx(1e-4 + 2e-6 * 100)


def test_a_stage_pays_each_parts_chunk_term_once_per_chunk():
    p = attrs.evolve(profile(), parts=profile().parts | {
        "mixer:kda": PartCost(1e-4, 2e-6, 0.0, 1e-7, 0.0, chunk_s=5e-4)})  # fmt: skip
    stage = MeasuredStageCost(p, range(2, 4), False, False)  # layer 1: kda, moe
    one, four = stage.cost([(0, 256)], 0), stage.cost([(0, 64)] * 4, 0)
    assert four.seconds - one.seconds == pytest.approx(3 * 5e-4)


def test_a_burnt_wave_spends_its_time_on_a_core_and_is_charged_its_wall():
    import time

    from wavepp.sim.executor import burn

    before = time.thread_time()
    burn(0.05)
    assert time.thread_time() - before >= 0.05  # CPU time, which a sleep does not spend
    stage = MeasuredStageCost(profile(), range(2, 4), False, False)
    work = [ChunkWork("r", 0, 256, 257, (), (), False)]
    predicted = stage.cost([(0, 256)], 0).seconds
    out = anyio.run(SimExecutor(stage, burn=True).run, work, None)
    assert out.seconds >= predicted


def test_a_burn_at_a_measured_rate_hashes_that_many_blocks(monkeypatch):
    from wavepp.sim import executor

    calls = []
    monkeypatch.setattr(executor.hashlib, "sha256", lambda block: calls.append(len(block))
                        or executor.hashlib.new("md5"))  # fmt: skip
    executor.burn(0.25, rate=200.0)  # 50 blocks, however fast this machine is now
    assert calls == [len(executor.BURN_BLOCK)] * 50


def test_the_fit_keeps_every_coefficient_non_negative():
    # seconds falling with tokens: plain least squares would give a negative slope
    coef = nnls([[1.0, 100.0], [1.0, 200.0], [1.0, 300.0]], [3.0, 2.9, 2.8])
    assert min(coef) >= 0 and coef[1] == 0.0
    assert coef[0] == pytest.approx(2.9)


def _waves(executor: SimExecutor, n: int) -> list[float]:
    chunk = ChunkWork("r", 0, 256, 257, (), (), False)

    async def run() -> list[float]:
        return [(await executor.run([chunk], None)).seconds for _ in range(n)]

    return anyio.run(run)


def test_sim_noise_is_seeded_and_has_the_asked_spread():
    model = MODELS["llama3-70b"]
    cost = StageCostModel(model, DEVICES["h200"], split_layers(model.num_layers, 2)[0], False)
    exact = cost.cost([(0, 256)], 0).seconds
    scale = 1e-4  # sleep little: the time slept is what the stage reports
    quiet = _waves(SimExecutor(cost, scale), 3)
    assert quiet == [pytest.approx(exact * scale)] * 3
    one = _waves(SimExecutor(cost, scale, 0.05, np.random.default_rng([7, 0])), 400)
    two = _waves(SimExecutor(cost, scale, 0.05, np.random.default_rng([7, 0])), 400)
    other = _waves(SimExecutor(cost, scale, 0.05, np.random.default_rng([8, 0])), 400)
    assert one == two and one != other
    ratios = np.array(one) / (exact * scale)
    assert ratios.mean() == pytest.approx(1.0, abs=0.015)
    assert ratios.std() == pytest.approx(0.05, rel=0.2)


def test_a_wave_sleeps_its_time_less_the_timers_rounding(monkeypatch):
    # the event loop's timer ends a sleep half a millisecond late on average: the wave
    # asks for that much less, and the stage is still charged its whole predicted time
    from wavepp.sim import executor as sim

    slept = []

    async def sleep(seconds):
        slept.append(seconds)

    monkeypatch.setattr(sim.anyio, "sleep", sleep)
    model = MODELS["llama3-70b"]
    cost = StageCostModel(model, DEVICES["h200"], split_layers(model.num_layers, 2)[0], False)
    exact = cost.cost([(0, 256)], 0).seconds
    assert _waves(SimExecutor(cost), 1) == [pytest.approx(exact)]
    assert slept == [pytest.approx(exact - sim.TIMER_ROUNDING_S)]
    slept.clear()
    assert _waves(SimExecutor(cost, 1e-3), 1) == [pytest.approx(exact * 1e-3)]
    assert slept == [max(exact * 1e-3 - sim.TIMER_ROUNDING_S, 0.0)]


def test_the_planners_prior_is_not_the_simulators_cost_function():
    # MoE weights streamed every wave make this stage's waves cost far more than its
    # FLOPs; the prior counts FLOPs at the datasheet peak, a nominal 1 ms and no floor,
    # as the torch executor's prior does: the planner must learn the rest from waves.
    model = MODELS["qwen3-next-80b"]
    device = DEVICES["h200"]
    cost = StageCostModel(model, device, split_layers(model.num_layers, 4)[0], False)
    a, c, d, floor = SimExecutor(cost).prior_cost()
    assert (d, floor) == (1e-3, 0.0)
    layers = split_layers(model.num_layers, 4)[0]
    active = sum(model.mixer_params(i) + model.mlp_params(i)[0] for i in layers)
    assert a == pytest.approx(2 * active / device.peak_flops)
    predicted = d + max(floor, a * 256)
    assert cost.cost([(0, 256)], 0).seconds > 3 * predicted  # the floor it must learn
    assert c > 0 and math.isfinite(c)


def test_calibrate_then_simulate_end_to_end(tmp_path):
    # a two-point calibration of tiny-llama, then a one-stage sim run from its profile
    from wavepp.sim import calibrate

    grid = ((1, 64, 0), (2, 128, 64), (4, 32, 0), (1, 256, 0))
    record = calibrate.calibrate("tiny-llama", 1, "float32", 16, 2, 0, log=lambda _: None,
                                 grid=grid)  # fmt: skip
    path = tmp_path / "tiny-llama.json"
    path.write_text(json.dumps(record))
    measured = load_profile(str(path))
    assert measured.model == "tiny-llama" and len(record["points"]) == len(grid)
    assert measured.machine["threads"] == 1 and measured.machine["torch"]
    assert measured.machine["cores"] == len(os.sched_getaffinity(0))  # the cores it may use
    assert measured.link is not None and measured.link.bytes_s > 0
    out = tmp_path / "run.json"
    cmd = [sys.executable, "-m", "wavepp.main", "--executor", "sim", "--model", "tiny-llama",
           "--sim-device", f"measured:{path}", "--workload", "cold", "--requests", "4",
           "--prompt-tokens", "256", "--concurrency", "2", "--budget", "512",
           "--block-size", "16", "--no-progress", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = json.loads(out.read_text())
    assert run["simulated"] is True and run["throughput_tok_s"] > 0
    assert run["config"]["sim_device"] == f"measured:{path}"
    assert run["config"]["sim_noise"] > 0


def test_ranks_beyond_the_profiles_cores_stretch_every_wave():
    """Four single-thread ranks on the two cores a profile was measured on: each wave
    takes twice as long; two ranks, or a profile that does not say its cores: as fitted."""
    two_cores = attrs.evolve(profile(), machine={"cores": 2, "threads": 1})
    assert two_cores.core_sharing(4, 0) == 2.0 and two_cores.core_sharing(4, 1) == 2.0
    assert two_cores.core_sharing(2, 0) == 1.0 and two_cores.core_sharing(1, 4) == 2.0
    assert profile().core_sharing(8, 1) == 1.0
    chunks = [(0, 64), (128, 160)]
    alone = MeasuredStageCost(two_cores, range(0, 4), True, False).cost(chunks, 0).seconds
    shared = MeasuredStageCost(two_cores, range(0, 4), True, False, 2.0).cost(chunks, 0).seconds
    assert alone > 0 and shared == pytest.approx(2 * alone)


def test_the_sim_noise_default_is_the_validations_measured_spread():
    """``--sim-noise``'s default is the spread of the torch runs in the recorded
    validation (docs/results/validate-quick.json), not a figure of judgement."""
    from pathlib import Path

    from benchmarks.validate import run_spread
    from wavepp.config import SIM_NOISE

    record = Path(__file__).parents[2] / "docs" / "results" / "validate-quick.json"
    spread = run_spread(json.loads(record.read_text())["rows"])
    assert 0 < spread < 1 and round(spread, 3) == SIM_NOISE


def test_validation_rows_compare_medians_and_say_why_a_cell_misses():
    from benchmarks.validate import CORES, Spec, row, run_spread, table

    def runs(*pairs, util=(0.5, 0.25), waves=(4, 4)):
        return [{"throughput_tok_s": t, "completion_p50_s": p, "makespan_s": 2.0,
                 "stage_utilization": list(util), "stage_waves": list(waves)}
                for t, p in pairs]  # fmt: skip

    good = row(Spec("tiny-kimi", "cold", 2), runs((1000, 1.0), (1100, 1.2), (900, 0.8)),
               runs((1050, 1.05)))  # fmt: skip
    assert (good["measured_tok_s"], good["measured_p50_s"]) == (1000, 1.0)
    assert good["tok_s_error"] == pytest.approx(0.05) and good["within_goal"]
    assert good["note"] == ""
    assert good["runs"]["torch"][0]["stage_busy_s"] == [1.0, 0.5]
    # a miss names what differs: seconds a wave (busy 1.0 s over 4 waves against 0.5 s)
    slow = row(Spec("tiny-kimi", "seeded", 2), runs((1000, 1.0)),
               runs((1500, 0.5), util=(0.25, 0.125)))  # fmt: skip
    assert not slow["within_goal"] and slow["wave_ratio"] == pytest.approx(2.0)
    assert slow["note"].startswith("a real wave took 2.00x the predicted one")
    # waves a stage, the busy share (with the cores shared), the stages' balance
    crowded = row(Spec("tiny-llama", "seeded", 2 * CORES),
                  runs((1000, 1.0), util=(0.4, 0.4), waves=(4, 4)),
                  runs((1500, 0.5), util=(0.8, 0.4), waves=(8, 8)))  # fmt: skip
    assert not crowded["within_goal"]
    assert "4 real waves a stage against 8 simulated" in crowded["note"]
    assert "the real stages busy 40% of the run against 60% simulated" in crowded["note"]
    assert f"{2 * CORES} ranks on {CORES} cores" in crowded["note"]
    assert "1.00x unevenly (slowest over fastest busy time) real, 2.00x simulated" in \
        crowded["note"]
    burnt = row(Spec("tiny-llama", "seeded", 2 * CORES),
                runs((1000, 1.0), util=(0.4, 0.4), waves=(4, 4)),
                runs((1500, 0.5), util=(0.8, 0.4), waves=(8, 8)), burned=True)  # fmt: skip
    assert "busy 40% of the run against 60% simulated" in burnt["note"]
    assert "cores" not in burnt["note"]  # its waves shared the cores as well
    same = row(Spec("tiny-llama", "cold", 1), runs((1000, 1.0), util=(0.5,), waves=(4,)),
               runs((1500, 0.5), util=(0.5,), waves=(4,)))  # fmt: skip
    assert same["note"] == "miss: cause not identified"
    text = table([good, crowded])
    assert "tiny-kimi/cold/P2" in text and "1 of 2 cells within the goal" in text
    assert "SIMULATED" in text
    # the torch runs' spread: the median over cells of their relative standard deviation
    assert run_spread([good, crowded]) == pytest.approx(0.1)  # one run: no spread


def test_cells_are_chosen_by_the_names_the_table_prints():
    from benchmarks.validate import Spec, cells

    assert cells("tiny-llama/cold/P1, tiny-kimi/conversation/P4") == [
        Spec("tiny-llama", "cold", 1), Spec("tiny-kimi", "conversation", 4)]
    for bad in ("tiny-llama/cold", "tiny-llama/cold/P3", "tiny-gpt/cold/P1", "tiny-llama/x/P1"):
        with pytest.raises(SystemExit, match="is not a cell"):
            cells(bad)


def test_a_recorded_validation_prints_again_with_its_notes_worked_out_anew(tmp_path, capsys):
    from benchmarks.validate import main

    record = Path(__file__).parents[2] / "docs" / "results" / "validate-quick.json"
    out = tmp_path / "again.json"
    main(["--table", str(record), "--json", str(out)])
    printed = capsys.readouterr().out
    again, before = json.loads(out.read_text()), json.loads(record.read_text())
    assert [r["cell"] for r in again["rows"]] == [r["cell"] for r in before["rows"]]
    assert [r["measured_tok_s"] for r in again["rows"]] == \
        [r["measured_tok_s"] for r in before["rows"]]
    assert again["rows"][0]["cell"] in printed and "cells within the goal" in printed
    bad = tmp_path / "bad.json"
    bad.write_text('{"rows": [{"cell": "x"}]}')
    with pytest.raises(SystemExit, match="not a validation record"):
        main(["--table", str(bad)])
