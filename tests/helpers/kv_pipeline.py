"""A pipeline's KV events end to end in one process: stages' caches and change logs, rank
0's view, a router's index (``docs/fleet.md``)."""

from __future__ import annotations

from wavepp.kv_events.events import KVEventBatch, decode_batch, encode_batch
from wavepp.policy import DEFAULT
from wavepp.rounds.admission import Offer, RoundMode, round_over
from wavepp.state import (
    RequestId,
    block_hashes,
    materialize,
    num_blocks_for,
    publish,
    release,
    reserve_snapshots,
)

BS = 4


def run_prompts(caches, logs, view, index, prompts, interval, published=None, send=None):
    """Run the prompts one by one through a round over ``caches`` and every stage's
    reducers (as ``wavepp.exec.stage.Stage`` runs them), the stages' ``logs`` into rank 0's
    ``view`` and its events into a router's ``index``, checking at each prompt that the
    index predicted the point the round granted; ``send`` gets every batch's events (a
    publisher), ``published`` collects them. Returns the caches."""
    mode = RoundMode(block_size=BS, policy=DEFAULT)
    published = [] if published is None else published
    for n, tokens in enumerate(prompts):
        rid = RequestId(f"r{n}")
        hashes = block_hashes(tokens, BS)
        offer = Offer(rid, len(tokens), hashes, (len(tokens) - 1) // BS)
        predicted = index.predicted_blocks(hashes, offer.probe_limit)
        caches, result = round_over(caches, [offer], mode)
        if not result.admitted[0]:
            continue
        assert predicted == result.points[0], (n, predicted, result.points)
        end = len(hashes)
        for s, cache in enumerate(caches):  # one chunk: the whole prompt (as Stage does)
            log = logs[s]
            need = num_blocks_for(len(tokens), BS) - cache.claims[rid].held()
            cache, done = materialize(cache, rid, need)
            log.evicted(done.evicted)
            held = cache.claims[rid].held()
            points = sorted({k for k in range(max(held, 1), end + 1) if k % interval == 0}
                            | ({end} if end else set()))  # fmt: skip
            if cache.has_recurrent and points:
                before = cache
                cache, _ = reserve_snapshots(cache, rid, hashes, points)
                log.snapshots_evicted(before, cache)
            before = cache
            cache = publish(cache, rid, hashes, end)
            log.published(before, cache, hashes, held, end,
                          tokens if s == 0 else None, BS)  # fmt: skip
            caches[s] = release(cache, rid)
        while True:  # reports ride waves until every change is out (``limit`` a wave)
            reports = [log.take(cache) for log, cache in zip(logs, caches, strict=True)]
            if all(r is None for r in reports):
                break
            events = view.apply(r for r in reports if r is not None)
            if events and send is not None:
                send(events)
            if events:  # what a subscriber decodes
                batch = decode_batch(encode_batch(KVEventBatch(ts=0.0, events=events)))
                index.apply(batch)
                published.extend(batch.events)
        # the announced view is every stage's cache, intersected
        common = set(caches[0].index)
        for cache in caches[1:]:
            common &= set(cache.index)
        assert index.blocks == common
        assert view.blocks == common
        assert all(log.num_resyncs == 0 for log in logs)
    return caches
