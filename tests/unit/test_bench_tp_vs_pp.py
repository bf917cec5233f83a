"""The TP-vs-PP benchmark's cells and table (no runs)."""

import argparse

from benchmarks.tp_vs_pp import LAYOUTS, cells, table


def test_every_layout_uses_eight_devices_in_the_same_cells():
    a = argparse.Namespace(quick=True, models="kimi-k3-class", rung="R4", budget=16384,
                           time_scale=1.0)
    built = cells(a)
    assert len(built) == 3 * 2 * len(LAYOUTS)  # workloads x concurrencies x layouts
    for key, cell in built:
        assert key["stages"] * key["tp"] == 8 and cell.ranks == key["stages"]
        assert cell.args[cell.args.index("--sim-tp") + 1] == str(key["tp"])
        assert cell.args[cell.args.index("--requests") + 1] == str(key["concurrency"])
        if key["stages"] > 1:  # pipelines split their layers by predicted cost
            counts = cell.args[cell.args.index("--layers-per-stage") + 1].split(",")
            assert len(counts) == key["stages"] and sum(map(int, counts)) == 61


def test_the_table_sets_the_simulator_beside_the_paper():
    rows = [
        {"model": "kimi-k3-class", "device": "gb300", "cell": "cold-131k", "concurrency": 32,
         "layout": name, "throughput_tok_s": tput, "completion_p50_s": 10.0}
        for name, tput in (("TP8/EP8", 100_000.0), ("PP8", 150_000.0), ("TP2xPP4", 125_000.0))
    ]  # fmt: skip
    text = table(rows)
    assert "SIMULATED" in text
    assert "+50.0%" in text  # PP8 over TP8/EP8 in the cell
    assert "geomean PP8 over TP8/EP8: +50.0% over 1 cells" in text
    assert "geomean TP2xPP4 over TP8/EP8: +25.0%" in text
    assert "35,878" in text  # the paper's WavePP PP8 figure for the cell
    assert "+26.8%" in text  # the paper's SGLang PP8 over TP8/EP8
