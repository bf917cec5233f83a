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
    with pytest.raises(SystemExit, match="--sim-burn applies to --executor sim with --sim-device"):
        load(["--executor", "sim", "--sim-device", "h200", "--sim-burn"])
    assert load(["--executor", "sim", "--sim-device", "measured:p.json", "--sim-burn"]).sim_burn


def test_capacity_blocks_per_stage():
    from wavepp.config import stage_capacities

    assert stage_capacities(load(["--capacity-blocks", "0"]), 4) is None
    assert stage_capacities(load(["--capacity-blocks", "96"]), 3) == [96, 96, 96]
    assert stage_capacities(load(["--capacity-blocks", "8,16"]), 2) == [8, 16]
    for bad in ("8,16,24", "x", "8,0"):
        with pytest.raises(SystemExit, match=r"capacity-blocks|pool of"):
            stage_capacities(load(["--capacity-blocks", bad]), 2)


@pytest.mark.parametrize(
    "toml, message",
    [('concurrency = "eight"', "--concurrency must be an integer, got 'eight'"),
     ('requests = "4"', "--requests must be an integer, got '4'"),
     ('compile = "no"', "--compile must be true or false, got 'no'"),
     ('rung = "R9"', "--rung must be one of R1, R2, R3, R4, R5, oracle, got 'R9'"),
     ("block_size = 16.0", "--block-size must be an integer, got 16.0"),
     ('seed = "x"', "--seed must be an integer, got 'x'"),
     ("dead_after_s = -1", "--dead-after-s must be positive, got -1"),
     ("capacity_blocks = -5", "--capacity-blocks: every stage needs a pool of ≥ 1 block")],
)  # fmt: skip
def test_toml_values_get_the_typed_checks_naming_option_and_file(tmp_path, toml, message):
    path = tmp_path / "run.toml"
    path.write_text(toml + "\n")
    with pytest.raises(SystemExit) as caught:
        load(["--config", str(path)])
    assert message in str(caught.value.code) and str(path) in str(caught.value.code)


def test_command_line_and_python_api_get_the_same_checks():
    with pytest.raises(SystemExit, match=r"--concurrency must be an integer, got 'eight'$"):
        load(["--concurrency", "eight"])
    with pytest.raises(SystemExit, match=r"--concurrency must be an integer, got 'eight' \(in"):
        from wavepp.config import validate

        validate(attrs.evolve(load([]), concurrency="eight"))
    config = load(["--dead-after-s", "3", "--time-scale", "2"])
    assert (config.dead_after_s, config.time_scale) == (3.0, 2.0)


def test_checks_that_need_only_the_world_size():
    from wavepp.config import check_for_world

    with pytest.raises(SystemExit, match="gives 2 counts for 4 stages"):
        check_for_world(load(["--layers-per-stage", "1,1"]), 4)
    with pytest.raises(SystemExit, match="sums to 3 layers; the model has 4"):
        check_for_world(load(["--layers-per-stage", "1,2"]), 2, num_layers=4)
    check_for_world(load(["--layers-per-stage", "2,2"]), 2, num_layers=4)
