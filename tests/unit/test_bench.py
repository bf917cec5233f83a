import json

from wavepp.bench.matrix import main as matrix_main
from wavepp.bench.matrix import preset_cells, tables
from wavepp.bench.plot import plot_results


def fake_rows():
    rows = []
    for c in (8, 32):
        for rung, t in (("R1", 100.0), ("R4", 150.0), ("oracle", 160.0)):
            rows.append({
                "preset": "smoke", "workload": "seeded", "workload_label": "seeded-8k",
                "concurrency": c, "rung": rung, "throughput_tok_s": t * c,
                "completion_p50_s": 0.5, "simulated": True,
                "cell_key": f"smoke|seeded-8k|{c}|{rung}",
                "completion_times_s": [0.1, 0.2, 0.4],
            })  # fmt: skip
    return rows


def test_tables_show_deltas_against_r1_and_the_oracle():
    text = tables(fake_rows(), "smoke")
    assert "seeded-8k (SIMULATED)" in text
    assert "4,800 [ +50.0%|  -6.2%]" in text  # R4 at c=32: +50% over R1, -6.25% vs oracle


def test_plots_are_written(tmp_path):
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in fake_rows()))
    paths = plot_results(results, tmp_path / "plots")
    assert {p.name for p in paths} == {
        "throughput_seeded-8k.png", "ladder_seeded-8k.png", "completion_cdf_seeded-8k.png"
    }  # fmt: skip
    assert all(p.stat().st_size > 5000 for p in paths)


def test_matrix_resumes_from_its_results_file(tmp_path, capsys):
    ranks, cells = preset_cells("smoke")
    assert ranks == 4 and len(cells) == 18
    done = {"cell_key": cells[0].key("smoke"), "workload_label": cells[0].workload}
    out = tmp_path / "results.jsonl"
    out.write_text(json.dumps(done) + "\n")
    matrix_main(["--preset", "smoke", "--out", str(out), "--dry-run"])
    text = capsys.readouterr().out
    assert "18 cells, 1 already in" in text and "17 to run" in text
