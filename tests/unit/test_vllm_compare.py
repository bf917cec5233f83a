"""The pure parts of ``benchmarks.vllm_compare``: the FLOP count, the rows' prompts, the
settings rule, the summary's arithmetic and the record's required fields. No engine
starts here."""

from __future__ import annotations

import os

import pytest

from benchmarks._compare_rows import (
    MODELS,
    ROWS,
    TUNE_ROWS,
    ModelShape,
    Row,
    prefill_flops,
    prompts,
    row_flops,
)
from benchmarks._compare_summary import (
    REQUIRED,
    choose_setting,
    first_token_differences,
    missing_fields,
    peak_flops,
    summarize,
)
from benchmarks._stats import ratio_of_means_interval

TINY = ModelShape(num_layers=2, d_model=4, num_heads=2, num_kv_heads=1, head_dim=2, d_mlp=8,
                  vocab=10, seed=0)  # fmt: skip


def test_prefill_flops_match_a_hand_count():
    # per token and layer: k, v 2*4*2 each = 32; q, o 2*4*4 each = 64; MLP 3 * 2*4*8 = 192
    per_token = 32 + 64 + 192
    # 3 cached, 2 new: the new tokens attend to 4 and 5 keys (9 pairs), QK and PV over 4
    # query dims at 2 FLOPs a multiply-add: 16 a pair
    layer = 2 * per_token + 16 * 9
    head = 2 * 4 * 10  # one row of logits
    assert prefill_flops(TINY, 3, 2) == 2 * layer + head == 1520
    # rows-only last layer: keys and values for both tokens, the rest for the last one,
    # which attends to all 5 keys
    last = 2 * 32 + (per_token - 32) + 16 * 5
    assert prefill_flops(TINY, 3, 2, full_last_layer=False) == layer + last + head == 1200
    assert prefill_flops(TINY, 5, 0) == 0.0  # nothing new, nothing computed


def test_prefill_flops_of_the_deep_model_are_twice_its_weights_plus_attention():
    deep = MODELS["llama-24l"]
    per_layer = 896 * (896 + 128 + 128 + 896) + 3 * 896 * 4864  # its weights, no norms
    head = 2 * 896 * 32_000
    # one token, nothing cached: twice the weights, attention to itself, one head row
    assert prefill_flops(deep, 0, 1) == 24 * (2 * per_layer + 4 * 896) + head
    # a 4,096-token prompt: attention adds 4 * 896 FLOPs per (token, key) pair
    assert prefill_flops(deep, 0, 4096) == pytest.approx(
        24 * (4096 * 2 * per_layer + 4 * 896 * 4096 * 4097 / 2) + head)  # fmt: skip
    # a call's FLOPs follow what each engine found cached
    assert row_flops(deep, [4096, 4096], [0, 2048]) == prefill_flops(deep, 0, 4096) + \
        prefill_flops(deep, 2048, 2048)  # fmt: skip


def test_rows_give_both_engines_the_same_prompts_with_seeds_and_a_warmup_of_the_row():
    row = Row(num_prompts=8, num_tokens=64, shared=0.75, num_prefixes=2, seed=3)
    job = prompts(row, 1000)
    assert job == prompts(row, 1000)  # the same lists every repeat
    assert [len(s) for s in job.seeds] == [48, 48]
    assert len(job.warmup) == 2 and len(job.measured) == 8
    assert all(len(p) == 64 for p in job.warmup + job.measured)
    assert all(p[:48] == job.seeds[i % 2] for i, p in enumerate(job.measured))
    assert all(p[:48] == job.seeds[i % 2] for i, p in enumerate(job.warmup))
    assert not {tuple(p[48:]) for p in job.warmup} & {tuple(p[48:]) for p in job.measured}
    cold = prompts(Row(num_prompts=3, num_tokens=32, seed=1), 1000)
    assert cold.seeds == [] and len(cold.warmup) == 1 and len(cold.measured) == 3
    assert cold.warmup[0] not in cold.measured
    assert all(3 <= t < 1000 for p in cold.measured for t in p)


def test_the_protocols_rows_are_fixed():
    for model in MODELS:
        rows = ROWS[model]
        assert list(rows) == ["cold-4k", "cold-16k", "shared-8k", "short-suffix"]
        assert (rows["cold-4k"].num_tokens, rows["cold-16k"].num_tokens) == (4096, 16_384)
        assert rows["shared-8k"].shared == 0.9 and rows["shared-8k"].num_tokens == 8192
        assert rows["short-suffix"].num_tokens - rows["short-suffix"].prefix_len == 256
        assert TUNE_ROWS[model] not in rows.values()  # settings never tuned on a measured row
    deep = MODELS["llama-24l"]
    assert (deep.num_layers, deep.d_model, deep.num_heads, deep.num_kv_heads, deep.d_mlp) == (
        24, 896, 14, 2, 4864)  # fmt: skip


