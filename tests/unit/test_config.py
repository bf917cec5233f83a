import attrs
import pytest

from wavepp.config import RunConfig, load, parser


def test_help_documents_every_option():
    text = parser().format_help()
    for field in attrs.fields(RunConfig):
        assert "--" + field.name.replace("_", "-") in text


def test_toml_then_command_line(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('workload = "cold"\nrequests = 7\nrung = "R2"\nprogress = false\n')
    config = load(["--config", str(path), "--requests", "9"])
    assert (config.workload, config.requests, config.rung, config.progress) == (
        "cold",
        9,
        "R2",
        False,
    )


def test_bad_options_say_what(tmp_path):
    with pytest.raises(SystemExit, match="--workload trace needs --trace PATH"):
        load(["--workload", "trace"])
    path = tmp_path / "bad.toml"
    path.write_text("reqests = 3\n")
    with pytest.raises(SystemExit, match="unknown option 'reqests'"):
        load(["--config", str(path)])
    with pytest.raises(SystemExit, match="--full-last-layer applies to --executor torch only"):
        load(["--executor", "sim", "--full-last-layer"])
    assert load(["--executor", "torch", "--full-last-layer"]).full_last_layer


def test_capacity_blocks_per_stage():
    from wavepp.config import stage_capacities

    assert stage_capacities(load(["--capacity-blocks", "0"]), 4) is None
    assert stage_capacities(load(["--capacity-blocks", "96"]), 3) == [96, 96, 96]
    assert stage_capacities(load(["--capacity-blocks", "8,16"]), 2) == [8, 16]
    for bad in ("8,16,24", "x", "8,0"):
        with pytest.raises(SystemExit, match=r"capacity-blocks|pool of"):
            stage_capacities(load(["--capacity-blocks", bad]), 2)
