"""The admission protocol's invariants as a Hypothesis state machine, for any policy.

Several stages with different pool sizes (some with recurrent layers, some with a small
snapshot pool) run the whole life of random requests — admission rounds of one to
three offers (probe, lease, mask, reconcile, escrow in the policy's order, the cut),
materialize, snapshot placement and reservation, publish, release, cancel — in random
interleavings, calling only the policy's functions. A plain reference model tracks, per
stage, which prefixes are cached (as parent links, independently of the implementation's
tree) and what every live request holds; every step is checked against it and each
check names the invariant it guards (:mod:`wavepp.checker.invariants`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import hypothesis.strategies as st
from hypothesis import event
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from wavepp.checker.guarantees import check_escrow_order, keeping_promises
from wavepp.checker.invariants import Violation, check, violated
from wavepp.policy import ChunkSpan, Policy
from wavepp.rounds.admission import (
    Offer,
    RoundMode,
    agree_over,
    attempt_order,
    candidates,
    commit,
    cut,
    lease_all,
    note_refusals,
    probe_points,
    settle,
)
from wavepp.rounds.errors import ProtocolError
from wavepp.state import (
    ROOT_SEED,
    InvariantError,
    StageCache,
    audit,
    block_hashes,
    can_ever_fit,
    num_blocks_for,
    probe_linear,
    usage,
)

BLOCK = 4  # tokens per block
SNAPSHOT_INTERVAL = 2  # blocks

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
            n.uses,
        )
        for nid, n in sorted(cache.nodes.items())
    )
    claims = tuple(
        sorted(
            (rid, c.point, c.tip, c.tip_len, c.num_published, c.num_escrowed, c.pending_slots,
             c.resume, c.pending_snapshots)
            for rid, c in cache.claims.items()
        )
    )  # fmt: skip
    snapshots = tuple(
        sorted((b, s.k, s.slot, s.recency, s.pins) for b, s in cache.snapshots.items())
    )
    return (
        nodes,
        tuple(sorted(cache.index.items())),
        snapshots,
        claims,
        cache.free_runs,
        cache.num_free,
        cache.num_cached,
        cache.num_protected,
        cache.num_allocated,
        cache.num_escrowed,
        cache.clock,
        cache.next_node_id,
        cache.victims,
        cache.snapshot_free,
        cache.num_snapshot_free,
        cache.num_snapshot_pending,
        cache.snapshot_lru,
    )


@contextmanager
def policy_step(step: str) -> Iterator[None]:
    """Turn what a policy's functions raise into the invariant it breaks."""
    try:
        yield
    except Violation:
        raise
    except InvariantError as error:
        raise violated("accounting_consistent", f"{step}: {error}") from error
    except ProtocolError as error:
        raise violated("reconcile_monotone", f"{step}: {error}") from error
    except Exception as error:
        raise violated(
            "no_unexpected_error", f"{step} raised {type(error).__name__}: {error}"
        ) from error


