"""One pipeline stage's execution side (the LOOP of DESIGN §3), minus the transport.

``Stage.execute`` takes a wave descriptor and incoming activations (on stage 0: the
wave's prompts, from rank 0's request table), applies the cache effects the reducers
decide — materialize just before first use, publish computed blocks, release finished
requests — and runs the executor in between. It is ``begin`` (the cache effects before
the run) then ``finish`` (the run, then those after it); ``finish_looking_ahead`` does the
next wave's ``begin`` while this wave's executor runs, so that host work leaves the
pipeline's path (DESIGN §3, *Host work off the path*).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

import anyio
import attrs
import numpy as np
import torch

from wavepp.exec import compute
from wavepp.exec.base import ChunkWork, Executor, StageOutput
from wavepp.handoff.base import BandJob, HandoffSettings
from wavepp.handoff.send import HandoffSender
from wavepp.kv_events.changes import StageLog
from wavepp.policy import DEFAULT, ChunkSpan, Policy
from wavepp.rounds.admission import Offer, StageBook
from wavepp.rounds.errors import ProtocolError
from wavepp.rounds.messages import (
    CacheReport,
    ChunkMsg,
    OracleAdmit,
    Span,
    WaveMsg,
    unpack_hashes,
)
from wavepp.state import RequestId, block_table, num_blocks_for, resume_slot, usage


@attrs.frozen
class Prepared:
    """A wave whose cache effects are done (``Stage.begin``), ready to run."""

    wave: WaveMsg
    works: list[ChunkWork]
    prompts: Mapping[RequestId, np.ndarray] | None
    host_s: float  # seconds of cache effects, admission waits excluded


@attrs.frozen
class Ahead:
    """The next wave, taken while one ran: its activations or prompts, its payload for
    the caller (stage 0's plan), and its preparation when it could start early. A wave
    of None: there is no next wave (stage 0 planned its stop)."""

    wave: WaveMsg | None
    activations: torch.Tensor | None = None
    prompts: Mapping[RequestId, np.ndarray] | None = None
    payload: object = None
    prepared: Prepared | None = None
    launched: Launched | None = None


@attrs.define
class Launched:
    """A prepared wave whose run started: ``done`` is set when the executor ended it."""

    prepared: Prepared
    done: anyio.Event = attrs.field(factory=anyio.Event)
    output: StageOutput = attrs.field(factory=lambda: StageOutput(None, 0.0, {}))
    t0: float = 0.0  # perf_counter when the run started
    started: float = 0.0  # wall clock when the run started


@attrs.frozen
class Admitted:
    offer: Offer
    point: int  # agreed reuse point in blocks


def offer_from_entry(entry) -> Offer:
    return Offer(entry.request_id, entry.num_tokens, unpack_hashes(entry.hashes),
                 entry.probe_limit, entry.handoff)


class Stage:
    def __init__(
        self,
        index: int,
        book: StageBook,
        executor: Executor,
        block_size: int,
        snapshot_interval: int,
        has_recurrent: bool,
        policy: Policy = DEFAULT,
        handoff: HandoffSettings | None = None,
        cache_log: StageLog | None = None,
        record_spans: bool = False,
    ) -> None:
        """``record_spans``: keep every wave's span, for the timeline (--trace-out)."""
        self.index = index
        self.book = book
        self.executor = executor
        self.block_size = block_size
        self.snapshot_interval = snapshot_interval
        self.has_recurrent = has_recurrent
        self.policy = policy  # every cache effect below goes through its reducers
        self.requests: dict[RequestId, Admitted] = {}
        self._arrivals: dict[RequestId, anyio.Event] = {}
        self.busy_s = 0.0
        self.first_start: float | None = None
        self.last_end = 0.0
        self.num_waves = 0
        self.spans: list[Span] | None = [] if record_spans else None  # the timeline
        self.last_wave_s = 0.0  # wall seconds of the last wave executed here
        # Requests that ended here and whose band is on its way: their claims stay held
        # (blocks leased and referenced) until the sender settles them (docs/handoff.md).
        self.handing_off: set[RequestId] = set()
        # a worker thread's torch work keeps out of OpenMP (compute.serial_here)
        self.handoffs = (None if handoff is None
                         else HandoffSender(handoff, executor.band, self._handed_off,
                                            thread_setup=compute.serial_here))  # fmt: skip
        self.cache_log = cache_log  # with --kv-events: what this stage cached and evicted

    # -- admission side -----------------------------------------------------------

    def register(self, admitted: Admitted) -> None:
        """An admission round (or the oracle) admitted this request on this stage."""
        rid = admitted.offer.request_id
        self.requests[rid] = admitted
        self._arrivals.setdefault(rid, anyio.Event()).set()

    async def wait_admitted(self, rid: RequestId) -> Admitted:
        if rid not in self.requests:
            await self._arrivals.setdefault(rid, anyio.Event()).wait()
        return self.requests[rid]

    def apply_oracle(self, admits: Sequence[OracleAdmit]) -> None:
        """Oracle rung: apply rank 0's decisions; equal pools make them exact."""
        p = self.policy
        for admit in admits:
            offer = offer_from_entry(admit.entry)
            self.book.cache, got = p.lease(
                self.book.cache, offer.request_id, offer.hashes, admit.point
            )
            need = num_blocks_for(offer.num_tokens, self.block_size) - got
            self.book.cache, ok = p.escrow(self.book.cache, offer.request_id, need)
            if got != admit.point or not ok:
                raise ProtocolError(
                    f"oracle: stage {self.index} cannot follow rank 0 for {offer.request_id!r} "
                    f"(point {got} vs {admit.point}, escrow {ok}); use equal --capacity-blocks"
                )
            self.register(Admitted(offer, got))

    def drop(self, rid: RequestId) -> None:
        """Cancel whatever the request holds here: lease, escrow, slots, live state, a
        band on its way."""
        self.requests.pop(rid, None)
        self._arrivals.pop(rid, None)
        self.executor.cancel(rid)
        if rid in self.handing_off:
            # its band may be on the wire: the blocks stay held until the sender has
            # stopped reading them, then go as any band's do (_handed_off)
            self.handoffs.abort(rid)
        else:
            self.book.cache = self.policy.cancel(self.book.cache, rid)

    def forget(self, evicted: Sequence) -> None:
        """Blocks a materialization or a round evicted: gone from the executor (and, with
        KV events, reported to rank 0)."""
        self.executor.forget(evicted)
        if self.cache_log is not None and evicted:
            self.cache_log.evicted(evicted)

    def figures(self) -> dict[str, float]:
        """Busy seconds, the pool's blocks and the handoff sender's counts (bands parked
        for pulling, pulls refused), for metrics (the cache is a value, the counts plain
        numbers: safe to read from the watchdog's thread)."""
        use = usage(self.book.cache)
        handoffs = {} if self.handoffs is None else self.handoffs.figures()
        # balanced: 1 while the stage holds nothing for any request (the leak check's
        # condition, live: 1 whenever no request is in flight)
        return {"busy_s": self.busy_s, "cached": use.num_cached, "free": use.num_free,
                "capacity": use.capacity, "leases": use.num_leases,
                "escrowed": use.num_escrowed, "balanced": float(use.balanced),
                **handoffs}  # fmt: skip

    def sizes(self) -> dict[str, int]:
        """How many entries this stage's per-request books hold."""
        return {"stage_requests": len(self.requests), "stage_arrivals": len(self._arrivals),
                "stage_handing_off": len(self.handing_off),
                "stage_probe_us": len(self.book.probe_us),
                "stage_refusals": len(self.book.refusals)}  # fmt: skip

    def limits(self) -> dict[str, int]:
        return {"stage_probe_us": self.book.probe_us.maxlen or 0}

    def take_cache_report(self) -> CacheReport | None:
        """This stage's cache changes since the last report (None without --kv-events)."""
        return None if self.cache_log is None else self.cache_log.take(self.book.cache)

    # -- handoff ------------------------------------------------------------------

    def _hand_off(self, work: ChunkWork, admitted: Admitted, output: StageOutput,
                  prompt: np.ndarray | None) -> None:  # fmt: skip
        rid = work.request_id
        token, logit = output.results.get(rid, (-1, 0.0))
        states = self.executor.take_final(rid) if self.has_recurrent else {}
        self.handing_off.add(rid)
        self.handoffs.send(BandJob(
            request_id=rid, target=admitted.offer.handoff, num_tokens=work.num_tokens,
            # the table after publishing: a block another request had cached meanwhile
            # is read from that request's slot, the wave's own having gone back to the pool
            block_table=block_table(self.book.cache, rid), states=states,
            tokens=prompt,
            first_token=token, top_logit=logit,
        ))  # fmt: skip

    def _handed_off(self, rid: RequestId) -> None:
        """Its band ended (acknowledged, failed or cancelled): release what it held, once."""
        if rid in self.handing_off:
            self.handing_off.discard(rid)
            self.book.cache = self.policy.release(self.book.cache, rid)

    # -- execution side -----------------------------------------------------------

    def _prepare(self, chunk: ChunkMsg, admitted: Admitted,
                 prompt: np.ndarray | None) -> ChunkWork:  # fmt: skip
        bs, p = self.block_size, self.policy
        rid = chunk.request_id
        claim = self.book.cache.claims[rid]
        have = claim.held() + len(claim.pending_slots)
        need = num_blocks_for(chunk.end, bs) - have
        if need > 0:
            self.book.cache, done = p.materialize(self.book.cache, rid, need)
            self.forget(done.evicted)  # KV only: snapshots are slot-addressed
        held = claim.held()
        hashes = admitted.offer.hashes
        points: Sequence[int] = ()
        if self.has_recurrent:
            span = ChunkSpan(rid, hashes, held, chunk.end // bs,
                             ends_request=chunk.end == chunk.num_tokens,
                             interval=self.snapshot_interval,
                             starts_at_held=chunk.start == held * bs,
                             shared=tuple(chunk.shared))  # fmt: skip
            points = p.snapshot_placement(self.book.cache, span)
        before = self.book.cache
        self.book.cache, snaps = p.reserve_snapshots(before, rid, hashes, points)
        if self.cache_log is not None and snaps.points:
            self.cache_log.snapshots_evicted(before, self.book.cache)
        resume = None
        if self.has_recurrent and chunk.start and chunk.start == admitted.point * bs:
            # its first chunk here: the recurrent state comes from the lease point's
            # snapshot (later chunks continue the executor's live state)
            resume = resume_slot(self.book.cache, hashes, admitted.point)
            if resume is None:
                raise ProtocolError(f"stage {self.index}: no snapshot to resume {rid!r} at "
                                    f"token {chunk.start}")  # fmt: skip
        return ChunkWork(
            request_id=rid,
            start=chunk.start,
            end=chunk.end,
            num_tokens=chunk.num_tokens,
            block_table=block_table(self.book.cache, rid),
            snapshot_points=snaps.points,
            free=chunk.free,
            snapshot_slots=snaps.slots,
            resume_slot=resume,
            tokens=None if prompt is None else prompt[chunk.start : chunk.end],
            handoff=(self.handoffs is not None and bool(admitted.offer.handoff)
                     and chunk.end == chunk.num_tokens),
        )

    def _publish(self, work: ChunkWork, output: StageOutput,
                 prompt: np.ndarray | None) -> None:  # fmt: skip
        admitted = self.requests[work.request_id]
        p = self.policy
        end_blocks = work.end // self.block_size
        before = self.book.cache
        self.book.cache = p.publish(before, work.request_id, admitted.offer.hashes,
                                    end_blocks)  # fmt: skip
        if self.cache_log is not None:
            self.cache_log.published(before, self.book.cache, admitted.offer.hashes,
                                     before.claims[work.request_id].held(), end_blocks,
                                     prompt, self.block_size)  # fmt: skip
        if work.is_last:
            if work.handoff and self.handoffs is not None:
                self._hand_off(work, admitted, output, prompt)  # released when its band ended
            else:
                self.book.cache = p.release(self.book.cache, work.request_id)
            del self.requests[work.request_id]
            self._arrivals.pop(work.request_id, None)

    async def execute(
        self, wave: WaveMsg, activations: torch.Tensor | None,
        prompts: Mapping[RequestId, np.ndarray] | None = None,
    ) -> tuple[StageOutput, list[tuple[RequestId, int]]]:
        """Run one wave on this stage; returns the output and (request, cached tokens) ended.

        ``prompts``: stage 0's input, each chunk's request's token ids (the whole prompt:
        the chunk's slice is embedded, the whole is handed on and published with KV
        events); None on the other stages, which take ``activations``."""
        return await self.finish(await self.begin(wave, prompts), activations)

    async def begin(self, wave: WaveMsg,
                    prompts: Mapping[RequestId, np.ndarray] | None = None) -> Prepared:  # fmt: skip
        """The wave's cache effects before it runs: materialize, place and reserve
        snapshots. Waits first for the rounds that admit its requests here; cancelled in
        that wait, it has changed nothing (the oracle's admits aside, which a wave run
        ahead never carries)."""
        if wave.oracle and self.index != 0:  # rank 0 decided them on its own cache
            self.apply_oracle(wave.oracle)
        for chunk in wave.chunks:
            if chunk.request_id not in self.requests:  # its round is still under way
                await self.wait_admitted(chunk.request_id)
        t0 = time.perf_counter()
        works = [self._prepare(c, self.requests[c.request_id], _prompt(prompts, c.request_id))
                 for c in wave.chunks]  # fmt: skip
        return Prepared(wave, works, prompts, time.perf_counter() - t0)

    async def finish(self, prepared: Prepared, activations: torch.Tensor | None,
                     ) -> tuple[StageOutput, list[tuple[RequestId, int]]]:  # fmt: skip
        """Run a wave ``begin`` prepared, then publish what it computed, release the
        requests it ended and drop the ones it cancels."""
        run = Launched(prepared)
        await self._run(run, activations)
        return run.output, self._settle(run)

    async def _run(self, run: Launched, activations: torch.Tensor | None) -> None:
        """The executor's part of a wave; sets ``run.done`` when it ended."""
        works = run.prepared.works
        run.t0, run.started = time.perf_counter(), time.time()
        if works:  # else a wave that only carries cancels
            run.output = await self.executor.run(works, activations)
            if self.spans is not None:
                tokens = sum(w.end - w.start for w in works)
                free = all(w.free for w in works)
                self.spans.append(Span(run.prepared.wave.wave_id, run.started, time.time(),
                                       tokens, free))  # fmt: skip
        run.done.set()

    def _settle(self, run: Launched) -> list[tuple[RequestId, int]]:
        """A wave's cache effects after its run: publish, release, drop its cancels."""
        wave, works, prompts = run.prepared.wave, run.prepared.works, run.prepared.prompts
        output = run.output
        ended = []
        for work in works:
            if work.is_last:
                ended.append(
                    (work.request_id, self.requests[work.request_id].point * self.block_size)
                )
            self._publish(work, output, _prompt(prompts, work.request_id))
        for rid in wave.cancels:  # none of their chunks come after this wave
            self.drop(RequestId(rid))
        if not works:
            self.last_wave_s = 0.0
            return ended
        # This stage's whole time on the wave — cache effects, executor, publishing; not
        # the wait for an admission round — for the cost planner (WaveMsg.stage_s).
        host = run.prepared.host_s + time.perf_counter() - run.t0
        self.last_wave_s = max(output.seconds, host)
        if output.seconds and not all(w.free for w in works):
            self.busy_s += output.seconds
            self.first_start = run.started if self.first_start is None else self.first_start
            self.last_end = time.time()
            self.num_waves += 1
        return ended

    async def finish_looking_ahead(
        self, current: Prepared | Launched, activations: torch.Tensor | None,
        take_next: Callable[[], Awaitable[Ahead]], runs: anyio.abc.TaskGroup,
    ) -> tuple[tuple[StageOutput, list[tuple[RequestId, int]]], Ahead | None]:
        """``finish`` the current wave (``current``: prepared, or already running) and
        meanwhile, while its executor runs, the next wave's host work: ``take_next()``
        receives (or plans) it and, when none of its requests is in this wave (whose
        publishing a request's next chunk reads), ``begin`` prepares it. A next wave
        prepared by the time this one's run ends starts running at once (a task in
        ``runs``), before this one's publishing. Returns the result and the next wave as
        far as it got: untaken (None), taken, prepared (``Ahead.prepared``) or running
        (``Ahead.launched``)."""
        ahead: Ahead | None = None
        run = current if isinstance(current, Launched) else Launched(current)
        running = {w.request_id for w in run.prepared.works}

        async def look() -> None:
            nonlocal ahead
            ahead = await take_next()
            nxt = ahead.wave
            if nxt is None or nxt.stop or nxt.oracle:
                return
            if any(c.request_id in running for c in nxt.chunks):
                return
            ahead = attrs.evolve(ahead, prepared=await self.begin(nxt, ahead.prompts))

        async with anyio.create_task_group() as tg:
            tg.start_soon(look)
            if run is current:
                await run.done.wait()
            else:
                await self._run(run, activations)
            tg.cancel_scope.cancel()  # a wait for a round or a wave is moot now
        if ahead is not None and ahead.prepared is not None and ahead.prepared.works:
            launched = Launched(ahead.prepared)
            ahead = attrs.evolve(ahead, launched=launched)
            runs.start_soon(self._run, launched, ahead.activations)
            await anyio.sleep(0)  # it starts (the executor has the wave) before publishing
        return (run.output, self._settle(run)), ahead


def _prompt(prompts: Mapping[RequestId, np.ndarray] | None, rid: RequestId) -> np.ndarray | None:
    return None if prompts is None else prompts[rid]
