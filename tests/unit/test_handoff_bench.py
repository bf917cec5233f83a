"""``benchmarks.handoff``'s arithmetic: bandwidth from the wire time, one plain-copy
denominator per length (the busy-core rows' too), medians with their min-max, latency
from the record's stamps."""

from __future__ import annotations

import pytest

from benchmarks.handoff import _row


def test_a_row_divides_each_stages_wire_bandwidth_by_one_plain_copy_median():
    handoffs = [
        {"stages": [{"bytes": 100, "wire_s": w0, "seconds": w0 + 0.5, "ended_at": 10.0},
                    {"bytes": 200, "wire_s": w1, "seconds": w1 + 0.1, "ended_at": 10.2}]}
        for w0, w1 in [(1.0, 1.0), (2.0, 4.0), (4.0, 2.0)]
    ]  # fmt: skip
    copies = [1.0, 0.5, 2.0]  # 100 bytes: 100, 200 and 50 B/s, median 100
    plain_bands = [[(100, 1.0), (200, 2.0)]] * 3
    busy_copies = [2.0, 4.0, 1.0]  # beside a busy core: 50, 25 and 100 B/s
    busy_bands = [[(100, 4.0), (200, 1.0)], [(100, 2.0), (200, 2.0)], [(100, 1.0), (200, 4.0)]]
    alone = [[(100, 0.5), (200, 2.0)], [(100, 1.0), (200, 2.0)], [(100, 2.0), (200, 2.0)]]
    # the same bands into the receiver that declines segments: half the speed
    over_socket = [{"stages": [dict(band, wire_s=2 * band["wire_s"],
                                    seconds=band["seconds"] + band["wire_s"])
                               for band in h["stages"]]} for h in handoffs]  # fmt: skip
    alone_socket = [[(100, 2 * a[0][1]), (200, 2 * a[1][1])] for a in alone]
    row = _row(4096, 2, {"handoff": handoffs, "copy": copies, "plain": plain_bands,
                         "copy busy": busy_copies, "plain busy": busy_bands, "alone": alone,
                         "handoff socket": over_socket, "alone socket": alone_socket},
               100)  # fmt: skip
    assert row["plain_copy"]["gb_s"]["median"] == pytest.approx(100e-9)
    s0, s1 = row["stages"]
    assert s0["gb_s"] == pytest.approx({"median": 50e-9, "min": 25e-9, "max": 100e-9})
    assert s0["ratio"] == pytest.approx({"median": 0.5, "min": 0.25, "max": 1.0})
    assert s1["ratio"] == pytest.approx({"median": 1.0, "min": 0.5, "max": 2.0})
    assert s0["setup_s"]["median"] == pytest.approx(0.5)
    assert s1["plain_sender_library_receiver"]["ratio"]["median"] == pytest.approx(1.0)
    # the busy-core rows divide by the idle copy's median too, not by their own
    halves = {"median": 0.5, "min": 0.25, "max": 1.0}
    assert row["plain_copy_busy_core"]["ratio"] == pytest.approx(halves)
    assert s0["plain_sender_library_receiver_busy_core"]["ratio"] == pytest.approx(halves)
    busy1 = s1["plain_sender_library_receiver_busy_core"]
    assert busy1["gb_s"]["median"] == pytest.approx(100e-9)
    # the stage's sender alone: against the same idle copy
    assert s0["stage_sender_alone"]["ratio"] == pytest.approx({"median": 1.0, "min": 0.5,
                                                               "max": 2.0})  # fmt: skip
    assert s1["stage_sender_alone"]["gb_s"]["median"] == pytest.approx(100e-9)
    # the cache is whole when the later of the two acknowledgements comes
    assert row["latency_s"] == pytest.approx({"median": 4.1, "min": 1.3, "max": 4.3})
    # the rows over the socket: against the same idle copy
    assert s0["socket"]["ratio"] == pytest.approx({"median": 0.25, "min": 0.125, "max": 0.5})
    assert s0["stage_sender_alone_socket"]["ratio"]["median"] == pytest.approx(0.5)
    assert row["latency_socket_s"]["median"] == pytest.approx(8.1)


