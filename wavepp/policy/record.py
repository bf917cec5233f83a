"""The policy record: every decision point of the protocol as one immutable value.

A :class:`Policy` names the functions the runtime calls for each step of a request's
life (DESIGN §4, §4a)::

    probe -> lease -> [reconcile] -> escrow (in the escrow order) -> materialize
    (victims in the eviction order) -> reserve snapshots (at the placement's points)
    -> publish ... -> release;   cancel at any time;   planner for the waves

The defaults are the reducers of :mod:`wavepp.state` and reproduce the runtime's
behaviour exactly. A researcher replaces single fields (``attrs.evolve(DEFAULT,
eviction=...)``) and checks the result with ``python -m wavepp.checker pkg.mod:NAME``;
``docs/policies.md`` gives each field's contract.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from wavepp import state
from wavepp.plan import Planner
from wavepp.queueing import QUEUE_ORDERS
from wavepp.state import (
    LRU,
    BlockHash,
    Eviction,
    Guarantee,
    Materialized,
    RequestId,
    SnapshotReservation,
    StageCache,
    guarantees,
    guarantees_of,
)

ProbeFn = Callable[[StageCache, Sequence[BlockHash], "int | None"], int]
"""``probe(cache, hashes, limit) -> point``: read-only local reuse point, ≤ limit."""

LeaseFn = Callable[[StageCache, RequestId, Sequence[BlockHash], int], "tuple[StageCache, int]"]
"""``lease(cache, rid, hashes, point) -> (cache, actual ≤ point)``."""

ReconcileFn = LeaseFn
"""``reconcile(cache, rid, hashes, point) -> (cache, new point ≤ old point)``."""

EscrowFn = Callable[[StageCache, RequestId, int], "tuple[StageCache, bool]"]
"""``escrow(cache, rid, num_blocks) -> (cache, ok)``: ok only if every escrow stays backed."""

MaterializeFn = Callable[[StageCache, RequestId, "int | None"], "tuple[StageCache, Materialized]"]
"""``materialize(cache, rid, num_blocks) -> (cache, Materialized)``: never fails when backed."""

ReserveFn = Callable[
    [StageCache, RequestId, Sequence[BlockHash], Sequence[int]],
    "tuple[StageCache, SnapshotReservation]",
]
"""``reserve_snapshots(cache, rid, hashes, points) -> (cache, reservation)``."""

PublishFn = Callable[[StageCache, RequestId, Sequence[BlockHash], int], StageCache]
"""``publish(cache, rid, hashes, end) -> cache``: blocks held..end-1 enter the cache."""

ReleaseFn = Callable[[StageCache, RequestId], StageCache]
"""``release(cache, rid)`` / ``cancel(cache, rid) -> cache``: the request holds nothing."""


@attrs.frozen
class ChunkSpan:
    """What the snapshot placement sees of one chunk about to run on a recurrent stage."""

    request_id: RequestId
    hashes: tuple[BlockHash, ...]  # the request's full blocks
    held: int  # blocks 0..held-1 are cached for the request; the chunk publishes past it
    end_blocks: int  # full blocks at the chunk's end: points may lie in (held, end_blocks]
    ends_request: bool  # the chunk is the request's last
    interval: int  # the run's --snapshot-interval, in blocks
    starts_at_held: bool = False  # the chunk starts exactly after the held blocks, so the
    #                               state after ``held`` blocks can be saved too (k = held)
    shared: tuple[int, ...] = ()  # block counts where requests waiting for this one branch
    #                               off its path (rank 0 sends them with the chunk)

    @property
    def lowest(self) -> int:
        """The smallest block count this chunk can save a snapshot at."""
        return self.held if self.starts_at_held and self.held > 0 else self.held + 1


Placement = Callable[[StageCache, ChunkSpan], Sequence[int]]
"""``placement(cache, span) -> block counts k in [span.lowest, end_blocks]`` to snapshot
after (the executor saves the recurrent state there while running the chunk)."""


def every_interval_and_end(cache: StageCache, span: ChunkSpan) -> tuple[int, ...]:
    """Every ``interval``-th block and the request's end (the runtime's placement).

    A request whose last chunk starts right at its last full block (a partial tail
    only) still gets its end snapshot, saved from the state the chunk resumes from.
    """
    if not cache.has_recurrent:
        return ()
    step = span.interval
    points = [k for k in range(span.held + 1, span.end_blocks + 1) if k % step == 0]
    end = span.end_blocks
    if span.ends_request and end >= span.lowest and end not in points:
        points.append(end)  # a snapshot at every request end
    return tuple(points)


def at_junctions(cache: StageCache, span: ChunkSpan) -> tuple[int, ...]:
    """The default placement: every ``interval``-th block, the request's end, and the
    **junctions** — where the request leaves the path this stage already caches (its
    attention hit beyond the blocks it holds), and where requests waiting for this one
    will leave its path (``span.shared``, from rank 0's in-flight sharing). A hybrid
    stage resumes only at a snapshot, so the next request branching at the same point
    (a shared system prompt, a document followed by other questions) reuses the prefix
    from here instead of from the last interval point below it, or from nothing."""
    points = set(every_interval_and_end(cache, span))
    if cache.has_recurrent:
        hit = state.attention_hit(cache, span.hashes, span.end_blocks)
        if span.held < hit <= span.end_blocks:
            points.add(hit)
        points.update(k for k in span.shared if span.lowest <= k <= span.end_blocks)
    return tuple(sorted(points))


@attrs.frozen
class EscrowCandidate:
    """One offer of a round as the escrow order sees it (identical on every rank)."""

    request_id: RequestId
    position: int  # index in the round's offers: arrival (FCFS) order
    point: int  # the agreed reuse point, blocks
    need: int  # blocks to escrow: the prompt's blocks minus the point
    waited: int  # earlier rounds that refused this request


@attrs.frozen
class EscrowOrder:
    """In which order a round's escrows are tried, and which refusals block the rest.

    ``order`` returns a permutation of the candidates' indices; ``blocks(c)`` says
    whether refusing ``c`` refuses everything after it in that order (and makes the
    later offers give their leases up so ``c`` gets every evictable block first). Both
    must be pure functions of the candidates: every rank computes them alone.
    """

    name: str
    order: Callable[[Sequence[EscrowCandidate]], Sequence[int]]
    blocks: Callable[[EscrowCandidate], bool]

    @property
    def first_come_first_served(self) -> bool:
        """Whether ``order`` declares arrival order and ``blocks`` that every refusal
        blocks (:class:`wavepp.state.Guarantee`): then nothing after a refused offer is
        admitted, and rank 0 stops offering past the first offer that cannot fit."""
        in_arrival_order = Guarantee.ARRIVAL_ORDER in guarantees_of(self.order)
        return in_arrival_order and Guarantee.EVERY_REFUSAL_BLOCKS in guarantees_of(self.blocks)


@guarantees(Guarantee.ARRIVAL_ORDER)
def arrival_order(candidates: Sequence[EscrowCandidate]) -> list[int]:
    return sorted(range(len(candidates)), key=lambda i: candidates[i].position)


@guarantees(Guarantee.EVERY_REFUSAL_BLOCKS)
def always(candidate: EscrowCandidate) -> bool:
    return True


FCFS = EscrowOrder("fcfs", order=arrival_order, blocks=always)
"""First come, first served: nobody overtakes a refused request."""


@attrs.frozen
class Policy:
    """Every decision point of the protocol; the runtime calls nothing else."""

    name: str = "default"
    probe: ProbeFn = state.probe  # hint probe (R1 swaps in state.probe_linear)
    lease: LeaseFn = state.lease
    reconcile: ReconcileFn = state.reconcile
    escrow: EscrowFn = state.escrow
    escrow_order: EscrowOrder = FCFS  # the order escrows are tried in, and the cut
    materialize: MaterializeFn = state.materialize
    eviction: Eviction = LRU  # materialize's victim order: set here only. The cache
    #   carries it (its victim index is sorted by it) from empty_cache below, and a round
    #   refuses a cache whose order is not this one (rounds.admission.check_eviction)
    snapshot_placement: Placement = at_junctions
    reserve_snapshots: ReserveFn = state.reserve_snapshots
    publish: PublishFn = state.publish
    release: ReleaseFn = state.release
    cancel: ReleaseFn = state.cancel
    planner: Planner | None = None  # None: the rung's planner (static, mpu or cost)
    in_flight_wait: float = 1.0  # rank 0 holds a queued request back while an admitted
    #   request computes its prefix, until those blocks are published on every stage, for
    #   at most this many times what recomputing them would take by the fitted cost model
    #   (DESIGN §4b). 1: never wait longer than recomputing; 0: never wait
    queue_order: str = attrs.field(default="fcfs", validator=attrs.validators.in_(QUEUE_ORDERS))
    #   rank 0's waiting queue inside a priority class (wavepp.queueing): "fcfs", by
    #   arrival; "edf", earliest deadline first — requests with a deadline (``deadline_s``)
    #   by their absolute deadline, then those without one by arrival. Classes stay
    #   strict either way. FCFS is the default: under sustained load EDF lets a stream of
    #   requests with deadlines starve those without one in the same class

    @property
    def escrow_within_room(self) -> bool:
        """Whether ``escrow`` and ``reconcile`` declare that an escrow holds wherever the
        stage has room for it (:class:`wavepp.state.Guarantee`): then a round whose
        stages all have room for every offer's whole prompt needs no escrow collective
        (``rounds.admission.spare_room``)."""
        within_room = Guarantee.ESCROW_WITHIN_ROOM in guarantees_of(self.escrow)
        return within_room and Guarantee.RECONCILE_ONLY_FREES in guarantees_of(self.reconcile)

    def empty_cache(
        self, capacity: int, *, has_recurrent: bool = False, snapshot_capacity: int | None = None
    ) -> StageCache:
        """A stage cache whose materializations follow this policy's eviction order."""
        return state.empty_cache(
            capacity,
            has_recurrent=has_recurrent,
            snapshot_capacity=snapshot_capacity,
            eviction=self.eviction,
        )

    def describe(self) -> dict[str, str]:
        """Field -> the dotted name of what fills it, for the run's JSON record."""
        out = {}
        for field in attrs.fields(Policy):
            value = getattr(self, field.name)
            out[field.name] = _dotted(value)
        return out


def _dotted(value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return "rung default"
    if isinstance(value, Eviction | EscrowOrder):
        return value.name
    module = getattr(value, "__module__", None)
    name = getattr(value, "__qualname__", None)
    return f"{module}:{name}" if module and name else repr(value)


DEFAULT = Policy()
"""Today's runtime: the logarithmic probe (tree walk + bisections), FCFS escrow, LRU
leaf-first eviction, snapshots every interval, at request ends and at junctions,
in-flight prefix sharing, the rung's planner, FCFS inside each priority class."""

EDF = attrs.evolve(DEFAULT, name="edf", queue_order="edf")
"""The default with earliest-deadline-first inside each priority class (``--policy edf``)."""
