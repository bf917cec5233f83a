"""Real multi-process runs of the runtime on the simulated executor."""

import json
from pathlib import Path

import pytest

from tests.helpers.run import torchrun

pytestmark = pytest.mark.slow
TRACE = Path(__file__).resolve().parents[2] / "data" / "mooncake" / "synthetic_trace.jsonl"

SMALL = ["--executor", "sim", "--prompt-tokens", "2048", "--suffix-tokens", "512",
         "--budget", "1024", "--min-budget", "128", "--block-size", "32"]  # fmt: skip


def check_clean(record: dict, stages: int) -> None:
    assert record["simulated"] is True
    assert record["stages"] == stages and len(record["stage_utilization"]) == stages
    for leak in record["leak_check"]:
        assert leak["balanced"], leak
        assert leak["leases"] == leak["escrowed"] == leak["referenced"] == leak["pending"] == 0
        assert leak["cached"] + leak["free"] == leak["capacity"]
    pools = [leak["capacity"] for leak in record["leak_check"]]
    assert record["config"]["capacity_blocks"] == pools
    assert record["failed_requests"] == 0
    assert all(0.0 < u <= 1.0 for u in record["stage_utilization"])


def test_p2_short_suffix_reuses_every_prompt(run_wavepp):
    record, stdout = run_wavepp(2, *SMALL, "--workload", "short-suffix", "--requests", "24",
                                "--concurrency", "8", "--rung", "R4",
                                "--capacity-blocks", "4096,5120")  # fmt: skip
    assert [leak["capacity"] for leak in record["leak_check"]] == [4096, 5120]
    check_clean(record, 2)
    assert "SIMULATED" in stdout
    assert record["good_hit_rate"] == 1.0  # a pool of 4,096 blocks keeps every prompt
    # Each request extends a 2,048-token prompt by 512: 80% of its tokens come from cache.
    assert record["reused_share"] == pytest.approx(2048 / 2560)
    assert all(r["cached_tokens"] == 2048 for r in record["requests"])
    assert record["throughput_tok_s"] > 0 and record["admission_rounds"] >= 1


def test_p4_rungs_finish_clean(run_wavepp):
    results = {}
    # R3's rounds and waves go over Gloo, the others' over Unix sockets (the default on
    # one host)
    for rung, plane in (("R1", "auto"), ("R3", "gloo"), ("oracle", "auto")):
        record, _ = run_wavepp(4, *SMALL, "--workload", "seeded", "--requests", "16",
                               "--concurrency", "8", "--rung", rung, "--rounds-plane", plane,
                               "--data-plane", plane)  # fmt: skip
        check_clean(record, 4)
        assert record["rung"] == rung
        assert record["config"]["rounds_plane"] == ("gloo" if plane == "gloo" else "local")
        assert record["config"]["data_plane"] == record["config"]["rounds_plane"]
        assert record["good_hit_rate"] == 1.0
        results[rung] = record
    # Pools from device memory (Qwen3-Next-80B on H200): the end stages hold the
    # embeddings and the LM head, so their pools are smaller; the oracle, whose rank 0
    # decides for every stage, gives every stage the smallest.
    pools = results["R3"]["config"]["capacity_blocks"]
    assert results["R3"]["pools_from"] == "device memory"
    assert pools[0] == pools[3] < pools[1] == pools[2]
    assert results["oracle"]["config"]["capacity_blocks"] == [pools[0]] * 4
    for record in results.values():
        assert set(record["admission_counters"]) == {"disagreements", "rollbacks", "fallbacks"}
    # R1 admits on the execution path, one request per round (4 seeds + 16 requests).
    assert results["R1"]["admission_rounds"] >= 16 + 4
    # The others batch: fewer rounds than requests.
    assert results["R3"]["admission_rounds"] < 16 + 4


def test_custom_planner_and_probe_by_dotted_path(run_wavepp):
    record, _ = run_wavepp(2, *SMALL, "--workload", "cold", "--requests", "6",
                           "--concurrency", "3", "--rung", "R3",
                           "--planner", "tests.integration.custom:tiny_waves",
                           "--probe", "tests.integration.custom:never_reuse")  # fmt: skip
    check_clean(record, 2)
    assert record["config"]["planner"] == "tests.integration.custom:tiny_waves"
    assert record["reused_share"] == 0.0
    assert record["probe_p50_us"] is not None


def test_trace_replay_reports_good_hit_rate(run_wavepp):
    record, _ = run_wavepp(2, "--executor", "sim", "--workload", "trace", "--trace", str(TRACE),
                           "--requests", "120", "--concurrency", "16", "--time-scale", "0.05",
                           "--rung", "R4")  # fmt: skip
    check_clean(record, 2)
    assert record["measured_requests"] == 120
    assert record["good_hit_rate"] is not None and 0.0 <= record["good_hit_rate"] <= 1.0


def test_one_stage_run(run_wavepp):
    record, _ = run_wavepp(1, *SMALL, "--workload", "mixed", "--requests", "8",
                           "--concurrency", "4", "--rung", "R2")  # fmt: skip
    check_clean(record, 1)


def test_measurement_begins_when_every_stage_is_ready(tmp_path):
    """Rank 0 admits nothing before every stage is built: the slow stage's start-up is
    not inside the measured phase (nor in its first round's latency)."""
    out = tmp_path / "run.json"
    options = ["--executor", "sim", "--workload", "cold", "--requests", "4", "--no-progress"]
    torchrun(2, ["tests/integration/ready_script.py", str(out), *options, "--json", str(out)])
    ready = float((tmp_path / "ready-1").read_text())
    assert float((tmp_path / "measure-start").read_text()) > ready
    assert json.loads(out.read_text())["measured_requests"] == 4


def test_a_lone_prompt_is_planned_in_equal_time_chunks(run_wavepp):
    """c = 1 at P = 2: static (R3) plans the prompt in budget-sized chunks; the cost
    planner (R5), the request alone in the pipeline, in more chunks of equal time."""
    options = ("--executor", "sim", "--workload", "cold", "--prompt-tokens", "32768",
               "--requests", "1", "--concurrency", "1", "--budget", "8192",
               "--time-scale", "0.1")  # fmt: skip
    waves = {}
    for rung in ("R3", "R5"):
        record, _ = run_wavepp(2, *options, "--rung", rung)
        check_clean(record, 2)
        assert record["measured_requests"] == 1
        waves[rung] = record["stage_waves"]
    assert waves["R3"] == [4, 4]
    assert waves["R5"][0] == waves["R5"][1] > 4


def test_tensor_parallel_stages_over_a_named_link(run_wavepp):
    # Two stages of two simulated devices each, activations over InfiniBand: the run
    # finishes clean and its record and table say how the stages were laid out.
    record, stdout = run_wavepp(2, *SMALL, "--workload", "cold", "--requests", "8",
                                "--concurrency", "4", "--sim-tp", "2",
                                "--sim-link", "ib-ndr")  # fmt: skip
    check_clean(record, 2)
    assert (record["config"]["sim_tp"], record["config"]["sim_link"]) == (2, "ib-ndr")
    assert "SIMULATED" in stdout and "(TP 2 per stage)" in stdout
