import json
import os
import shutil

import pytest

from benchmarks.matrix import cell_summaries, expand, preset_cells, tables
from benchmarks.matrix import main as matrix_main
from benchmarks.plot import plot_results


def fake_rows():
    rows = []
    for c in (8, 32):
        for rung, planner, t in (("R1", "static", 100.0), ("R3", "static", 140.0),
                                 ("R4", "mpu", 150.0), ("R5", "cost", 151.0),
                                 ("oracle", "mpu", 160.0), ("oracle", "static", 150.0),
                                 ("oracle", "cost", 170.0)):  # fmt: skip
            for repeat, jitter in enumerate((1.0, 1.02, 0.97)):
                rows.append({
                    "preset": "smoke", "workload": "seeded", "workload_label": "seeded-8k",
                    "concurrency": c, "rung": rung, "planner": planner, "repeat": repeat,
                    "throughput_tok_s": t * c * jitter, "completion_p50_s": 0.5,
                    "simulated": True, "good_hit_rate": 1.0,
                    "cell_key": f"smoke|seeded-8k|{c}|{rung}|{planner}|#{repeat}",
                    "completion_times_s": [0.1, 0.2, 0.4],
                })  # fmt: skip
    return rows


def test_the_oracle_is_the_best_planner_and_medians_are_used():
    cell = cell_summaries(fake_rows())[("seeded-8k", 32)]
    assert cell["oracle"].planner == "cost" and cell["oracle"].throughput == 170.0 * 32
    assert cell["oracle[mpu]"].throughput == 160.0 * 32  # the median of 1.0, 1.02, 0.97
    assert cell["R4"].runs == 3 and round(cell["R4"].spread, 3) == 0.05


def test_tables_show_medians_spread_and_deltas_against_the_true_oracle():
    text = tables(fake_rows(), "smoke")
    assert "seeded-8k (SIMULATED)" in text and "3 runs" in text
    # R4 at c=32: 4,800 median, +50% over R1, -11.8% against oracle[cost] (5,440)
    assert "4,800 ± 5.0% [ +50.0%| -11.8%]" in text
    assert "oracle = oracle[cost] (per planner: cost 5,440, mpu 5,120, static 4,800)" in text
    # R5 +0.7% over R4; 151/170 of the oracle; R4 at 150/160 of oracle[mpu]
    assert "seeded-8k c=32: R5 +0.7% ok | R5/oracle 88.8% FAIL | R4/oracle[mpu] 93.8% FAIL" in text


def test_plots_are_written(tmp_path):
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in fake_rows()))
    paths = plot_results(results, tmp_path / "plots")
    assert {p.name for p in paths} == {
        "throughput_seeded-8k.png", "ladder_seeded-8k.png", "completion_cdf_seeded-8k.png"
    }  # fmt: skip
    assert all(p.stat().st_size > 5000 for p in paths)


def test_the_oracle_runs_once_per_planner_and_repeats_multiply_the_runs():
    ranks, cells = preset_cells("smoke")
    assert ranks == 4 and len(cells) == 3 * (5 + 3)
    oracles = [c for c in cells if c.rung == "oracle" and c.workload == "cold-8k"]
    assert sorted(c.planner for c in oracles) == ["cost", "mpu", "static"]
    runs = expand(cells, 3)
    assert len(runs) == 72 and len({c.key("smoke") for c in runs}) == 72
    assert runs[0].key("smoke") == cells[0].key("smoke")  # repeat 0 keeps the old key


def test_matrix_resumes_from_its_results_file(tmp_path, capsys):
    _, cells = preset_cells("smoke")
    done = {"cell_key": cells[0].key("smoke"), "workload_label": cells[0].workload}
    out = tmp_path / "results.jsonl"
    out.write_text(json.dumps(done) + "\n")
    matrix_main(["--preset", "smoke", "--out", str(out), "--dry-run", "--repeat", "2"])
    text = capsys.readouterr().out
    assert "48 runs, 1 already in" in text and "47 to run" in text
    assert "oracle --planner cost #1" in text


def test_dry_run_names_each_cells_own_rank_count(tmp_path, capsys):
    # paper-cells: the Kimi-class cells run at P = 8, the others at the preset's 4
    matrix_main(["--preset", "paper-cells", "--out", str(tmp_path / "r.jsonl"), "--dry-run",
                 "--only", "reuse-131k", "--rungs", "R3"])  # fmt: skip
    text = capsys.readouterr().out
    assert "to run on 8 ranks" in text and "R3 #0 on 8 ranks:" in text
    matrix_main(["--preset", "paper-cells", "--out", str(tmp_path / "r.jsonl"), "--dry-run",
                 "--rungs", "R3"])  # fmt: skip
    assert "to run on 4 or 8 ranks" in capsys.readouterr().out


