"""--device, --dtype, --threads, --sim-device: parsing and what they select."""

import pytest
import torch

from wavepp.config import load
from wavepp.exec.device import default_threads, pick_device, pick_dtype, set_threads


def test_options_parse_and_default():
    c = load(["--device", "cpu", "--dtype", "bfloat16", "--threads", "2", "--sim-device", "h100"])
    assert (c.device, c.dtype, c.threads, c.sim_device) == ("cpu", "bfloat16", 2, "h100")
    d = load([])
    assert (d.device, d.dtype, d.threads, d.sim_device) == ("auto", "float32", 0, "h200")
    with pytest.raises(SystemExit):
        load(["--dtype", "float64"])
    with pytest.raises(SystemExit):
        load(["--threads", "-1"])


def test_threads_default_to_the_cores_shared_by_the_local_ranks(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert default_threads() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert default_threads() == 1
    before = torch.get_num_threads()
    try:
        assert set_threads(0) == 1 and torch.get_num_threads() == 1
        assert set_threads(3) == 3 and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_device_and_dtype_choices():
    assert pick_device("cpu") == torch.device("cpu")
    assert pick_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="dtype 'int8' is not one of"):
        pick_dtype("int8")
    if not torch.cuda.is_available():
        assert pick_device("auto") == torch.device("cpu")
        with pytest.raises(SystemExit, match="torch sees no CUDA device"):
            pick_device("cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_picks_this_ranks_gpu(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert pick_device("auto") == torch.device("cuda", 0)
