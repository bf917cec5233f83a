"""The data plane keeps each wave's descriptor with its tensor under concurrent senders,
over Gloo (both parts on CPU; the same code sends the tensor over NCCL on CUDA) and over
Unix sockets (``--data-plane local``), which makes no Gloo group of its own."""

import json

import pytest

from tests.helpers.run import torchrun

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind", ["gloo", "local"])
def test_descriptor_and_tensor_stay_together_under_concurrent_waves(tmp_path, kind):
    out = tmp_path / "data_plane.json"
    torchrun(2, ["tests/integration/data_plane_script.py", str(out), kind], timeout=180)
    result = json.loads(out.read_text())
    assert result["mismatches"] == []
    # received as inference tensors, like the sender's executor output (a plain tensor
    # made a compiled stage recompile at its first wave)
    assert result["plain"] == []
    order = result["order"]
    assert sorted(order) == ["0", "1", "2", "3"]
    for sender, waves in order.items():
        assert waves == list(range(25)), f"sender {sender}'s waves arrived as {waves}"
    # Gloo pair groups only for a Gloo data plane: descriptors and tensors, for the link
    # 0 -> 1 and the completions 1 -> 0; over sockets the world group is the only one
    want = [[0, 1]] * 4 if kind == "gloo" else []
    assert result["groups"] == want
