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


def test_a_config_file_carries_the_servers_own_options_beside_the_run_options(tmp_path):
    from wavepp.serve.__main__ import check

    run = tmp_path / "serve.toml"
    run.write_text('max_in_flight = 8\ndrain_timeout_s = 5\nserved_model_name = "m"\nport = 8123\n'
                   'executor = "sim"\nmodel = "llama3-70b"\n')  # fmt: skip
    options, config, args = check(["--config", str(run)])
    assert (options.max_in_flight, options.drain_timeout_s, options.model_name) == (8, 5.0, "m")
    assert args.port == 8123 and config.model == "llama3-70b"
    options, _, args = check(["--config", str(run), "--max-in-flight", "2"])
    assert options.max_in_flight == 2  # the command line over the file, as for run options


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max_in_flight = 'eight'\n", "option 'max_in_flight' must be an integer"),
        ("max_in_flight = 1.5\n", "must be an integer"),
        ("drain_timeout_s = true\n", "option 'drain_timeout_s' must be a number"),
        ("max_in_flight = -1\n", "--max-in-flight must be ≥ 0, got -1"),
        ("no_such_option = 1\n", "unknown option 'no_such_option'"),
    ],
)
def test_a_bad_server_option_in_a_config_file_says_which(tmp_path, text, message):
    from wavepp.serve.__main__ import check

    run = tmp_path / "serve.toml"
    run.write_text(text)
    with pytest.raises(SystemExit, match=message):
        check(["--config", str(run), "--executor", "sim", "--model", "llama3-70b"])


@pytest.mark.parametrize("host", ["192.0.2.1", "no-such-host.invalid"])  # TEST-NET-1: not ours
def test_a_host_that_is_not_this_machines_is_one_line_before_any_rank(host):
    from wavepp.serve.__main__ import check

    with pytest.raises(SystemExit, match=f"--host {host}: not an address this machine"):
        check(["--host", host, "--executor", "sim", "--model", "llama3-70b"])