def test_the_stage_sender_alone_delivers_the_bands_the_plain_sender_does(tmp_path):
    """The row 'its sender alone' is a stage's real HandoffSender into the real
    receiver: every band acknowledged, the same bytes as the plain sender's band."""
    import json

    import anyio.from_thread

    from benchmarks.handoff import RECEIVER, LibraryBands, _child
    from wavepp.model import BUILTIN
    from wavepp.runtime.handoff import model_hf_config

    config = model_hf_config("tiny-llama", BUILTIN["tiny-llama"])
    path = tmp_path / "rx.sock"
    with (_child(RECEIVER, f"unix:{path}", json.dumps(config), "lend"),
          anyio.from_thread.start_blocking_portal() as portal):  # fmt: skip
        bands = LibraryBands(config, 2, 4096, portal)  # 8 MiB a band: a worker thread
        for k in range(2):  # the second time through the same senders
            for stage in range(2):
                plain, _ = bands.send_s(path, f"plain-{k}", stage)
                sent, wire_s = bands.stage_sender_s(path, f"staged-{k}", stage)
                assert sent == plain > 0 and wire_s > 0
        bands.close()


def test_the_throughput_interval_follows_the_pairs_not_the_runs():
    """A paired bootstrap: when every pair's ratio is the same the interval is that
    ratio however much the machine's speed moved between pairs; when the ratios spread,
    the interval holds the ratio of the means and is the same from call to call."""
    from benchmarks._stats import ratio_of_means_interval

    off = [10.0, 30.0, 20.0, 50.0, 15.0]
    low, high = ratio_of_means_interval([0.9 * x for x in off], off)
    assert low == pytest.approx(0.9) and high == pytest.approx(0.9)
    on = [9.0, 33.0, 16.0, 45.0, 15.0]
    low, high = ratio_of_means_interval(on, off)
    assert low < sum(on) / sum(off) < high
    assert low > 0.8 and high < 1.1  # within the pairs' own ratios (0.8-1.1)
    assert (low, high) == ratio_of_means_interval(on, off)
    with pytest.raises(ValueError, match="two or more pairs"):
        ratio_of_means_interval([1.0], [1.0])
    with pytest.raises(ValueError):
        ratio_of_means_interval([1.0, 2.0], [1.0])


@pytest.mark.parametrize(("argv", "names"), [
    (["--lengths", "", "--repeats", "0"], "nothing to measure"),
    (["--lengths", "4k"], "--lengths '4k'"), (["--lengths", "1"], "--lengths [1]"),
    (["--repeats", "-1"], "--repeats -1"), (["--samples", "0"], "--samples 0"),
])  # fmt: skip
def test_the_benchmark_refuses_what_it_cannot_measure(argv, names, capsys):
    from benchmarks.handoff import main

    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    assert names in capsys.readouterr().err


def test_the_throughput_pairs_are_also_given_over_the_pairs_without_cpu_steal(
    monkeypatch, tmp_path,
):  # fmt: skip
    """Each run's CPU steal is recorded; the quiet pairs (neither run lost over 2% of the
    machine to other guests) get their own ratio beside the ratio over all pairs."""
    import contextlib
    import json
    from types import SimpleNamespace

    from benchmarks import handoff as bench

    runs = iter([(100.0, 0.0), (80.0, 0.01),  # off, on: quiet
                 (90.0, 0.1), (100.0, 0.0),  # on, off: the on run lost 10%
                 (50.0, 0.02), (45.0, 0.0)])  # off, on: quiet  # fmt: skip

    def torchrun(stages, args):
        tok_s, steal = next(runs)
        path = args[args.index("--json") + 1]
        with open(path, "w") as f:
            json.dump({"throughput_tok_s": tok_s, "cpu_steal_share": steal,
                       "requests": [{"id": "r"}], "handoff": {"done": 1}}, f)  # fmt: skip

    monkeypatch.setattr(bench, "_torchrun", torchrun)
    monkeypatch.setattr(bench, "_child", lambda *a: contextlib.nullcontext())
    result = bench.throughput(SimpleNamespace(repeats=3), tmp_path)
    assert result["ratios"] == pytest.approx([0.8, 0.9, 0.9])
    assert result["steal_on"] == [0.01, 0.1, 0.0] and result["steal_off"] == [0.0, 0.0, 0.02]
    assert result["quiet_pairs"] == [0, 2]
    assert result["quiet"]["ratios"] == pytest.approx([0.8, 0.9])
    assert result["quiet"]["ratio_of_means"] == pytest.approx(125 / 150)
