"""The arithmetic of ``benchmarks.vllm_compare``: the settings rule, the per-row summary
(ratio of means with its paired interval, per core, fraction of the GEMM peak), the
record's required fields and the printed table. Pure: no engine is started here."""

from __future__ import annotations

import sys

import numpy as np

from benchmarks._stats import ratio_of_means_interval

# The headline pairs WavePP computing the last layer for every token, as vLLM does;
# the rows-only last layer is WavePP's own feature, reported beside it, never mixed in.
HEADLINE = ("wavepp_p1", "wavepp_p2")
ROWS_ONLY = ("wavepp_p1_rows", "wavepp_p2_rows")
SYSTEMS = ("vllm", *HEADLINE, *ROWS_ONLY)


def choose_setting(trials: list[dict]) -> dict:
    """The settings rule, the same for both engines: of ``trials`` (each ``{"setting":
    ..., "tok_s": [one figure per timed call]}``, in the order they were listed), the
    setting with the highest mean; a tie goes to the one listed first."""
    if not trials:
        raise ValueError("no trials to choose a setting from")
    best = max(range(len(trials)), key=lambda i: (float(np.mean(trials[i]["tok_s"])), -i))
    return trials[best]["setting"]


def peak_flops(peaks: list[dict], dtype: str, threads: int) -> float | None:
    """The GEMM peak a row is judged by: the highest of ``benchmarks.peak``'s records
    (one before the rows, one after) at ``dtype`` and ``threads``; None without one."""
    found = [row["flops"] for record in peaks for row in record.get("rows", [])
             if row["dtype"] == dtype and row["threads"] == threads]  # fmt: skip
    return max(found) if found else None


def first_token_differences(firsts: dict[str, list[int]], gaps: list) -> dict:
    """Per WavePP system: how many prompts' first tokens differ from vLLM's, and at
    those prompts vLLM's gap between its top two logprobs (nats)."""
    out = {}
    for system, tokens in firsts.items():
        if system == "vllm":
            continue
        at = [i for i, (a, b) in enumerate(zip(tokens, firsts["vllm"], strict=True)) if a != b]
        out[system] = {"count": len(at), "of": len(tokens), "vllm_top2_gaps": [gaps[i] for i in at]}
    return out


def summarize(results: list[dict], cores: int, peaks: list[dict]) -> list[dict]:
    """Per (model, dtype, row): each system's mean tok/s over the repeats, tok/s per
    core, FLOP/s and its fraction of the peak at ``cores`` threads; for each WavePP
    system against vLLM, the ratio of means with its paired bootstrap 95% interval
    (None under two repeats) and the range of the per-repeat ratios."""
    out = []
    keys = dict.fromkeys((r["model"], r["dtype"], r["row"]) for r in results)
    for model, dtype, row in keys:
        runs = [r for r in results if (r["model"], r["dtype"], r["row"]) == (model, dtype, row)]
        peak = peak_flops(peaks, dtype, cores)
        entry: dict = {"model": model, "dtype": dtype, "row": row, "repeats": len(runs),
                       "peak_flops": peak, "systems": {}}  # fmt: skip
        for system in SYSTEMS:
            got = [r["systems"][system] for r in runs if system in r["systems"]]
            if not got:
                continue
            tok_s = float(np.mean([g["tok_s"] for g in got]))
            flops = float(np.mean([g["flops"] / g["seconds"] for g in got]))
            entry["systems"][system] = {
                "tok_s": tok_s, "tok_s_per_core": tok_s / cores, "flops_per_s": flops,
                "peak_fraction": flops / peak if peak else None,
                "tok_s_each": [g["tok_s"] for g in got],
            }  # fmt: skip
        pairs = [r for r in runs if "vllm" in r["systems"]]
        for system in (*HEADLINE, *ROWS_ONLY):
            both = [r for r in pairs if system in r["systems"]]
            if not both:
                continue
            on = [r["systems"][system]["tok_s"] for r in both]
            off = [r["systems"]["vllm"]["tok_s"] for r in both]
            each = [a / b for a, b in zip(on, off, strict=True)]
            entry["systems"][system].update({
                "over_vllm": float(np.mean(on) / np.mean(off)),
                "over_vllm_interval": ratio_of_means_interval(on, off) if len(on) >= 2 else None,
                "over_vllm_range": [min(each), max(each)],
            })  # fmt: skip
        differ = [r["first_tokens_differ"] for r in runs if "first_tokens_differ" in r]
        if differ:  # per WavePP system: prompts whose first token is not vLLM's, most
            entry["first_tokens_differ"] = {k: max(d[k]["count"] for d in differ)
                                            for k in differ[0]}  # fmt: skip
        out.append(entry)
    return out


# Every record must say these (dotted paths into the record); the driver checks before
# writing, and a test checks the rule.
REQUIRED = (
    "protocol", "git_commit", "cores", "models", "dtypes", "repeats",
    "versions.wavepp", "versions.torch", "versions.vllm", "versions.vllm_torch",
    "vllm.attention_backend", "vllm.attention_isa", "vllm.threads", "vllm.pinning",
    "vllm.preload", "vllm.settings", "vllm.sweep",
    "wavepp.attention_kernel", "wavepp.isa", "wavepp.threads", "wavepp.pinning",
    "wavepp.settings", "wavepp.sweep", "peak", "results", "summary",
)


def missing_fields(record: dict) -> list[str]:
    """The REQUIRED paths the record lacks (a value of None counts as present: it says
    "not known here" on purpose)."""
    missing = []
    for path in REQUIRED:
        node = record
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                missing.append(path)
                break
            node = node[part]
    return missing


def _ratio(s: dict) -> str:
    if "over_vllm" not in s:
        return "—"
    interval = s["over_vllm_interval"]
    spread = f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else " (1 repeat: no interval)"
    return f"{s['over_vllm']:.2f}{spread}"


def print_table(summary: list[dict], file=sys.stderr) -> None:
    """One line per (row, system): mean tok/s, per core, fraction of peak, ratio to vLLM
    with its interval. The rows-only lines are marked as WavePP's own feature."""
    print(f"{'model':<10} {'dtype':<9} {'row':<13} {'system':<15} {'tok/s':>9} "
          f"{'a core':>8} {'of peak':>8}  over vLLM (ratio of means [95% CI])",
          file=file)  # fmt: skip
    for entry in summary:
        for system, s in entry["systems"].items():
            frac = f"{s['peak_fraction']:.0%}" if s["peak_fraction"] is not None else "—"
            note = "  (rows-only last layer: not like for like)" if system in ROWS_ONLY else ""
            print(f"{entry['model']:<10} {entry['dtype']:<9} {entry['row']:<13} {system:<15} "
                  f"{s['tok_s']:>9,.0f} {s['tok_s_per_core']:>8,.0f} {frac:>8}  "
                  f"{_ratio(s)}{note}", file=file)  # fmt: skip
        if entry.get("first_tokens_differ"):
            print(f"{'':<34} first tokens not vLLM's (most over repeats): "
                  + ", ".join(f"{k} {v}" for k, v in entry["first_tokens_differ"].items()),
                  file=file)  # fmt: skip
