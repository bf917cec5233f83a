"""Run in vLLM's venv: decode KV-event payloads with vLLM's own KVEventBatch.

``python vllm_events_driver.py DIR`` decodes every ``*.bin`` in DIR (sorted) with
``msgspec.msgpack.Decoder(vllm.distributed.kv_events.KVEventBatch)`` and prints one JSON
line: per payload, its events as [type, group_idx, block_hashes, parent, token_ids]."""

import json
import sys
from pathlib import Path

import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockStored, KVEventBatch

decoder = msgspec.msgpack.Decoder(KVEventBatch)
out = []
for path in sorted(Path(sys.argv[1]).glob("*.bin")):
    batch = decoder.decode(path.read_bytes())
    events = []
    for event in batch.events:
        if isinstance(event, AllBlocksCleared):
            events.append(["AllBlocksCleared"])
        elif isinstance(event, BlockStored):
            events.append(["BlockStored", event.group_idx, event.block_hashes,
                           event.parent_block_hash, event.token_ids, event.block_size,
                           event.kv_cache_spec_kind])
        else:
            events.append(["BlockRemoved", event.group_idx, event.block_hashes])
    out.append({"ts": batch.ts, "dp": batch.data_parallel_rank, "events": events})
print("@@wavepp " + json.dumps(out))
