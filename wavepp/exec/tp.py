"""Tensor parallelism inside a stage (``--tp T``): one voice per stage.

The world is P x T ranks; stage ``s`` is global ranks ``s*T .. s*T + T-1`` (adjacent, so
torchrun puts a stage's ranks on one node). Each rank holds its shard of the stage's
layers and pools (``wavepp.model.tp``): attention and linear-attention heads with their
KV rows and recurrent states, MLP widths, MoE experts; the layers all-reduce their partial
outputs over the stage's *compute* group.

The stage's first rank, its **leader**, is the stage as the rest of the runtime knows it:
it takes part in the admission rounds, keeps the stage's cache book, and carries the
data plane's waves to and from the neighbouring stages' leaders. The other ranks, its
**followers**, keep no book and take part in no round: they run exactly what the
leader's executor is asked to run, in the order it is asked. :class:`TPLeader` wraps the
leader's executor and posts every call (a wave's chunks with their block tables and
snapshot slots and the wave's activations; ``cancel``; a band's shards) to each follower,
from a thread of its own, before running it itself; :func:`follow_leader` runs them on a
follower. So the T ranks hold the same cache decisions because there is one decider.
The posts travel as the data plane's frames over Gloo pair groups (leader -> follower):
every header is checked before anything is allocated, the descriptor is msgpack, and a
follower checks every chunk's slots and token ids against its own pools before it runs
it. At the end of a run each follower reports a digest of what it ran and of its
executor's per-request state; the leader compares them with its own, and a
disagreement fails the stage's leak check (``stage_report``).

Why the followers take their activations from the leader rather than from the previous
stage's followers: every rank of a stage holds the whole activations after the
all-reduce, so rank ``t`` of stage ``s`` could send to rank ``t`` of stage ``s + 1``
directly; but the leader must send them to its followers with the wave's chunks anyway
(only the leader knows the cache decisions), and one path keeps a wave's descriptor and
its tensor in one message. The cost is one more copy of ``tokens x d_model`` values per
wave and follower, over Gloo (``docs/design.md`` §6b).

A request that hands its cache off leaves its leader whole: when the leader's sender
takes the band, the leader posts the request's block table, each follower sends its
shard of every split tensor back over a pair group of its own (:func:`send_shards`), and
the leader puts each tensor together as its sender reaches it (:class:`ShardInbox`,
``wavepp.model.tp.gather_shards``).
"""

from __future__ import annotations

import datetime
import hashlib
import queue
import threading
import time
from collections.abc import Sequence
from functools import partial

import attrs
import msgspec
import numpy as np
import torch
import torch.distributed as dist

from wavepp.exec.base import ChunkWork, StageOutput
from wavepp.exec.torch_exec import TorchExecutor
from wavepp.handoff.base import BandJob, BandTensor
from wavepp.model.tp import cache_rule, gather_shards, replicated, whole_shape
from wavepp.rounds.messages import decode_untrusted
from wavepp.state import BlockHash, RequestId
from wavepp.transport.base import PlaneError, plane_error
from wavepp.transport.frames import MAX_TENSOR_BYTES, DataLimits
from wavepp.transport.gloo import GlooLink, gloo_links
from wavepp.transport.planes import Leaders