def test_the_settings_rule_takes_the_highest_mean_and_a_tie_goes_to_the_first_listed():
    trials = [{"setting": "default", "tok_s": [100, 110]},
              {"setting": "b", "tok_s": [90, 140]},
              {"setting": "c", "tok_s": [115, 100]}]  # fmt: skip
    assert choose_setting(trials) == "b"  # mean 115 against 105 and 107.5
    tie = [{"setting": "default", "tok_s": [100]}, {"setting": "other", "tok_s": [100]}]
    assert choose_setting(tie) == "default"
    with pytest.raises(ValueError):
        choose_setting([])


def test_the_peak_is_the_highest_probe_at_the_rows_dtype_and_threads():
    peaks = [{"rows": [{"dtype": "float32", "threads": 2, "flops": 100.0},
                       {"dtype": "float32", "threads": 1, "flops": 60.0},
                       {"dtype": "bfloat16", "threads": 2, "flops": 300.0}]},
             {"rows": [{"dtype": "float32", "threads": 2, "flops": 120.0}]}]  # fmt: skip
    assert peak_flops(peaks, "float32", 2) == 120.0
    assert peak_flops(peaks, "bfloat16", 2) == 300.0
    assert peak_flops(peaks, "bfloat16", 1) is None


def _run(rep: int, vllm: float, p1: float, p2: float, rows: float | None = None) -> dict:
    def got(tok_s: float) -> dict:  # 1,000 tokens a call, 1e9 FLOPs
        return {"tok_s": tok_s, "seconds": 1000 / tok_s, "flops": 1e9}

    systems = {"vllm": got(vllm), "wavepp_p1": got(p1), "wavepp_p2": got(p2)}
    if rows is not None:
        systems["wavepp_p1_rows"] = got(rows)
    return {"model": "m", "dtype": "float32", "row": "r", "repeat": rep, "systems": systems}


def test_the_summary_is_the_ratio_of_means_with_its_paired_interval_per_p():
    runs = [_run(0, 100, 90, 80, 120), _run(1, 200, 220, 150, 260), _run(2, 50, 40, 60, 70)]
    peaks = [{"rows": [{"dtype": "float32", "threads": 2, "flops": 1e8}]}]
    (s,) = summarize(runs, cores=2, peaks=peaks)
    p1, p2, rows = (s["systems"][k] for k in ("wavepp_p1", "wavepp_p2", "wavepp_p1_rows"))
    assert p1["over_vllm"] == pytest.approx(350 / 350)
    assert p2["over_vllm"] == pytest.approx(290 / 350)
    assert p1["over_vllm_interval"] == ratio_of_means_interval([90, 220, 40], [100, 200, 50])
    assert p1["over_vllm_range"] == pytest.approx([0.8, 1.1])
    assert rows["over_vllm"] == pytest.approx(450 / 350)  # reported, apart from P = 1
    vllm = s["systems"]["vllm"]
    assert vllm["tok_s"] == pytest.approx(350 / 3)
    assert vllm["tok_s_per_core"] == pytest.approx(350 / 6)
    # FLOP/s: each call's 1e9 FLOPs over its seconds, averaged; against a 1e8 peak
    assert vllm["flops_per_s"] == pytest.approx(1e6 * 350 / 3)
    assert vllm["peak_fraction"] == pytest.approx(vllm["flops_per_s"] / 1e8)
    (one,) = summarize(runs[:1], cores=2, peaks=[])
    assert one["systems"]["wavepp_p1"]["over_vllm_interval"] is None  # one pair: no interval
    assert one["systems"]["vllm"]["peak_fraction"] is None and one["peak_flops"] is None


def test_first_tokens_that_differ_are_counted_with_vllms_margin():
    firsts = {"vllm": [5, 6, 7, 8], "wavepp_p1": [5, 9, 7, 8], "wavepp_p2": [1, 9, 7, 8]}
    differ = first_token_differences(firsts, [2.0, 0.01, 1.5, None])
    assert differ["wavepp_p1"] == {"count": 1, "of": 4, "vllm_top2_gaps": [0.01]}
    assert differ["wavepp_p2"] == {"count": 2, "of": 4, "vllm_top2_gaps": [2.0, 0.01]}
    runs = [_run(0, 1, 1, 1), _run(1, 1, 1, 1)]
    runs[0]["first_tokens_differ"] = differ
    runs[1]["first_tokens_differ"] = first_token_differences(firsts, [0.0] * 4)
    runs[1]["first_tokens_differ"]["wavepp_p1"]["count"] = 3
    (s,) = summarize(runs, cores=1, peaks=[])
    assert s["first_tokens_differ"] == {"wavepp_p1": 3, "wavepp_p2": 2}  # the most over repeats


