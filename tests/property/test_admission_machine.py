"""The admission protocol's invariants, as a Hypothesis state machine (DESIGN §4).

Several stages with different pool sizes (some with recurrent layers) run the whole
life of random requests — probe, lease, reconcile, escrow, materialize, publish,
release, cancel — in random interleavings. A plain reference model tracks, per stage,
which prefixes are cached (as parent links, independently of the implementation's
tree), what every live request holds, and how many slots are pending; every step is
checked against it.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from wavepp.state import (
    MASK_WIDTH,
    ROOT_SEED,
    StageCache,
    agree,
    audit,
    block_hashes,
    can_ever_fit,
    cancel,
    empty_cache,
    escrow,
    lease,
    materialize,
    num_blocks_for,
    point_from_mask,
    probe,
    probe_linear,
    publish,
    reconcile,
    release,
    reuse_mask,
    usage,
)

BLOCK = 4
SNAPSHOT_INTERVAL = 2

# Prompts from a tiny alphabet of blocks, so that prefixes are shared often.
prompts = st.builds(
    lambda blocks, tail: [t for b in blocks for t in [b] * BLOCK] + [9] * tail,
    st.lists(st.integers(0, 1), min_size=1, max_size=7),
    st.integers(0, BLOCK - 1),
)


def digest(cache: StageCache) -> tuple:
    """A deep, plain-data copy of a cache value, to detect later mutation."""
    nodes = tuple(
        (
            nid,
            n.parent,
            n.attach,
            n.depth,
            n.hashes,
            n.slots,
            tuple(sorted(n.children.items())),
            n.pins,
            n.recency,
        )
        for nid, n in sorted(cache.nodes.items())
    )
    claims = tuple(
        sorted(
            (rid, c.point, c.tip, c.tip_len, c.num_published, c.num_escrowed, c.pending_slots)
            for rid, c in cache.claims.items()
        )
    )
    return (
        nodes,
        tuple(sorted(cache.index.items())),
        tuple(sorted(cache.snapshots.items())),
        claims,
        cache.free_runs,
        cache.num_free,
        cache.num_cached,
        cache.num_protected,
        cache.num_allocated,
        cache.num_escrowed,
        cache.clock,
        cache.next_node_id,
    )


class _Request:
    def __init__(self, rid: str, tokens: list[int]) -> None:
        self.rid = rid
        self.num_tokens = len(tokens)
        self.hashes = block_hashes(tokens, BLOCK)
        self.num_blocks = num_blocks_for(len(tokens), BLOCK)
        self.point = 0
        self.materialized: set[int] = set()  # stages
        self.published = 0  # blocks past the point


class AdmissionMachine(RuleBasedStateMachine):
    snapshots = Bundle("snapshots")

    @initialize(
        capacities=st.lists(st.integers(6, 40), min_size=2, max_size=4),
        recurrent=st.lists(st.booleans(), min_size=4, max_size=4),
    )
    def setup(self, capacities: list[int], recurrent: list[bool]) -> None:
        self.caches = [
            empty_cache(cap, has_recurrent=recurrent[s]) for s, cap in enumerate(capacities)
        ]
        # Reference model, per stage: cached block -> parent block (ROOT_SEED for block 0).
        self.cached: list[dict[int, int]] = [{} for _ in capacities]
        self.live: dict[str, _Request] = {}
        self.seen: list[tuple[int, ...]] = []  # hash lists of recent prompts
        self.seen_tokens: list[list[int]] = []
        self.counter = 0

    # -- helpers ------------------------------------------------------------------

    @property
    def num_stages(self) -> int:
        return len(self.caches)

    def held_blocks(self, stage: int) -> set[int]:
        held: set[int] = set()
        for req in self.live.values():
            held.update(req.hashes[: req.point + req.published])
        return held

    # -- rules --------------------------------------------------------------------

    @rule(tokens=prompts)
    def admit_new(self, tokens: list[int]) -> None:
        self._admit(tokens)

    @precondition(lambda self: self.seen_tokens)
    @rule(data=st.data(), more=st.lists(st.integers(0, 1), min_size=0, max_size=3))
    def admit_extension(self, data: st.DataObject, more: list[int]) -> None:
        """A follow-up turn: an earlier prompt (its full blocks) plus new blocks."""
        earlier = data.draw(st.sampled_from(self.seen_tokens))
        full = earlier[: len(earlier) // BLOCK * BLOCK]
        self._admit(full + [t for b in more for t in [b] * BLOCK] + [9])

    def _admit(self, tokens: list[int]) -> None:
        """One admission round for one request across all stages (DESIGN §4)."""
        req = _Request(f"r{self.counter}", tokens)
        self.counter += 1
        self.seen = [*self.seen[-15:], req.hashes]
        self.seen_tokens = [*self.seen_tokens[-15:], tokens]
        if not all(can_ever_fit(c, req.num_blocks) for c in self.caches):
            return
        # Round 1: every stage probes its hint; MIN gives the candidate point.
        point = agree(probe(c, req.hashes) for c in self.caches)
        held = []
        for s, cache in enumerate(self.caches):
            self.caches[s], got = lease(cache, req.rid, req.hashes, point)
            assert got <= point, "a lease never exceeds the agreed point"
            held.append(got)
        # Round 2 (and more only if a 63-point window holds no common point): AND of
        # the points each stage can serve exactly; richer stages roll back to it.
        rounds, base = 1, point
        while True:
            rounds += 1
            mask = -1
            for s, cache in enumerate(self.caches):
                mask &= reuse_mask(cache, req.hashes, base, held[s])
            agreed = point_from_mask(base, mask)
            if agreed is not None:
                break
            base -= MASK_WIDTH
        assert agreed <= point, "reconciliation never raises a point"
        assert rounds <= self.num_stages, f"reconciliation took {rounds} rounds"
        point = agreed
        for s, cache in enumerate(self.caches):
            self.caches[s], got = reconcile(cache, req.rid, req.hashes, point)
            assert got == point, "every stage serves the agreed point exactly"
        req.point = point
        # The lease protects exactly the agreed prefix on every stage.
        for s in range(self.num_stages):
            assert all(h in self.caches[s].index for h in req.hashes[:point])
        need = req.num_blocks - point
        results = []
        for s, cache in enumerate(self.caches):
            self.caches[s], ok = escrow(cache, req.rid, need)
            results.append(ok)
        event(f"escrow {'admitted' if all(results) else 'refused'}; lease point>0: {point > 0}")
        if all(results):
            self.live[req.rid] = req
        else:
            for s, cache in enumerate(self.caches):
                self.caches[s] = release(cache, req.rid)

    @precondition(
        lambda self: any(len(r.materialized) < self.num_stages for r in self.live.values())
    )
    @rule(data=st.data())
    def materialize_one_stage(self, data: st.DataObject) -> None:
        todo = [
            (r, s)
            for r in self.live.values()
            for s in range(self.num_stages)
            if s not in r.materialized
        ]
        req, s = data.draw(st.sampled_from(todo))
        self._materialize(req, s)

    def _materialize(self, req: _Request, s: int) -> None:
        held = self.held_blocks(s)
        before = self.caches[s].claims[req.rid].num_escrowed
        # Materialization of an admitted request never fails.
        self.caches[s], done = materialize(self.caches[s], req.rid)
        assert len(done.slots) == before
        event(f"materialize evicted {'some' if done.evicted else 'none'}")
        for block in done.evicted:
            assert block not in held, "a held block was evicted"
            del self.cached[s][block]
        req.materialized.add(s)

    @precondition(
        lambda self: any(
            len(r.materialized) == self.num_stages and r.point + r.published < len(r.hashes)
            for r in self.live.values()
        )
    )
    @rule(data=st.data())
    def run_chunk(self, data: st.DataObject) -> None:
        ready = [
            r
            for r in self.live.values()
            if len(r.materialized) == self.num_stages and r.point + r.published < len(r.hashes)
        ]
        req = data.draw(st.sampled_from(ready))
        start = req.point + req.published
        end = data.draw(st.integers(start + 1, len(req.hashes)))
        self._publish(req, end)

    def _publish(self, req: _Request, end: int) -> None:
        start = req.point + req.published
        points = [k for k in range(start + 1, end + 1) if k % SNAPSHOT_INTERVAL == 0]
        if end == len(req.hashes) and end > start:
            points.append(end)
        for s in range(self.num_stages):
            self.caches[s] = publish(self.caches[s], req.rid, req.hashes, end, points)
            for k in range(start, end):
                parent = req.hashes[k - 1] if k else ROOT_SEED
                self.cached[s].setdefault(req.hashes[k], parent)
        req.published = end - req.point

    @precondition(
        lambda self: any(len(r.materialized) == self.num_stages for r in self.live.values())
    )
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        done = [r for r in self.live.values() if len(r.materialized) == self.num_stages]
        self.finish_request(data.draw(st.sampled_from(done)))

    def finish_request(self, req: _Request) -> None:
        if req.point + req.published < len(req.hashes):
            self._publish(req, len(req.hashes))
        for s in range(self.num_stages):
            self.caches[s] = release(self.caches[s], req.rid)
        del self.live[req.rid]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        """Materialize what is left, run every remaining block, release."""
        req = data.draw(st.sampled_from(sorted(self.live.values(), key=lambda r: r.rid)))
        for s in range(self.num_stages):
            if s not in req.materialized:
                self._materialize(req, s)
        self.finish_request(req)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def cancel_one(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(sorted(self.live.values(), key=lambda r: r.rid)))
        for s in range(self.num_stages):
            self.caches[s] = cancel(self.caches[s], req.rid)
        del self.live[req.rid]

    @rule(target=snapshots, stage=st.integers(0, 3))
    def keep_snapshot(self, stage: int) -> tuple[StageCache, tuple]:
        cache = self.caches[stage % self.num_stages]
        return cache, digest(cache)

    @rule(snapshot=consumes(snapshots))
    def old_snapshot_unchanged(self, snapshot: tuple[StageCache, tuple]) -> None:
        cache, kept = snapshot
        assert digest(cache) == kept, "a reducer mutated an earlier value"
        audit(cache)

    # -- invariants ---------------------------------------------------------------

    @invariant()
    def matches_reference_model(self) -> None:
        for s, cache in enumerate(self.caches):
            audit(cache)
            model = self.cached[s]
            assert set(cache.index.keys()) == set(model), "cached set differs from the model"
            # Prefix-closed: every cached block's parent is cached (or is the root).
            assert all(p == ROOT_SEED or p in model for p in model.values())
            for block in self.held_blocks(s):
                assert block in model, "a leased or referenced block is missing"
            pending = sum(len(c.pending_slots) for c in cache.claims.values())
            assert cache.num_free == cache.capacity - len(model) - pending
            assert cache.num_escrowed <= cache.capacity - cache.num_protected - cache.num_allocated

    @invariant()
    def probe_equals_linear_walk(self) -> None:
        for hashes in self.seen:
            for cache in self.caches:
                assert probe(cache, hashes) == probe_linear(cache, hashes)

    @invariant()
    def nothing_held_when_idle(self) -> None:
        if not self.live:
            for cache in self.caches:
                assert usage(cache).balanced, usage(cache)


AdmissionMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestAdmission = AdmissionMachine.TestCase