class _Request:
    def __init__(self, rid: str, tokens: list[int]) -> None:
        self.rid = rid
        self.tokens = tokens
        self.num_tokens = len(tokens)
        self.hashes = block_hashes(tokens, BLOCK)
        self.num_blocks = num_blocks_for(len(tokens), BLOCK)
        self.point = 0
        self.materialized: set[int] = set()  # stages
        self.published = 0  # blocks past the point

    def __repr__(self) -> str:  # how Hypothesis prints a drawn request in shrunk steps
        return f"_Request({self.rid!r}, {self.tokens!r})"

    def offer(self) -> Offer:
        return Offer(self.rid, self.num_tokens, self.hashes, (self.num_tokens - 1) // BLOCK)


def admission_machine(policy: Policy) -> type[RuleBasedStateMachine]:
    """A state machine class that checks ``policy`` (run it with Hypothesis)."""

    class AdmissionMachine(RuleBasedStateMachine):
        snapshots = Bundle("snapshots")

        @initialize(
            capacities=st.lists(st.integers(6, 24), min_size=2, max_size=4),
            recurrent=st.lists(st.booleans(), min_size=4, max_size=4),
            snapshot_pools=st.lists(
                st.one_of(st.none(), st.integers(0, 6)), min_size=4, max_size=4
            ),
            eager=st.booleans(),
        )
        def setup(
            self,
            capacities: list[int],
            recurrent: list[bool],
            snapshot_pools: list[int | None],
            eager: bool,
        ) -> None:
            self.policy = policy
            self.mode = RoundMode(BLOCK, eager=eager, policy=keeping_promises(policy))
            with policy_step("empty_cache"):
                self.caches = [
                    policy.empty_cache(
                        cap, has_recurrent=recurrent[s], snapshot_capacity=snapshot_pools[s]
                    )
                    for s, cap in enumerate(capacities)
                ]
            # Reference model, per stage: cached block -> parent block (ROOT_SEED for block 0).
            self.cached: list[dict[int, int]] = [{} for _ in capacities]
            self.live: dict[str, _Request] = {}
            self.seen: list[tuple[int, ...]] = []  # hash lists of recent prompts
            self.seen_tokens: list[list[int]] = []
            self.refusals: dict = {}
            self.counter = 0

        # -- helpers ------------------------------------------------------------------

        @property
        def num_stages(self) -> int:
            return len(self.caches)

        def held_blocks(self) -> set[int]:
            held: set[int] = set()
            for req in self.live.values():
                held.update(req.hashes[: req.point + req.published])
            return held

        def _new_request(self, tokens: list[int]) -> _Request:
            req = _Request(f"r{self.counter}", tokens)
            self.counter += 1
            self.seen = [*self.seen[-7:], req.hashes]
            self.seen_tokens = [*self.seen_tokens[-15:], tokens]
            return req

        # -- admission ----------------------------------------------------------------

        @rule(batch=st.lists(prompts, min_size=1, max_size=3))
        def admit_new(self, batch: list[list[int]]) -> None:
            self._round([self._new_request(tokens) for tokens in batch])

        @precondition(lambda self: self.seen_tokens)
        @rule(data=st.data(), more=st.lists(st.integers(0, 1), min_size=0, max_size=3))
        def admit_extension(self, data: st.DataObject, more: list[int]) -> None:
            """A follow-up turn: an earlier prompt (its full blocks) plus new blocks."""
            earlier = data.draw(st.sampled_from(self.seen_tokens))
            full = earlier[: len(earlier) // BLOCK * BLOCK]
            tokens = full + [t for b in more for t in [b] * BLOCK] + [9]
            self._round([self._new_request(tokens)])

        def _round(self, reqs: list[_Request]) -> None:
            """One admission round across all stages, the collectives as MIN / AND."""
            reqs = [r for r in reqs if all(can_ever_fit(c, r.num_blocks) for c in self.caches)]
            if not reqs:
                return
            offers = [r.offer() for r in reqs]
            n, mode = len(offers), self.mode
            with policy_step("probe"):
                probed = [probe_points(c, offers, mode) for c in self.caches]
            points = [min(p[i] for p in probed) for i in range(n)]
            held = []
            for s, cache in enumerate(self.caches):  # each stage leases what it probed
                with policy_step("lease"):
                    self.caches[s], got = lease_all(cache, offers, probed[s], mode)
                held.append(got)
            bases = [min(h[i] for h in held) for i in range(n)]
            agreed, _ = agree_over(self.caches, offers, bases, held)
            for i, req in enumerate(reqs):
                check(
                    agreed[i] <= bases[i] <= points[i],
                    "reconcile_monotone",
                    f"{req.rid}: probe {points[i]} -> lease {bases[i]} -> agreed {agreed[i]}",
                )
                # Every stage still protects the lease it reported.
                for s in range(self.num_stages):
                    check(
                        all(h in self.caches[s].index for h in req.hashes[: held[s][i]]),
                        "cache_matches_model",
                        f"{req.rid}: stage {s} leased {held[s][i]} blocks it does not cache",
                    )
            flags = [1] * n
            for s, cache in enumerate(self.caches):
                with policy_step("reconcile + escrow"):
                    self.caches[s], ok = settle(cache, offers, agreed, mode, self.refusals)
                flags = [min(f, o) for f, o in zip(flags, ok, strict=True)]
                self._check_backed(s, "escrow")
            cands = candidates(offers, agreed, BLOCK, self.refusals)
            with policy_step("escrow order"):
                order = attempt_order(mode, cands)
                admitted = cut(flags, mode, cands)
            check_escrow_order(policy.escrow_order, cands, order)
            blocked = False
            for i in order:
                check(
                    not (blocked and admitted[i]),
                    "escrow_order_contract",
                    f"{offers[i].request_id} admitted after a blocking refusal",
                )
                blocked = blocked or (not flags[i] and policy.escrow_order.blocks(cands[i]))
            for i, req in enumerate(reqs):
                if not admitted[i]:
                    continue
                req.point = agreed[i]
                for s, cache in enumerate(self.caches):
                    claim = cache.claims.get(req.rid)
                    need = req.num_blocks - agreed[i]
                    check(
                        claim is not None and claim.num_escrowed == need
                        and claim.point == agreed[i],
                        "admitted_only_if_escrowed",
                        f"{req.rid} admitted at point {agreed[i]} needing {need} blocks; "
                        f"stage {s} holds {claim}",
                    )  # fmt: skip
            holding = self.held_blocks()  # and the leases of this round's admitted offers
            holding.update(
                h for i, r in enumerate(reqs) if admitted[i] for h in r.hashes[: r.point]
            )
            for s, cache in enumerate(self.caches):
                with policy_step("commit"):
                    self.caches[s], evicted = commit(cache, offers, admitted, mode)
                self._evicted(s, evicted, holding)
            self.refusals = note_refusals(self.refusals, offers, admitted)
            for i, req in enumerate(reqs):
                for s, cache in enumerate(self.caches):
                    if not admitted[i]:
                        check(
                            req.rid not in cache.claims,
                            "admitted_only_if_escrowed",
                            f"refused {req.rid} still holds {cache.claims.get(req.rid)} "
                            f"on stage {s}",
                        )
                if admitted[i]:
                    self.live[req.rid] = req
                    if mode.eager:
                        req.materialized = set(range(self.num_stages))
                    for s in range(self.num_stages):
                        check(
                            all(h in self.caches[s].index for h in req.hashes[: req.point]),
                            "leased_block_never_evicted",
                            f"{req.rid}: stage {s} lost blocks of its lease at {req.point}",
                        )
            event(f"round of {n}: {sum(admitted)} admitted")

        def _check_backed(self, s: int, step: str) -> None:
            c = self.caches[s]
            check(
                c.num_escrowed <= c.capacity - c.num_protected - c.num_allocated,
                "escrow_backed",
                f"after {step} stage {s} escrows {c.num_escrowed} blocks but free + evictable "
                f"is {c.capacity - c.num_protected - c.num_allocated}",
            )

        def _evicted(self, s: int, evicted, holding: set[int]) -> None:
            for block in evicted:
                check(
                    block not in holding,
                    "leased_block_never_evicted",
                    f"stage {s} evicted block {block:#x}, held by a live request",
                )
                check(
                    block in self.cached[s],
                    "cache_matches_model",
                    f"stage {s} evicted block {block:#x}, which it did not cache",
                )
                del self.cached[s][block]

        # -- execution ----------------------------------------------------------------

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
            holding = self.held_blocks()
            old = self.caches[s]
            before = old.claims[req.rid].num_escrowed
            order = old.eviction
            heads = [
                (order.key(n), nid)
                for nid, n in old.nodes.items()
                if n.parent is not None and order.evictable(n) > 0
            ]
            try:
                self.caches[s], done = policy.materialize(self.caches[s], req.rid, None)
            except Exception as error:
                raise violated(
                    "materialize_never_fails",
                    f"stage {s}, {req.rid} with {before} escrowed: {type(error).__name__}: {error}",
                ) from error
            check(
                len(done.slots) == before,
                "materialize_never_fails",
                f"stage {s}: {req.rid} had {before} escrowed blocks, got {len(done.slots)} slots",
            )
            event(f"materialize evicted {'some' if done.evicted else 'none'}")
            check(
                bool(done.evicted) == (before > old.num_free),
                "victims_in_eviction_order",
                f"stage {s}: {len(done.evicted)} evicted for {before} blocks with "
                f"{old.num_free} free",
            )
            if done.evicted:
                first = old.nodes[min(heads)[1]]
                check(
                    done.evicted[0] == first.hashes[-1],
                    "victims_in_eviction_order",
                    f"stage {s}: first victim {done.evicted[0]:#x}, the order's head is node "
                    f"{first.node_id} ending in {first.hashes[-1]:#x}",
                )
            self._evicted(s, done.evicted, holding)
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
            ends = end == len(req.hashes)  # the request's last chunk
            for s in range(self.num_stages):
                cache = self.caches[s]
                span = ChunkSpan(
                    req.rid, req.hashes, start, end, ends, SNAPSHOT_INTERVAL, starts_at_held=True
                )
                with policy_step("snapshot placement"):
                    points = tuple(policy.snapshot_placement(cache, span))
                check(
                    all(span.lowest <= k <= end for k in points),
                    "snapshot_placement_in_range",
                    f"stage {s}: placement chose {points} outside [{span.lowest}, {end}]",
                )
                with policy_step("reserve_snapshots"):
                    cache, got = policy.reserve_snapshots(cache, req.rid, req.hashes, points)
                check(
                    set(got.points) <= set(points) and len(got.points) == len(got.slots)
                    and len(set(got.slots)) == len(got.slots)
                    and all(0 <= x < cache.snapshot_capacity for x in got.slots),
                    "snapshot_placement_in_range",
                    f"stage {s}: reserved {got} for points {points}",
                )  # fmt: skip
                with policy_step("publish"):
                    cache = policy.publish(cache, req.rid, req.hashes, end)
                self.caches[s] = cache
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
            if req.point + req.published < len(req.hashes) or req.num_tokens % BLOCK:
                self._publish(req, len(req.hashes))  # the last chunk (maybe a partial tail)
            for s in range(self.num_stages):
                with policy_step("release"):
                    self.caches[s] = policy.release(self.caches[s], req.rid)
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
                with policy_step("cancel"):
                    self.caches[s] = policy.cancel(self.caches[s], req.rid)
            del self.live[req.rid]

        @rule(target=snapshots, stage=st.integers(0, 3))
        def keep_snapshot(self, stage: int) -> tuple[StageCache, tuple]:
            cache = self.caches[stage % self.num_stages]
            return cache, digest(cache)

        @rule(snapshot=consumes(snapshots))
        def old_snapshot_unchanged(self, snapshot: tuple[StageCache, tuple]) -> None:
            cache, kept = snapshot
            check(digest(cache) == kept, "reducers_pure", "a reducer mutated an earlier value")

        # -- invariants ---------------------------------------------------------------

        @invariant()
        def matches_reference_model(self) -> None:
            holding = self.held_blocks()
            for s, cache in enumerate(self.caches):
                self._check_backed(s, "the last step")
                model = self.cached[s]
                for block in holding:
                    check(
                        block in model and block in cache.index,
                        "leased_block_never_evicted",
                        f"stage {s} lost block {block:#x}, held by a live request",
                    )
                check(
                    set(cache.index.keys()) == set(model),
                    "cache_matches_model",
                    f"stage {s} caches {len(cache.index)} blocks, the model {len(model)}",
                )
                check(
                    all(p == ROOT_SEED or p in model for p in model.values()),
                    "cache_matches_model",
                    f"stage {s}'s cached set is not prefix-closed",
                )
                pending = sum(len(c.pending_slots) for c in cache.claims.values())
                check(
                    cache.num_free == cache.capacity - len(model) - pending,
                    "cache_matches_model",
                    f"stage {s}: {cache.num_free} free slots, the model says "
                    f"{cache.capacity - len(model) - pending}",
                )
                try:
                    audit(cache)
                except InvariantError as error:
                    raise violated("accounting_consistent", f"stage {s}: {error}") from error

        @invariant()
        def leased_snapshots_kept(self) -> None:
            for req in self.live.values():
                if req.point == 0:
                    continue
                block = req.hashes[req.point - 1]
                for s, cache in enumerate(self.caches):
                    if cache.has_recurrent:
                        check(
                            block in cache.snapshots,
                            "leased_snapshot_kept",
                            f"stage {s} dropped the snapshot at {req.rid}'s lease point "
                            f"{req.point}",
                        )

        @invariant()
        def probe_equals_linear_walk(self) -> None:
            for hashes in self.seen:
                for s, cache in enumerate(self.caches):
                    with policy_step("probe"):
                        got = policy.probe(cache, hashes, None)
                    want = probe_linear(cache, hashes)
                    check(
                        got == want,
                        "probe_exact",
                        f"stage {s}: probe {got}, linear walk {want}",
                    )

        @invariant()
        def nothing_held_when_idle(self) -> None:
            if not self.live:
                for s, cache in enumerate(self.caches):
                    use = usage(cache)
                    check(use.balanced, "balanced_when_idle", f"stage {s}: {use}")

    AdmissionMachine.__name__ = AdmissionMachine.__qualname__ = "AdmissionMachine"
    return AdmissionMachine
