"""The connector's figures as vLLM carries them (``wavepp.vllm.figures``), without vLLM:
one step's observations, two steps' merged, the interval's summary for vLLM's log."""

from __future__ import annotations

import pytest

from wavepp.vllm import figures


def test_a_step_records_loads_errors_refusals_and_releases():
    data = figures.empty()
    assert figures.is_empty(data)
    figures.record_load(data, 0.5, [0.6, 0.7], loaded_bytes=1 << 20, received_bytes=2 << 20)
    figures.record_error(data, "refused")
    data["refusals"].append(1)
    data["released"].append(1)
    assert not figures.is_empty(data)
    assert data["load_seconds"] == [0.5] and data["layer_seconds"] == [0.6, 0.7]
    assert data["gigabytes_per_second"] == [pytest.approx((2 << 20) / 0.5 / 1e9)]
    assert data["load_errors"] == ["refused"]
    with pytest.raises(ValueError, match="reason 'flaky' is not one of"):
        figures.record_error(data, "flaky")


def test_two_steps_merge_in_order_and_summarise():
    first, second = figures.empty(), figures.empty()
    figures.record_load(first, 0.25, [0.3], 1000, 4000)
    figures.record_load(second, 0.75, [0.8], 3000, 4000)
    figures.record_error(second, "timeout")
    merged = figures.merge(first, second)
    assert merged is first and merged["load_seconds"] == [0.25, 0.75]
    assert figures.merge(figures.empty(), {"load_errors": ["auth"]})["load_errors"] == ["auth"]
    summary = figures.summary(merged)
    assert summary["Loads"] == 2 and summary["Load errors"] == 1
    assert summary["Avg load time (ms)"] == 500.0
    assert summary["Throughput (GB/s)"] == round(8000 / 1.0 / 1e9, 3)
    assert summary["MB loaded"] == round(4000 / 2**20, 3)
    assert figures.summary(figures.empty())["Throughput (GB/s)"] == 0


def test_a_load_of_no_measurable_time_has_no_rate():
    data = figures.empty()
    figures.record_load(data, 0.0, [], 10, 10)
    assert data["gigabytes_per_second"] == [0.0]