def test_a_record_must_name_versions_backends_threads_pinning_and_settings():
    full: dict = {}
    for path in REQUIRED:
        node = full
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = None  # "not known here" is an answer
    assert missing_fields(full) == []
    del full["vllm"]["attention_isa"]
    full.pop("git_commit")
    assert missing_fields(full) == ["git_commit", "vllm.attention_isa"]
    assert {"versions.vllm", "wavepp.isa", "vllm.pinning", "wavepp.threads"} <= set(REQUIRED)


def test_the_driver_refuses_fewer_than_five_repeats_and_runs_only_paired():
    from benchmarks.vllm_compare import main

    with pytest.raises(SystemExit):
        main(["--vllm-python", "/nonexistent/python", "--repeats", "3"])
    env = {k: v for k, v in os.environ.items() if k != "WAVEPP_VLLM_PYTHON"}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "environ", env)
        with pytest.raises(SystemExit):
            main(["--models", "llama-4l"])


def test_the_peak_probe_records_each_dtype_and_thread_count(monkeypatch):
    import benchmarks.peak as peak

    monkeypatch.setattr(peak, "SHAPES", {"small": (64, 32, 48), "square": (64, 64, 64)})
    record = peak.measure([1], ["float32", "bfloat16"], warmup=0, repeats=2)
    assert [(r["dtype"], r["threads"]) for r in record["rows"]] == [("float32", 1),
                                                                     ("bfloat16", 1)]
    for row in record["rows"]:
        assert set(row["by_shape"]) == {"small", "square"}
        assert row["flops"] == max(row["by_shape"].values()) > 0
        assert row["best_shape"] in row["by_shape"]
        assert row["flops_per_core"] == row["flops"]  # one thread
        assert "cpu_steal_share" in row
    assert record["cores"] >= 1 and record["cpu_capability"]


def test_a_smoke_row_is_cut_down_and_keeps_its_shape():
    from benchmarks.vllm_compare import smoke_row

    row = smoke_row(ROWS["llama-4l"]["short-suffix"])
    assert (row.num_prompts, row.num_tokens, row.shared, row.num_prefixes) == (4, 256, 0.9375, 4)


def test_a_record_names_no_path_of_this_machine():
    from types import SimpleNamespace

    from benchmarks.vllm_compare import local_names, preloaded, scrub

    args = SimpleNamespace(vllm_python="/tmp/v/bin/python", models_dir="/tmp/m")
    record = {"preload": preloaded({"iomp": "/tmp/v/lib/libiomp5.so", "tcmalloc": None}),
              "log": ["(EngineCore pid=7) INFO [core.py:133] model='/tmp/m/llama-24l', "
                      "init=file:///tmp/vllm_dist_1 backend=gloo",
                      "saved to /root/.cache/vllm/x/model",
                      "preloaded /tmp/v/lib/libiomp5.so and /usr/lib/x86_64-linux-gnu/libtc.so.4"],
              "tok_s": [1.5]}  # fmt: skip
    out = scrub(record, local_names(args))
    assert out["preload"] == {"iomp": "Intel OpenMP (pip intel-openmp, in vLLM's venv)",
                              "tcmalloc": None}  # fmt: skip
    assert out["log"] == ["(EngineCore pid=7) INFO model='llama-24l', init=<local path> "
                          "backend=gloo", "saved to <local path>",
                          "preloaded <vllm venv> and <system>"]  # fmt: skip
    assert out["tok_s"] == [1.5]


def test_the_log_keeps_the_backend_and_drops_where_vllm_put_files():
    from benchmarks._compare_engines import kept_log_lines

    lines = ["(EngineCore pid=7) INFO 12-07 20:05:54 Using CPU attention backend, ISA amx",
             "(Worker pid=8) INFO world_size=1 rank=0 distributed_init_method=tcp://h:1",
             "(Worker pid=8) INFO [backbone] saved AOT compiled function to /root/.cache/x",
             "(Worker pid=8) INFO Warming up model for the compilation...",
             "(Worker pid=8) INFO Loading weights took 0.2 s"]  # fmt: skip
    assert kept_log_lines(lines) == [lines[0]]
