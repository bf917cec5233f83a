"""Rank 0's admission (DESIGN §3, §4): the WAVE task and the rung's admission mode.

- ``ROUNDS``: the WAVE task opens batched rounds on the rounds plane, off the
  execution path, whenever requests wait and room may have been freed.
- ``INLINE`` (R1): stage 0's LOOP admits one request per round before it plans.
- ``FREE`` (oracle): rank 0 decides alone, without collectives and without charging
  their time; the decisions ride with the next wave to every stage.

A refused head blocks admission until a request that held room ends (the request
table's ``capacity_epoch`` moves): rounds are not re-run when nothing could have changed.

In-flight prefix sharing (DESIGN §4b): a queued request whose leading blocks an
admitted request (or one offered earlier in the same round) is computing, beyond what
rank 0 has cached, is held back — not offered — until the producer's chunk covering
them has left the last stage (then every stage has published them and the round finds
them cached), the producer ends, or waiting would take longer than recomputing them
(measured pace, else the fitted cost model; once the covering chunk is in the pipeline
waiting is never slower). The dependency lives in a pure value (``wavepp.state.inflight``).
A held-back request does not block the queue: requests behind it are offered meanwhile
(it waits for compute already under way, not for room).

The WAVE task also beats on the rounds plane while idle, so the other ranks' rounds
followers see a live rank 0, and ends every rank's WAVE with ``Stop``.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

import anyio

from wavepp.exec.stage import Admitted, Stage
from wavepp.plan import Pending
from wavepp.rounds.admission import Offer, RoundCounters, RoundMode, probe_points, run_round
from wavepp.rounds.messages import (
    AdmitEntry,
    AdmitRound,
    Heartbeat,
    OracleAdmit,
    Stop,
    encode,
    pack_hashes,
)
from wavepp.rounds.plane import RoundsPlane
from wavepp.rungs import Admission, Rung
from wavepp.runtime.table import RequestTable
from wavepp.state import RequestId, attention_hit, empty_inflight, inflight, num_blocks_for

MISS_REASONS = ("no snapshot near the hit", "evicted", "in flight and not waited for",
                "stages disagreed", "cancelled")  # fmt: skip


HISTORY = 4096  # rounds whose times are kept (a server runs for weeks)


class Pacing(Protocol):
    """How long admitted work would take (``wavepp.runtime.pace.Pace``)."""

    def recompute_s(self, tokens: int, prefix: int, ahead: Sequence[tuple[int, int]]) -> float:
        """Seconds until a request admitted now would have computed ``tokens`` after
        ``prefix`` itself, behind the work ``ahead`` of it."""
        ...

    def work_ahead(self) -> list[tuple[int, int]]:
        """(tokens, prefix) of the admitted work not yet planned."""
        ...


def _entry(offer: Offer) -> AdmitEntry:
    return AdmitEntry(offer.request_id, offer.num_tokens, pack_hashes(offer.hashes),
                      offer.probe_limit, offer.handoff)  # fmt: skip


class Admitter:
    def __init__(
        self, rung: Rung, plane: RoundsPlane, stage: Stage, table: RequestTable,
        mode: RoundMode, max_batch: int, heartbeat_s: float, pacing: Pacing,
        on_admitted: Callable[[RequestId, int], None], timeline: bool = False,
    ) -> None:  # fmt: skip
        """``pacing``: whether waiting for a producer beats recomputing (0 s: never
        wait). ``on_admitted(request, agreed point in blocks)``: plan it. ``timeline``:
        keep every round's span for ``--trace-out``."""
        self.rung = rung
        self.plane = plane
        self.stage = stage
        self.table = table
        self.mode = mode  # the rung's reservation mode and the policy in use
        self.max_batch = max_batch
        self.heartbeat_s = heartbeat_s
        self.pacing = pacing
        self.on_admitted = on_admitted
        self.in_round: set[RequestId] = set()  # offered to the round under way
        self.refused_at_epoch: int | None = None  # blocked until the capacity epoch moves
        self.oracle_admits: list[OracleAdmit] = []  # FREE: to ride with the next wave
        self.round_id = 0
        self.num_rounds = 0  # admission rounds over the run
        self.round_seconds: deque[float] = deque(maxlen=HISTORY)  # wall seconds, recent rounds
        self.round_cpu_s: deque[float] = deque(maxlen=HISTORY)  # rank 0's CPU seconds in
        #                                                   recent rounds' own steps
        self._recent_spans: deque[float] = deque(maxlen=16)  # wall seconds, broadcast
        #                                           included, of recent rounds but the first
        self.timeline: list[tuple[float, float, int]] | None = [] if timeline else None
        self.counters = RoundCounters()  # disagreements, roll-backs, fallbacks: summed
        # Producers (admitted or offered, unfinished) and the queued requests waiting for
        # their blocks: a prefix among the producers' blocks is being computed.
        self.inflight = empty_inflight()
        # The furthest block each queued request was held back for: it waits again only
        # for blocks past it, so its waits cover disjoint blocks and their sum stays
        # within what recomputing its whole prefix would take.
        self.waited: dict[RequestId, int] = {}
        self.num_waits = 0  # requests held back for a producer, over the run
        # waiter -> (when it started waiting, the recompute it was weighed against): at
        # its deadline the estimate is redone with what has been measured since
        self._wait_basis: dict[RequestId, tuple[float, int, int, list[tuple[int, int]]]] = {}
        self._seen_here: dict[RequestId, tuple[int, int]] = {}  # rank 0's (hit, point)

    # -- shared by every mode ---------------------------------------------------------

    def blocked(self) -> bool:
        return self.refused_at_epoch == self.table.capacity_epoch

    def sizes(self) -> dict[str, int]:
        """How many entries each of the admitter's books holds."""
        return {"admitter_round_seconds": len(self.round_seconds),
                "admitter_round_cpu_s": len(self.round_cpu_s),
                "admitter_timeline": len(self.timeline or ()),
                "admitter_in_round": len(self.in_round),
                "admitter_oracle_admits": len(self.oracle_admits),
                "admitter_producers": len(self.inflight.producers),
                "admitter_waits": len(self.inflight.waits),
                "admitter_waited": len(self.waited),
                "admitter_seen": len(self._seen_here)}  # fmt: skip

    def limits(self) -> dict[str, int]:
        return {"admitter_round_seconds": HISTORY, "admitter_round_cpu_s": HISTORY}

    def _forget_ended(self) -> None:
        """Requests that ended (done, cancelled, failed, rejected) no longer compute their
        blocks: requests waiting for them may go."""
        for rid in self.table.take_ended():
            self.inflight = inflight.end(self.inflight, rid)
            self.waited.pop(rid, None)
            self._wait_basis.pop(rid, None)

    def ready(self) -> bool:
        """Some queued request may be offered now (not only requests held back)."""
        self._forget_ended()
        if not self.table.waiting or self.blocked():
            return False
        waits = self.inflight.waits
        if len(self.table.waiting) > len(waits):
            return True
        now = time.monotonic()
        self._revise(now)
        return any(inflight.can_go(self.inflight, rid, now) for rid in waits)

    def upcoming(self, enough_tokens: int) -> list[Pending]:
        """The queue's head as the planner's ``PlanContext.waiting``: requests the round
        under way or the next will offer (not held back for a producer; none while a
        refusal blocks admission), from rank 0's own reuse point, until they hold
        ``enough_tokens`` of work — at most 64 of them, so that a long queue of short
        prompts costs each plan no more than 64 probes."""
        if self.blocked():
            return []
        self._forget_ended()
        cache, bs, out, tokens = self.stage.book.cache, self.mode.block_size, [], 0
        for rid in self.table.waiting.head(min(self.max_batch, 64)):
            if tokens >= enough_tokens:
                break
            if rid in self.inflight.waits:
                continue
            offer = self.table[rid].offer
            start = self.mode.policy.probe(cache, offer.hashes, offer.probe_limit) * bs
            out.append(Pending(rid, start, offer.num_tokens))
            tokens += offer.num_tokens - start
        return out

    def round_latency_s(self) -> float:
        """A round's recent wall time, broadcast included (median of the last 16): how
        long a waiting request takes to reach the planner. The run's first round is left
        out — it pays the rounds plane's first use (over Gloo, 1.5-3x a later one here) —
        so this is 0 until a second round has run."""
        return statistics.median(self._recent_spans) if self._recent_spans else 0.0

    def next_deadline(self) -> float | None:
        """When the earliest held-back request may go whatever its producer does."""
        self._forget_ended()
        self._revise(time.monotonic())
        times = (inflight.deadline(self.inflight, rid) for rid in self.inflight.waits)
        return min((t for t in times if t is not None), default=None)

    def _revise(self, now: float) -> None:
        """Redo the estimate of a wait whose deadline passed, with what the pipeline has
        measured since it began (the first waits of a run rely on the cost model's
        prior alone): if recomputing, begun when the wait began, would still not be
        done, the deadline moves there. Deadlines only move later, never past that."""
        for rid in list(self.inflight.waits):
            at = inflight.deadline(self.inflight, rid)
            if at is None or at > now or rid not in self._wait_basis:
                continue
            began, tokens, prefix, ahead = self._wait_basis[rid]
            again = began + self.mode.policy.in_flight_wait * self.pacing.recompute_s(
                tokens, prefix, ahead
            )
            if again > at:
                self.inflight = inflight.extend(self.inflight, rid, again)

    def _holds_back(self, rid: RequestId, now: float, ahead: list[tuple[int, int]]) -> bool:
        """Hold ``rid`` back for a producer computing blocks it shares, if that is quicker
        than recomputing them behind the work ``ahead`` of it in this round
        (records the wait). Rank 0's own cache is no guide: stage 0 runs ahead of the
        others, so only the producer's ``done`` says what every stage has."""
        factor = self.mode.policy.in_flight_wait
        if factor <= 0:
            return False
        producer, shared, local = self._sharing(rid)
        if producer is None or shared <= local:
            return False
        bs = self.mode.block_size
        ahead = [*self.pacing.work_ahead(), *ahead]
        budget_s = factor * self.pacing.recompute_s((shared - local) * bs, local * bs, ahead)
        if budget_s <= 0:
            return False
        self.inflight = inflight.start_wait(self.inflight, rid, producer, shared, now + budget_s)
        self._wait_basis[rid] = (now, (shared - local) * bs, local * bs, ahead)
        self.waited[rid] = shared
        self.num_waits += 1
        return True

    def _sharing(self, rid: RequestId) -> tuple[RequestId | None, int, int]:
        """(producer, shared, published): the live producer holding the longest prefix
        ``rid`` shares, how many blocks that is, and how many of them are published
        everywhere or were already waited for (never again); ``(None, 0, 0)`` if none."""
        offer = self.table[rid].offer
        producer, shared = inflight.shared_prefix(self.inflight, offer.hashes, offer.probe_limit)
        if producer is None:
            return None, 0, 0
        return producer, shared, max(self.inflight.producers[producer].done,
                                     self.waited.get(rid, 0))  # fmt: skip

    def _published(self, rid: RequestId, local: int) -> int:
        """Of the ``local`` leading blocks rank 0 holds for ``rid``, those published on
        every stage as far as rank 0 can tell: all of them, unless a live producer holds
        some it has not yet published (stage 0 computes ahead of the others)."""
        producer, shared, published = self._sharing(rid)
        return local if producer is None or shared <= published else min(local, published)

    def _offers(self, limit: int) -> tuple[list[Offer], int]:
        # The epoch is read when the round starts: a request ending during the round
        # unblocks the next one (else a refusal could wait forever).
        batch: list[RequestId] = []
        ahead: list[tuple[int, int]] = []  # (tokens, prefix) the batch so far will compute
        cache, now = self.stage.book.cache, time.monotonic()
        bs = self.mode.block_size
        self._forget_ended()
        self._revise(now)
        # Under FCFS nothing after a refusal is admitted, so the batch ends with the first
        # offer that cannot fit rank 0's backable room even at its attention hit (it is
        # refused and blocks until room is freed): the rest would be probed, leased and
        # released for nothing (``rounds.admission.worth_offering``).
        room = cache.num_backable if self.mode.policy.escrow_order.first_come_first_served else None
        for rid in self.table.waiting.head():
            if len(batch) >= limit or (room is not None and room < 0):
                break
            if rid in self.inflight.waits:
                if not inflight.can_go(self.inflight, rid, now):
                    continue
                self.inflight = inflight.stop_wait(self.inflight, rid)
                self._wait_basis.pop(rid, None)
            o = self.table[rid].offer
            local = self.mode.policy.probe(cache, o.hashes, o.probe_limit)
            if self._holds_back(rid, now, ahead):
                continue
            batch.append(rid)
            start = local * bs
            ahead.append((o.num_tokens - start, start))
            # offered: siblings later in this round wait for the blocks it computes, not
            # for those it finds published (a seeded prefix, say)
            published = self._published(rid, local)
            self.inflight = inflight.add_producer(
                self.inflight, rid, o.hashes, published, admitted=False
            )
            hit = attention_hit(cache, o.hashes, o.probe_limit)
            if room is not None:
                room -= num_blocks_for(o.num_tokens, bs) - hit
            if self.table[rid].spec.expected_reuse > 0:
                self._seen_here[rid] = (hit, local)  # rank 0's own view, to explain a miss
        self.in_round.update(batch)
        return [self.table[rid].offer for rid in batch], self.table.capacity_epoch

    def _explain(self, rid: RequestId, point: int) -> str | None:
        """Why a request expecting reuse got less than 80% of it (rank 0's view), or None."""
        record = self.table[rid]
        seen = self._seen_here.pop(rid, None)
        expected = record.spec.expected_reuse // self.mode.block_size
        if seen is None or point >= 0.8 * expected:
            return None
        hit, local = seen
        hashes = record.offer.hashes
        others = self.inflight.holders.get(hashes[point], ()) if point < len(hashes) else ()
        if any(r != rid and self.inflight.producers[r].done <= point for r in others):
            return "in flight and not waited for"  # another live request computes it
        if local > point:
            return "stages disagreed"  # rank 0 could serve more than the agreed point
        if hit > local:
            return "no snapshot near the hit"
        return "evicted"

    def progress(self, rid: RequestId, end_token: int) -> None:
        """A chunk of ``rid`` ending at ``end_token`` left the last stage: its blocks are
        published on every stage."""
        self._forget_ended()
        self.inflight = inflight.progress(self.inflight, rid, end_token // self.mode.block_size)

    def sending(self, rid: RequestId, start_token: int, end_token: int) -> list[int]:
        """A chunk of ``rid`` enters the pipeline: the block counts in it where requests
        waiting for ``rid`` branch off (recurrent stages save snapshots there)."""
        bs = self.mode.block_size
        self._forget_ended()
        self.inflight = inflight.sent(self.inflight, rid, end_token // bs)
        return list(inflight.junctions(self.inflight, rid, start_token // bs, end_token // bs))

    def _apply(
        self, offers: Sequence[Offer], admitted: Sequence[bool], points: Sequence[int], epoch: int
    ) -> None:
        """Apply a round's outcome. The policy's escrow order may admit offers that are
        not a prefix of the round (only FCFS's cut is); every refusal blocks further
        rounds until room is freed."""
        now = time.time()
        self._forget_ended()  # requests that ended while the round ran
        self.in_round.clear()
        taken = [o.request_id for o, ok in zip(offers, admitted, strict=True) if ok]
        if len(taken) < len(offers):
            self.refused_at_epoch = epoch
        self.table.waiting.pop_admitted(taken)
        for offer, ok, point in zip(offers, admitted, points, strict=True):
            if not ok:
                self._seen_here.pop(offer.request_id, None)
                self.inflight = inflight.end(self.inflight, offer.request_id)  # frees waiters
                continue
            self.table.admitted(offer.request_id, now, self._explain(offer.request_id, point))
            self.inflight = inflight.add_producer(self.inflight, offer.request_id, offer.hashes,
                                                  done=point)  # fmt: skip
            self.on_admitted(offer.request_id, point)
        for rid in self.table.waiting.head():  # cancelled while offered, and refused
            if self.table[rid].cancelled:
                self.table.waiting.remove(rid)
                self.table.settle_cancel(rid)
        self.table.changed.notify()

    async def _round(self, limit: int) -> None:
        trace = self.plane.trace
        trace.mark("offers", ahead=True)
        offers, epoch = self._offers(limit)
        if not offers:  # every ready request was held back for a producer
            return
        self.round_id += 1
        started = time.time()
        async with self.plane.lock:
            # rank 0's own probes end the first mask window of each offer
            trace.mark("anchors", ahead=True)
            anchors = probe_points(self.stage.book.cache, offers, self.mode)
            message = encode(AdmitRound(self.round_id, [_entry(o) for o in offers], anchors))
            trace.mark("encoded", ahead=True)
            await self.plane.broadcast(message)
            result = await run_round(self.plane, self.stage.book, offers, self.mode, anchors)
        ended = time.time()
        self.num_rounds += 1
        self.round_seconds.append(result.seconds)
        self.round_cpu_s.append(result.cpu_s)
        if self.num_rounds > 1:  # the first pays the rounds plane's first use
            self._recent_spans.append(ended - started)
        if self.timeline is not None:
            self.timeline.append((started, ended, len(offers)))
        self.counters += result.counters
        for offer, ok, point in zip(offers, result.admitted, result.points, strict=True):
            if ok:
                self.stage.register(Admitted(offer, point))
        self.stage.forget(result.evicted)
        self._apply(offers, result.admitted, result.points, epoch)
        trace.mark("applied")

    def _admit_free(self) -> None:
        """The oracle: the same decisions as a round, on rank 0's cache, for free."""
        t0, cpu = time.perf_counter(), time.thread_time()
        offers, epoch = self._offers(len(self.table.waiting))
        if not offers:  # every ready request was held back for a producer
            return
        book, p = self.stage.book, self.mode.policy
        flags, points = [], []
        for offer in offers:
            point = probe_points(book.cache, [offer], self.mode, book.probe_us)[0]
            cache, point = p.lease(book.cache, offer.request_id, offer.hashes, point)
            need = num_blocks_for(offer.num_tokens, self.mode.block_size) - point
            cache, ok = p.escrow(cache, offer.request_id, need)
            flags.append(ok)
            points.append(point)
            if not ok:
                book.cache = p.release(cache, offer.request_id)
                break
            book.cache = cache
            self.stage.register(Admitted(offer, point))
            self.oracle_admits.append(OracleAdmit(_entry(offer), point))
        self.num_rounds += 1
        self.round_seconds.append(time.perf_counter() - t0)
        self.round_cpu_s.append(time.thread_time() - cpu)
        for offer in offers[len(flags) :]:  # not tried after the refusal: back to waiting
            self.in_round.discard(offer.request_id)
            self._seen_here.pop(offer.request_id, None)
            self.inflight = inflight.end(self.inflight, offer.request_id)
        self._apply(offers[: len(flags)], flags, points, epoch)

    async def admit_on_path(self) -> None:
        """Called by stage 0's LOOP before it plans (INLINE and FREE modes)."""
        if self.rung.admission is Admission.INLINE:
            while self.ready():
                await self._round(1)
        elif self.rung.admission is Admission.FREE and self.ready():
            self._admit_free()

    def take_oracle_admits(self) -> list[OracleAdmit]:
        admits, self.oracle_admits = self.oracle_admits, []
        return admits

    # -- the WAVE task ------------------------------------------------------------------

    async def run(self) -> None:
        """Batched rounds (ROUNDS mode) and heartbeats (every mode), then Stop."""
        rounds = self.rung.admission is Admission.ROUNDS
        last = time.monotonic()
        while not (self.table.closed and not self.table.num_unfinished):
            if rounds and self.ready():
                await self._round(self.max_batch)
                last = time.monotonic()
                await anyio.sleep(0)  # let the LOOP plan before the next round
                continue
            timeout = self.heartbeat_s
            deadline = self.next_deadline()  # a held-back request may go then
            if deadline is not None:
                timeout = min(timeout, max(deadline - time.monotonic(), 0.0) + 1e-3)
            await self.table.changed.wait(timeout=timeout)
            if time.monotonic() - last >= self.heartbeat_s:
                self.round_id += 1
                async with self.plane.lock:
                    await self.plane.broadcast(encode(Heartbeat(self.round_id)))
                last = time.monotonic()
        self.round_id += 1
        async with self.plane.lock:
            await self.plane.broadcast(encode(Stop(self.round_id, "all requests finished")))
