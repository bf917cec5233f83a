"""Layer-band streaming: stage 0's band of a long prompt is acknowledged while the last
stage still computes that prompt.

At P = 2 with stage 0 holding one layer of tiny-llama and stage 1 seven, and eight waves
in flight, stage 0 finishes its last chunk several waves ahead of stage 1; the order of
the two events comes from the record's own timestamps (each stage's ``ended_at``, its
last chunk, and ``seconds``, from there to the acknowledgement). The margin is wide:
stage 1's backlog of seven-layer waves against one layer's band on a Unix socket.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.handoff_rig import ReceiverThread, run_pipeline, write_requests
from wavepp.model import BUILTIN
from wavepp.runtime.handoff import model_hf_config

pytestmark = pytest.mark.slow


def test_stage_zeros_band_is_acknowledged_before_the_last_stage_ends(tmp_path):
    config = model_hf_config("tiny-llama", BUILTIN["tiny-llama"])
    rng = np.random.default_rng(5)
    prompts = {"long": rng.integers(3, config["vocab_size"], 4096).tolist()}
    requests = write_requests(tmp_path / "requests.jsonl", prompts, True)
    with ReceiverThread(config, "float32", tmp_path / "rx.sock") as rx:
        record = run_pipeline(2, "tiny-llama", requests, tmp_path / "out.json",
                              "--concurrency", "1", "--budget", "256", "--ring", "8",
                              "--layers-per-stage", "1,7", "--handoff-to", rx.address)  # fmt: skip
    (request,) = record["requests"]
    first, last = request["handoff"]["stages"]
    assert request["handoff"]["status"] == "done" and "long" in rx.handoffs
    acknowledged = first["ended_at"] + first["seconds"]
    print(f"stage 0 acknowledged {(last['ended_at'] - acknowledged) * 1e3:.0f} ms before the "
          f"last stage's last chunk ended")  # fmt: skip
    assert first["ended_at"] < last["ended_at"]
    assert acknowledged < last["ended_at"], request["handoff"]
