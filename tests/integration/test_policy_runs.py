"""Issue 10: a policy given with --policy is the one every rank calls."""

import pytest

pytestmark = pytest.mark.slow

SMALL = ["--executor", "sim", "--workload", "seeded", "--prompt-tokens", "1024",
         "--requests", "8", "--concurrency", "4", "--block-size", "32",
         "--budget", "512", "--min-budget", "64", "--time-scale", "0.1"]  # fmt: skip


def test_policy_from_outside_the_package_runs_on_every_rank(run_wavepp, tmp_path, monkeypatch):
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("WAVEPP_COUNT_FILE", str(calls))
    record, _ = run_wavepp(4, *SMALL, "--policy", "examples.policies.counting:POLICY",
                           "--eviction", "lru")  # fmt: skip
    ranks = calls.read_text().split()
    assert set(ranks) == {"0", "1", "2", "3"}  # materialize ran through it on every stage
    assert record["policy"]["name"] == "counting"
    assert record["policy"]["materialize"].endswith("counting_materialize")
    assert all(leak["balanced"] for leak in record["leak_check"])


def test_an_unknown_policy_is_refused_with_its_name(tmp_path):
    from tests.helpers.run import TORCHRUN, run_plain

    proc = run_plain([*TORCHRUN, "--nproc-per-node=1", "-m", "wavepp.main", *SMALL,
                      "--policy", "examples.policies.nope:POLICY"])  # fmt: skip
    assert proc.returncode != 0
    assert "examples.policies.nope" in proc.stderr
