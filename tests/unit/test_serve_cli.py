"""``python -m wavepp.serve``'s command line: help and refused options (no torch run)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from wavepp.serve.__main__ import main


def test_help_lists_the_server_and_the_run_options():
    proc = subprocess.run([sys.executable, "-m", "wavepp.serve", "--help"], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for option in ("--host", "--port", "--max-body-bytes", "--max-in-flight", "--tokenizer",
                   "--capacity-blocks", "--rung", "--model"):  # fmt: skip
        assert option in proc.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "70000"], "--port must be in 0..65535, got 70000"),
        (["--max-body-bytes", "10"], "--max-body-bytes must be ≥ 64, got 10"),
        (["--max-in-flight", "-1"], "--max-in-flight must be ≥ 0, got -1"),
        (["--tokenizer", "/nonexistent/tokenizer.json"], "no such file"),
    ],
)
def test_bad_server_options_say_why(argv, message):
    with pytest.raises(SystemExit, match=message.replace(".", r"\.")):
        main(argv)


def test_a_sim_server_labels_its_answers_simulated():
    from wavepp.serve.__main__ import check

    assert check(["--executor", "sim", "--model", "llama3-70b"])[0].simulated
    assert not check(["--executor", "torch"])[0].simulated