def test_retention_traces_arrive_at_their_rate_and_reuse_documents(tmp_path):
    from benchmarks.matrix import retention_cells, retention_trace
    from wavepp.workload import trace

    path = retention_trace(tmp_path / "r.jsonl", rate=10.0, requests=200)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    span = rows[-1]["timestamp"] / 1000
    assert 200 / span == pytest.approx(10.0, rel=0.2)
    specs = trace(path, None, 0, 64, open_loop=True)
    firsts = {tuple(r["hash_ids"][:64]) for r in rows}
    assert sum(1 for s in specs if s.expected_reuse) == 200 - len(firsts)
    assert all(s.expected_reuse in (0, 64 * 512) for s in specs)
    cells = retention_cells(tmp_path)
    assert {c.rung for c in cells} == {"R1", "R4"} and all(c.ranks == 8 for c in cells)


def test_scaling_model_bounds():
    from benchmarks.scaling import model_bounds

    one = model_bounds("qwen3-next-80b", "h200", 1, 131_072, 16_384, 8192)
    four = model_bounds("qwen3-next-80b", "h200", 4, 131_072, 16_384, 8192)
    assert one[0] == 1.0 and four[0] == pytest.approx(1.0, abs=1e-4)  # 12 + 12 + 12 + 12
    assert 0.25 < four[1] / one[1] < 0.4  # fill and drain of 16 chunks, the last dearest
    assert model_bounds("kimi-k3-class", "gb300", 4, 131_072, 16_384, 8192)[0] < 0.96
    # the cost planner's equal-time chunks for a prompt alone drain sooner than static's
    for model, device in (("qwen3-next-80b", "h200"), ("kimi-k3-class", "gb300")):
        one = model_bounds(model, device, 1, 131_072, 16_384, 8192, planner="cost")[1]
        four = model_bounds(model, device, 4, 131_072, 16_384, 8192, planner="cost")[1]
        static = model_bounds(model, device, 4, 131_072, 16_384, 8192)[1]
        assert four < 0.9 * static and four / one < 0.3


def test_layers_split_by_cost_balance_the_stages_at_least_as_well_as_by_count():
    from benchmarks.scaling import balanced_split, model_bounds

    counts = balanced_split("kimi-k3-class", "gb300", 2, 131_072, 16_384)
    assert sum(counts) == 61 and counts != [31, 30]
    by_cost = model_bounds("kimi-k3-class", "gb300", 2, 131_072, 16_384, 8192, counts)[0]
    by_count = model_bounds("kimi-k3-class", "gb300", 2, 131_072, 16_384, 8192)[0]
    assert by_cost > by_count
    # 15 MLA layers cannot split evenly over 4 contiguous stages: the count split is best
    assert balanced_split("kimi-k3-class", "gb300", 4, 131_072, 16_384) == [16, 15, 15, 15]


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                    reason="the --compile rows need a C++ compiler on CPU")  # fmt: skip
@pytest.mark.timeout(600)
def test_torch_exec_bench_rows(tmp_path):
    """Every kind of row of ``python -m benchmarks.torch_exec`` on a tiny model: the
    sweep against transformers, block table against copying, --compile against eager;
    WavePP's attention kernel against PyTorch's; the rows-only last layer against the
    full one; each with its logits matching."""
    from benchmarks.torch_exec import main as torch_exec_main

    out = tmp_path / "rows.json"
    torch_exec_main(["--model", "tiny-llama", "--lengths", "128", "--attention-lengths", "128",
                     "--compile-lengths", "128", "--kernel-lengths", "128", "--repeats", "1",
                     "--last-layer-lengths", "128", "--threads", "1",
                     "--json", str(out)])  # fmt: skip
    record = json.loads(out.read_text())
    kinds = ("sweep", "attention", "compile", "kernel", "last_layer")
    rows = [r for k in kinds for r in record[k]]
    assert [len(record[k]) for k in kinds] == [2, 1, 2, 2, 2]
    assert all(r["max_abs_logit_diff"] < 1e-4 for r in rows), rows
    assert {r["cached"] for r in record["compile"]} == {0, 112}
    assert all(r["compiled_tok_s"] > 0 and r["eager_tok_s"] > 0 for r in record["compile"])
    from wavepp.model import cpu_kernel

    if cpu_kernel.available():  # the kernel alone: fp32 and each bf16 path
        gflops = record["kernel_gflops"]
        assert [r["cached"] for r in gflops] == [0, 112]
        paths = [p for p in cpu_kernel.BF16_PATHS if cpu_kernel._has(p)]
        for r in gflops:
            assert r["fp32_gflop_s"] > 0 and all(r[f"bf16_{p}_gflop_s"] > 0 for p in paths)


def test_short_waves_profiles_a_wave(tmp_path):
    from benchmarks.short_waves import main as short_waves_main

    out = tmp_path / "sw.json"
    short_waves_main(["--model", "tiny-llama", "--shapes", "3x8x40", "--repeats", "1",
                      "--threads", "1", "--json", str(out)])  # fmt: skip
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["chunks"], row["tokens"], row["prefix"]) == (3, 8, 40)
    assert row["new_tok_s"] > 0 and abs(sum(row["shares"].values()) - 1.0) < 1e-6
    assert "matrix products" in row["shares"] and row["top_ops"]
