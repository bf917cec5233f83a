"""KV events' semantics against admission itself: stages' logs -> rank 0's view -> the
events -> a router's ReplicaIndex, whose prediction must equal the point a round over the
same caches agrees on (docs/fleet.md; DESIGN §4).

Stages run the reducers as ``wavepp.exec.stage.Stage`` does (materialize, reserve
snapshots, publish, release) with small pools, so blocks and snapshots get evicted; one
stage is attention-only, the others recurrent, with snapshot pools of their own sizes.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.kv_pipeline import BS, run_prompts
from wavepp.kv_events.changes import PipelineView, StageLog
from wavepp.kv_events.index import ReplicaIndex
from wavepp.policy import DEFAULT
from wavepp.state import block_hashes

prompt_parts = st.lists(st.integers(0, 3), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.tuples(prompt_parts, st.integers(1, 9)), min_size=1, max_size=12),
    recurrent=st.lists(st.booleans(), min_size=1, max_size=3),
    capacity=st.integers(12, 40),
    snapshot_capacity=st.integers(1, 12),
    interval=st.integers(1, 5),
)
def test_predicted_reuse_is_what_a_round_grants(prompts, recurrent, capacity,
                                                snapshot_capacity, interval):  # fmt: skip
    # prompts: a few shared "documents" (parts) then a private tail, so prefixes repeat
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50, size=2 * BS + 1) for _ in range(4)]
    token_lists = []
    for n, (parts, tail) in enumerate(prompts):
        tokens = np.concatenate([docs[p] for p in parts] + [np.full(tail, 100 + n)])
        token_lists.append(tokens[: capacity * BS // 2].astype(np.int32))
    caches = [DEFAULT.empty_cache(capacity + 3 * s, has_recurrent=r,
                                  snapshot_capacity=snapshot_capacity + s)
              for s, r in enumerate(recurrent)]  # fmt: skip
    logs = [StageLog(s, r, limit=7) for s, r in enumerate(recurrent)]
    view = PipelineView(len(caches), BS, logs[0].tokens.get)
    index = ReplicaIndex(BS, recurrent=any(recurrent))
    run_prompts(caches, logs, view, index, token_lists, interval)


def test_stage_zero_tokens_ride_on_block_stored():
    tokens = np.arange(3 * BS + 1, dtype=np.int32)
    caches = [DEFAULT.empty_cache(16), DEFAULT.empty_cache(16)]
    logs = [StageLog(0, False), StageLog(1, False)]
    view = PipelineView(2, BS, logs[0].tokens.get)
    index = ReplicaIndex(BS)
    published = []
    run_prompts(caches, logs, view, index, [tokens], 2, published)
    hashes = block_hashes(tokens, BS)
    (event,) = published
    assert event.block_hashes == list(hashes)
    assert event.parent_block_hash is None
    assert event.token_ids == tokens[: 3 * BS].tolist()
    assert (event.group_idx, event.kv_cache_spec_kind, event.block_size) == (0, "full_attention",
                                                                           BS)
    assert index.blocks == set(hashes)
    assert index.predicted_blocks(hashes, 3) == 3
    assert index.predicted_blocks(hashes, 2) == 2
    assert not index.recurrent