@attrs.frozen
class TPLayout:
    """Where a global rank sits: its stage and its place in the stage."""

    world: int
    tp: int
    rank: int

    def __attrs_post_init__(self) -> None:
        if self.tp < 1 or self.world % self.tp:
            raise ValueError(f"--tp {self.tp} does not divide the {self.world} ranks")

    @property
    def stages(self) -> int:
        return self.world // self.tp

    @property
    def stage(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def leaders(self) -> list[int]:
        """The global rank of every stage's leader, by stage."""
        return [s * self.tp for s in range(self.stages)]

    def members(self, stage: int) -> list[int]:
        return list(range(stage * self.tp, (stage + 1) * self.tp))


@attrs.frozen
class StageGroups:
    """This rank's process groups beyond the world's (made on every rank, same order)."""

    leaders: Leaders  # the stages' leaders, between whom the rounds and data planes run
    compute: dist.ProcessGroup  # this stage's ranks: the layers' all-reduces
    posts: list[GlooLink]  # leader: one per follower; a follower: the one from its leader
    shards: list[GlooLink]  # the other way: a follower's shards of a band, to its leader


def make_groups(layout: TPLayout, timeout_s: float, device: torch.device) -> StageGroups:
    """Every group a TP run needs. ``dist.new_group`` is collective over the world, so
    every rank makes every group, in the same order, and keeps its own."""
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    group = dist.new_group(layout.leaders, backend="gloo", timeout=timeout)
    links = gloo_links(layout.rank, layout.stages, timeout_s, None, device, layout.leaders)
    leaders = Leaders(group, layout.stage, layout.stages, links)
    compute, posts, shards = None, [], []
    for s in range(layout.stages):
        members = layout.members(s)
        reduce = dist.new_group(members, backend=backend, timeout=timeout)
        if s == layout.stage:
            compute = reduce
        for follower in members[1:]:
            # descriptors and activations both over Gloo: a follower's activations come
            # through host memory (the leader's are already there on CPU)
            pair = dist.new_group([members[0], follower], backend="gloo", timeout=timeout)
            back = dist.new_group([members[0], follower], backend="gloo", timeout=timeout)
            if layout.rank in (members[0], follower):
                posts.append(GlooLink(pair, members[0], follower, device=device))
                shards.append(GlooLink(back, follower, members[0], _SHARD_LIMITS))
    assert compute is not None
    return StageGroups(leaders, compute, posts, shards)


# -- the posts: what a leader's executor is asked, in the order it is asked --------------


class PostedChunk(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    request_id: str
    start: int
    end: int
    num_tokens: int
    block_table: list[int]
    snapshot_points: list[int]
    free: bool
    snapshot_slots: list[int]
    resume_slot: int | None
    tokens: list[int] | None
    handoff: bool


class RunPost(msgspec.Struct, tag="run", array_like=True, forbid_unknown_fields=True):
    chunks: list[PostedChunk]


class CancelPost(msgspec.Struct, tag="cancel", array_like=True, forbid_unknown_fields=True):
    request_id: str


class BandPost(msgspec.Struct, tag="band", array_like=True, forbid_unknown_fields=True):
    """Send the leader your shards of this request's band (it hands its cache off)."""

    request_id: str
    block_table: list[int]
    num_tokens: int


class StopPost(msgspec.Struct, tag="stop", array_like=True, forbid_unknown_fields=True):
    pass


Post = RunPost | CancelPost | BandPost | StopPost


class Shard(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """A follower's shard of tensor ``index`` of a request's band (its bytes follow);
    ``index`` -1: the follower has stopped."""

    request_id: str
    index: int


# A shard is one layer's keys, values or state for this rank's heads: bytes as uint8.
_SHARD_LIMITS = DataLimits(max_descriptor_bytes=4096, max_tokens=MAX_TENSOR_BYTES,
                           dtypes=frozenset({torch.uint8}))  # fmt: skip
_ENCODER = msgspec.msgpack.Encoder()


def _posted(c: ChunkWork) -> PostedChunk:
    tokens = None if c.tokens is None else np.asarray(c.tokens).tolist()
    return PostedChunk(c.request_id, c.start, c.end, c.num_tokens, list(c.block_table),
                       list(c.snapshot_points), c.free, list(c.snapshot_slots), c.resume_slot,
                       tokens, c.handoff)  # fmt: skip


def _work(c: PostedChunk) -> ChunkWork:
    tokens = None if c.tokens is None else np.asarray(c.tokens, dtype=np.int64)
    return ChunkWork(RequestId(c.request_id), c.start, c.end, c.num_tokens,
                     tuple(c.block_table), tuple(c.snapshot_points), c.free,
                     tuple(c.snapshot_slots), c.resume_slot, tokens, c.handoff)  # fmt: skip


class PostError(RuntimeError):
    """A leader's post that this follower cannot run (a bad or inconsistent message)."""


def check_chunks(chunks: Sequence[PostedChunk], executor: TorchExecutor,
                 rows: int | None) -> None:  # fmt: skip
    """Everything a follower's executor would index with, against its own pools, before
    it runs the wave: positions, block-table slots, snapshot slots, token ids, and the
    activations' rows (None: stage 0, which embeds the chunks' tokens)."""
    blocks = next((len(p) for pools in executor.pools.values() for p in pools.values()), 0)
    capacity = blocks // executor.block_size if blocks else None
    snapshots = executor.snapshot_capacity
    vocab = executor.cfg.vocab_size
    total = 0
    for c in chunks:
        where = f"request {c.request_id[:80]!r}"
        if not 0 <= c.start <= c.end <= c.num_tokens:
            raise PostError(f"{where}: tokens {c.start}..{c.end} of {c.num_tokens}")
        total += c.end - c.start
        if len(c.block_table) * executor.block_size < c.end:
            raise PostError(f"{where}: {len(c.block_table)} blocks cannot hold {c.end} tokens")
        if capacity is not None and any(not 0 <= s < capacity for s in c.block_table):
            raise PostError(f"{where}: a block-table slot outside the pool of {capacity}")
        given = [*c.snapshot_slots, *([] if c.resume_slot is None else [c.resume_slot])]
        if any(not 0 <= s < snapshots for s in given):
            raise PostError(f"{where}: a snapshot slot outside the pool of {snapshots}")
        if rows is None:
            if c.tokens is None or len(c.tokens) != c.end - c.start:
                raise PostError(f"{where}: stage 0 needs the chunk's {c.end - c.start} tokens")
            if any(not 0 <= t < vocab for t in c.tokens):
                raise PostError(f"{where}: a token id outside the vocabulary of {vocab}")
    if rows is not None and rows != total:
        raise PostError(f"a wave of {total} tokens came with activations for {rows}")


def check_band(post: BandPost, executor: TorchExecutor) -> None:
    """A band a follower is asked for: its block table holds the prompt, inside the pool."""
    blocks = next((len(p) for pools in executor.pools.values() for p in pools.values()), 0)
    capacity = blocks // executor.block_size
    where = f"band of {post.request_id[:80]!r}"
    if not 1 <= post.num_tokens <= len(post.block_table) * executor.block_size:
        raise PostError(f"{where}: {len(post.block_table)} blocks for {post.num_tokens} tokens")
    if blocks and any(not 0 <= s < capacity for s in post.block_table):
        raise PostError(f"{where}: a block-table slot outside the pool of {capacity}")


def send_shards(post: BandPost, executor: TorchExecutor, link: GlooLink) -> None:
    """A follower: its shard of every split tensor of the request's band, in the band's
    order, to its leader (MLA's latent, whole on every rank, the leader sends itself)."""
    rid = RequestId(post.request_id)
    job = BandJob(rid, "", post.num_tokens, tuple(post.block_table), executor.take_final(rid),
                  None)  # fmt: skip
    index = 0
    for tensor in executor.band(job):
        if replicated(cache_rule(executor.cfg, tensor.layer, tensor.name)):
            continue
        data = tensor.read()
        link.send_blocking(_ENCODER.encode(Shard(rid, index)), data.view(torch.uint8).reshape(-1))
        index += 1


class ShardInbox:
    """The leader's side of a TP stage's handoff: its followers' shards of the bands it
    asked for, kept until its sender reads them or for ``keep_s`` (a band that failed or
    was cancelled leaves its shards behind; they go then). One reader thread per follower."""

    def __init__(self, links: Sequence[GlooLink], keep_s: float) -> None:
        self._links = list(links)
        self.keep_s = keep_s
        self._ready = threading.Condition()
        # (request, index) -> {follower: shard bytes}, and when the first came
        self._shards: dict[tuple[str, int], dict[int, torch.Tensor]] = {}
        self._since: dict[tuple[str, int], float] = {}
        self._failure: str | None = None
        self._readers = [threading.Thread(target=self._read, args=(f, link), daemon=True,
                                          name=f"wavepp-tp-shards-{f}")
                         for f, link in enumerate(self._links)]  # fmt: skip
        for reader in self._readers:
            reader.start()

    def _read(self, follower: int, link: GlooLink) -> None:
        try:
            while True:
                descriptor, data = link.recv_blocking(4096)
                shard = decode_untrusted(descriptor, Shard)
                if shard.index < 0:
                    return
                if data is None:
                    raise PostError(f"a shard of {shard.request_id[:80]!r} without its bytes")
                key = (shard.request_id, shard.index)
                with self._ready:
                    self._expire()
                    self._since.setdefault(key, time.monotonic())
                    self._shards.setdefault(key, {})[follower] = data
                    self._ready.notify_all()
        except Exception as error:  # the run fails on its own (the watchdog names why)
            with self._ready:
                self._failure = f"{type(error).__name__}: {error}"
                self._ready.notify_all()

    def _expire(self) -> None:
        old = time.monotonic() - self.keep_s
        for key in [k for k, since in self._since.items() if since < old]:
            del self._since[key], self._shards[key]

    def take(self, rid: str, index: int, timeout_s: float) -> list[torch.Tensor]:
        """Every follower's shard of tensor ``index`` of ``rid``'s band, in rank order."""
        key = (rid, index)
        with self._ready:
            got = self._ready.wait_for(
                lambda: self._failure or len(self._shards.get(key, ())) == len(self._links),
                timeout_s)  # fmt: skip
            if self._failure:
                raise PlaneError(f"the stage's TP ranks stopped sending shards: {self._failure}")
            if not got:
                raise TimeoutError(f"the stage's TP ranks sent no shards of {rid!r} within "
                                   f"{timeout_s:g} s")  # fmt: skip
            self._since.pop(key)
            shards = self._shards.pop(key)
        return [shards[f] for f in range(len(self._links))]

    def join(self) -> None:
        for reader in self._readers:
            reader.join()


class _Digest:
    """What a rank of a stage ran, and its executor's per-request state at the end."""

    def __init__(self) -> None:
        self._hash = hashlib.blake2b(digest_size=16)

    def ran(self, descriptor: bytes, tensor: torch.Tensor | None) -> None:
        self._hash.update(len(descriptor).to_bytes(8, "little") + descriptor)
        self._hash.update((0 if tensor is None else tensor.shape[0]).to_bytes(8, "little"))

    def final(self, executor: TorchExecutor) -> bytes:
        state = {"live": sorted(executor.live), "finals": sorted(executor.finals)}
        self._hash.update(msgspec.json.encode(state))
        return self._hash.digest()


def _agree(group: dist.ProcessGroup, digest: bytes, size: int) -> list[bytes]:
    mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
    every = [torch.zeros_like(mine) for _ in range(size)]
    try:
        dist.all_gather(every, mine, group=group)
    except RuntimeError as error:
        raise plane_error("the stage's TP ranks' end-of-run digests", error) from None
    return [t.numpy().tobytes() for t in every]


def stage_built(groups: StageGroups) -> None:
    """Wait until every rank of this stage has built its shard."""
    try:
        dist.barrier(group=groups.compute)
    except RuntimeError as error:
        raise plane_error("waiting for the stage's TP ranks to build their shards",
                          error) from None  # fmt: skip


class TPLeader:
    """The leader's executor: every call is posted to the stage's followers, then run
    here (the protocol of ``wavepp.exec.base.Executor``)."""

    simulated = False

    def __init__(self, local: TorchExecutor, groups: StageGroups, tp: int,
                 handoff_timeout_s: float) -> None:  # fmt: skip
        """``handoff_timeout_s``: how long a band may wait for its followers' shards (a
        band not acknowledged within it fails anyway)."""
        self.local = local
        self.has_recurrent = local.has_recurrent
        self._cfg = local.cfg  # how each cache tensor splits over the ranks (band)
        self._groups, self._tp = groups, tp
        self._digest = _Digest()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._failure: BaseException | None = None
        self._poster = threading.Thread(target=self._post_all, name="wavepp-tp-posts",
                                        daemon=True)  # fmt: skip
        self._poster.start()
        self.handoff_timeout_s = handoff_timeout_s
        self._inbox = ShardInbox(groups.shards, keep_s=handoff_timeout_s + 10.0)

    def _post(self, post: Post, tensor: torch.Tensor | None = None) -> None:
        if self._failure is not None:
            raise PlaneError(f"posting to this stage's TP ranks failed: {self._failure}")
        descriptor = _ENCODER.encode(post)
        self._digest.ran(descriptor, tensor)
        self._outbox.put((descriptor, tensor))

    def _post_all(self) -> None:
        while True:
            descriptor, tensor = self._outbox.get()
            try:
                for link in self._groups.posts:
                    link.send_blocking(descriptor, tensor)
            except BaseException as error:  # the watchdog names a dead follower
                self._failure = error
                return
            if descriptor == _STOP:
                return

    async def run(self, chunks: Sequence[ChunkWork],
                  activations: torch.Tensor | None) -> StageOutput:  # fmt: skip
        self._post(RunPost([_posted(c) for c in chunks]), activations)
        return await self.local.run(chunks, activations)

    def forget(self, evicted: Sequence[BlockHash]) -> None:
        """Nothing to tell the followers: the state owns every slot (``forget`` keeps
        nothing on a torch executor)."""
        self.local.forget(evicted)

    def cancel(self, rid: RequestId) -> None:
        self._post(CancelPost(rid))
        self.local.cancel(rid)

    def take_final(self, rid: RequestId) -> dict:
        return self.local.take_final(rid)

    def band(self, job: BandJob) -> list[BandTensor]:
        """The stage's whole band: this rank's tensors, each split one put together with
        the followers' shards (asked for now, sent at once, read as the sender reads)."""
        self._post(BandPost(job.request_id, list(job.block_table), job.num_tokens))
        out, index = [], 0
        for tensor in self.local.band(job):
            rule = None if tensor.layer < 0 else cache_rule(self._cfg, tensor.layer, tensor.name)
            if rule is None or replicated(rule):  # token ids, MLA's latent: whole here
                out.append(tensor)
                continue
            out.append(BandTensor(tensor.layer, tensor.name, tensor.dtype,
                                  whole_shape(rule, tensor.shape, self._tp),
                                  partial(self._whole, job.request_id, index, tensor, rule),
                                  waits=True))  # fmt: skip
            index += 1
        return out

    def _whole(self, rid: RequestId, index: int, own: BandTensor, rule) -> torch.Tensor:
        mine = own.read()
        shards, size = [mine], mine.numel() * mine.element_size()
        for data in self._inbox.take(rid, index, self.handoff_timeout_s):
            if data.numel() != size:
                raise PostError(f"a TP rank's shard of {rid!r} tensor {index} has "
                                f"{data.numel()} bytes, this rank's {size}")  # fmt: skip
            shards.append(data.view(mine.dtype).reshape(mine.shape))
        return gather_shards(rule, shards).contiguous()

    def memory_report(self) -> dict[str, int]:
        return self.local.memory_report()  # this rank's shards

    def prior_cost(self) -> tuple[float, float, float, float]:
        return self.local.prior_cost()

    def limits(self, budget: int) -> DataLimits:
        return self.local.limits(budget)

    def describe(self) -> list[str]:
        return self.local.describe()

    def set_limits(self, limits: DataLimits) -> None:
        for link in self._groups.posts:
            link.set_limits(limits)

    def finish(self) -> str:
        """Stop the followers; "" when every one ran what this rank ran and holds the
        same per-request state, else what differs (for the leak check)."""
        self._post(StopPost())
        self._poster.join()
        if self._failure is not None:
            return f"posting to this stage's TP ranks failed: {self._failure}"
        self._inbox.join()  # every follower said it stopped
        digests = _agree(self._groups.compute, self._digest.final(self.local), self._tp)
        odd = [t for t, d in enumerate(digests) if d != digests[0]]
        return (f"TP ranks {odd} of this stage ran other waves or hold other request state "
                "than its leader" if odd else "")  # fmt: skip


_STOP = _ENCODER.encode(StopPost())


def follow_leader(executor: TorchExecutor, groups: StageGroups, tp: int,
                  first: bool) -> None:  # fmt: skip
    """A follower: run the leader's posts until it stops, then report the digest."""
    (link,), (back,) = groups.posts, groups.shards
    digest = _Digest()
    while True:
        descriptor, tensor = link.recv_blocking()
        post = decode_untrusted(descriptor, Post)
        digest.ran(descriptor, tensor)
        if isinstance(post, RunPost):
            if first != (tensor is None):
                raise PostError("stage 0 embeds its tokens; later stages take activations")
            check_chunks(post.chunks, executor, None if tensor is None else tensor.shape[0])
            executor.forward([_work(c) for c in post.chunks], tensor)
        elif isinstance(post, CancelPost):
            executor.cancel(RequestId(post.request_id))
        elif isinstance(post, BandPost):
            check_band(post, executor)
            send_shards(post, executor, back)
        else:
            break
    back.send_blocking(_ENCODER.encode(Shard("", -1)), None)
    _agree(groups.compute, digest.final(executor), tp)


# -- the start: what a follower builds ----------------------------------------------------


class StagePlan(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """What a follower builds, as its leader agreed it with the other stages: the stage's
    half-layer units ``[start, stop)``, whether it is the first and the last stage, and
    its pools."""

    units: list[int]
    first: bool
    last: bool
    capacity: int
    snapshot_capacity: int


_MAX_SLOTS = 1 << 31


def send_plan(groups: StageGroups, plan: StagePlan | None) -> None:
    """The leader: tell every follower what to build (None: the run has nothing to run)."""
    for link in groups.posts:
        link.send_blocking(_ENCODER.encode(plan), None)


def receive_plan(groups: StageGroups, num_layers: int) -> StagePlan | None:
    """A follower: its leader's plan, checked against the model before anything is built."""
    (link,) = groups.posts
    descriptor, tensor = link.recv_blocking(4096)
    plan = decode_untrusted(descriptor, StagePlan | None)
    if tensor is not None:
        raise PostError("the leader's stage plan came with a tensor")
    if plan is None:
        return None
    ok = (len(plan.units) == 2 and 0 <= plan.units[0] < plan.units[1] <= 2 * num_layers
          and 1 <= plan.capacity < _MAX_SLOTS and 1 <= plan.snapshot_capacity < _MAX_SLOTS)
    if not ok:
        raise PostError(f"the leader sent an unusable stage plan {plan!r} for a model of "
                        f"{num_layers} layers")  # fmt: skip
    return plan
