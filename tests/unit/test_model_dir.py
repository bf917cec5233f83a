"""A model directory is input: each broken one (tests/helpers/broken_models) is refused
by what reads it — the config's fields, the safetensors headers, the weights as they
load — in one CheckpointError naming the file and the field or tensor; what a config
asks of memory is counted without allocating it."""

from __future__ import annotations

import math

import attrs
import pytest

from tests.helpers.broken_models import BROKEN, broken_model, good_model
from wavepp.config import RunConfig
from wavepp.launch.backends.torch_backend import memory_need
from wavepp.model import BUILTIN
from wavepp.model.checkpoint import check_tensors, load_checkpoint, read_config
from wavepp.model.fields import CheckpointError, checked_fields
from wavepp.model.footprint import footprint
from wavepp.model.stage import random_weights


@pytest.mark.parametrize("case", [c for c in BROKEN if c != "hidden-size-1e9"])
def test_each_broken_directory_is_refused_naming_the_file_and_the_field(tmp_path, case):
    path = broken_model(tmp_path / case, case)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path)
    message = str(error.value)
    assert "\n" not in message
    for words in BROKEN[case][1]:
        assert words in message, message


def test_the_good_directory_loads_and_its_tensors_are_what_the_config_needs(tmp_path):
    path = good_model(tmp_path)
    cfg, weights = load_checkpoint(path)
    assert cfg == BUILTIN["tiny-llama"]
    shapes = footprint(cfg).tensors
    assert {k: tuple(v.shape) for k, v in weights.items()} == shapes
    check_tensors(path, shapes)


def test_a_config_of_absurd_sizes_is_read_and_counted_without_allocating(tmp_path):
    path = broken_model(tmp_path, "hidden-size-1e9")
    cfg = read_config(path)  # 1e9 in JSON is a float: read as the integer it is
    assert cfg.d_model == 10**9
    model = footprint(cfg)  # on the meta device: nothing allocated
    assert model.weight_elements > 10**13
    with pytest.raises(OverflowError, match="overflow 64 bits"):
        footprint(attrs.evolve(cfg, d_model=2**31 - 1, d_ff=2**31 - 1))


def test_fields_are_checked_by_rule_and_null_only_where_it_means_the_default():
    data = {"hidden_size": 128.0, "head_dim": None, "rope_parameters": {"rope_theta": 1e4},
            "max_position_embeddings": "not read"}  # fmt: skip
    assert checked_fields(data, "config.json") == {**data, "hidden_size": 128}
    refusals = {
        "config.json: field vocab_size: null is not a positive integer": {"vocab_size": None},
        "config.json: field tie_word_embeddings: 'false' is not true or false":
            {"tie_word_embeddings": "false"},
        "config.json: field rope_parameters.rope_theta: -1 is not a finite number > 0":
            {"rope_parameters": {"rope_theta": -1}},
        "config.json: field num_local_experts: 100,000 is more than 16,384":
            {"num_local_experts": 100_000},
        "config.json: field hidden_size: 1.5 is not a positive integer": {"hidden_size": 1.5},
        "config.json: not a JSON object but list": [],
    }  # fmt: skip
    for message, bad in refusals.items():
        with pytest.raises(CheckpointError) as error:
            checked_fields(bad, "config.json")
        assert str(error.value) == message


def test_the_memory_a_run_needs_counts_weights_and_every_stage_pool():
    cfg = BUILTIN["tiny-hybrid"]
    model = footprint(cfg)
    weights = sum(t.numel() for t in random_weights(cfg, 0).values())
    assert model.weight_elements == weights
    # 2 attention layers of k and v [2 KV heads, 32]; 6 gated-linear states [4, 32, 32]
    assert model.cache_row == 2 * 2 * 2 * 32 and model.state == 6 * 4 * 32 * 32
    c = RunConfig(model="tiny-hybrid", capacity_blocks="100", block_size=16)
    need, parts = memory_need(c, model, stages=2, default_blocks=7)
    kv = 2 * 100 * 16 * model.cache_row * 4
    snapshots = 2 * 100 * model.state * 4
    assert need == weights * 4 + kv + snapshots
    assert "100 blocks of 16 tokens a stage" in parts and "snapshots" in parts
    need, _ = memory_need(attrs.evolve(c, capacity_blocks="0"), model, 2, default_blocks=7)
    assert need == weights * 4 + math.prod((2, 7, 16, model.cache_row, 4)) + 2 * 7 * model.state * 4
