"""The seam between a stage's sender and the ways a band travels (``docs/handoff.md``).

A stage gives a finished request's :class:`BandJob` to its one
:class:`~wavepp.handoff.send.HandoffSender`, which owns what every band shares whatever
carries it — the byte budget, the worker threads, the deadline, a cancel, the outcome —
and hands the band, as a :class:`Band`, to the :class:`Transport` that serves its
address's kind. A transport's one job is :meth:`Transport.deliver`: the band to its
receiver and the receiver's acknowledgement back, or :class:`BandFailed` with a reason
from ``REASONS``. One implementation per transport: ``socket_send.SocketTransport``
(``unix:`` and ``tcp://``, WavePP's wire) and ``pull.PullTransport`` (``pull:``: the band
waits on the stage's band server until a decoder pulls it; vLLM's ``WavePPConnector``
pulls this way). A new one is one class with ``kinds``, ``parks``, ``address``, ``run``,
``figures`` and ``deliver``, given to the sender.

A push transport's band takes its turn (:meth:`Band.turn`: its tensors laid out, the
byte budget held) before ``deliver`` is called, and must be acknowledged within the
sender's timeout of the request's last chunk. A parking transport's band waits for its
receiver under a lease instead, holding no budget: once the receiver has come the
transport calls :meth:`Band.claim` (the lease stops, the timeout starts from now) and
takes the band's turn itself.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Protocol, TypeVar

import anyio
import anyio.to_thread
import attrs
import numpy as np
import torch

from wavepp.handoff import auth, wire

if TYPE_CHECKING:
    from wavepp.state import RequestId, SlotId

T = TypeVar("T")

# Why a band failed, as the record and /metrics count them.
# "expired": a parked band's lease ran out before a decoder pulled it.
REASONS = ("timeout", "connect", "refused", "disconnected", "bad ack", "cancelled", "expired",
           "error")
class BandFailed(Exception):
    """A band that did not go through: ``reason`` one of ``REASONS``, ``detail`` why."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


@attrs.frozen
class BandTensor:
    """One tensor of a band: its place and shape now, its bytes when read."""

    layer: int  # global layer index; -1 for the request's token ids
    name: str  # "k", "v", "latent", "delta", "conv", "state", "tokens"
    dtype: str  # a wire dtype name
    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]  # a contiguous CPU tensor; runs in a worker thread
    # the same bytes as views of where they live, in order (a CPU stage's pool: one
    # view per run of rows), sent without a copy; None: send read()'s bytes
    pieces: Callable[[], Iterator[memoryview]] | None = None
    # read() may wait on other ranks (a TP band's shards): never on the event loop
    waits: bool = False

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * wire.DTYPES[self.dtype]

    def views(self) -> Iterator[memoryview]:
        """The tensor's bytes as flat views: the pool's runs as they are, else what
        ``read()`` gives (one flat run: an n-D view would slice by rows)."""
        if self.pieces is not None:
            yield from self.pieces()
        else:
            yield self.read().reshape(-1).view(torch.uint8).numpy().data


@attrs.frozen
class BandJob:
    """What a stage hands its sender when a request that hands off ends there."""

    request_id: RequestId
    target: str  # unix:/path, tcp://host:port or pull: (a peer's string: parsed here)
    num_tokens: int  # the whole prompt
    block_table: tuple[SlotId, ...]  # every block of the prompt, full or partial
    states: dict  # recurrent layer -> {part: state after the prompt's last token}
    tokens: np.ndarray | None  # stage 0: the prompt's token ids
    first_token: int = -1  # last stage: the first generated token
    top_logit: float = 0.0
    ended_at: float = attrs.field(factory=time.monotonic)  # the last chunk here, for timeouts
    ended_wall: float = attrs.field(factory=time.time)  # the same, wall clock (the record)


@attrs.frozen
class HandoffSettings:
    """One stage's handoff side, fixed for the run."""

    stage: int
    num_stages: int
    fingerprint: wire.Fingerprint  # the model this stage computes with
    timeout_s: float  # last chunk -> acknowledgement, per band
    budget_bytes: int  # bands on their way at once, bytes
    # bands of up to this many bytes go out from the event loop, without a worker thread
    # (0: never; a CPU stage's: INLINE_BYTES; a GPU stage's rows need copies to the host)
    inline_bytes: int = 0
    # pull: targets: how long a band waits for its decoder from the request's last chunk
    # here, seconds (a pull under way is bounded by timeout_s from its start instead)
    lease_s: float = 30.0
    # this stage's band server (where decoders pull): unix:/path, tcp://HOST:PORT, "auto"
    # (a Unix socket in a private directory of its own), or None (no band server)
    serve: str | None = None
    # the host a tcp band server bound to a wildcard (0.0.0.0, ::) is reached at
    advertise: str | None = None
    # the shared secret (wavepp.handoff.auth): every band goes signed with it, and the
    # band server takes only pulls signed with it; None: bands unsigned, pulls unchecked
    secret: bytes | None = attrs.field(default=None, repr=False)
    # the run's id (every stage's the same: wavepp.launch.setup), the bands' sender: a
    # receiver keeps two runs' requests of equal ids apart by it
    sender: str = ""


@attrs.define(eq=False)
class Band:
    """One band on its way, as a transport gets it from the sender."""

    job: BandJob
    address: wire.Address  # parsed from job.target; its kind chose the transport
    deadline: float  # monotonic: the band is given up then (the sender's cancel scope)
    # the sender's: lays the band's tensors out and holds the byte budget while entered
    # (:meth:`turn`)
    take_turn: Callable[[Band], AbstractAsyncContextManager[None]]
    # the sender's: a parked band's receiver has come (:meth:`claim`)
    on_claim: Callable[[Band], None] = lambda band: None
    # what the stage's executor laid out for the job: empty until the band's turn
    tensors: Sequence[BandTensor] = ()
    claimed: bool = False  # a parked band's receiver has come
    # seconds on the wire, connect (or the pull's acceptance) to acknowledgement (or to
    # the failure): the transport sets it; bandwidth is bytes over it
    wire_s: float = 0.0

    def turn(self) -> AbstractAsyncContextManager[None]:
        """The band's turn to go out: its tensors laid out, the byte budget held."""
        return self.take_turn(self)

    def claim(self) -> None:
        """A parked band's receiver has come (call it on the event loop, with no await
        between the receiver's acceptance and this): the lease no longer runs, and the
        band has the sender's timeout from now."""
        if not self.claimed:
            self.claimed = True
            self.on_claim(self)

    @property
    def num_bytes(self) -> int:
        return sum(t.num_bytes for t in self.tensors)

    @property
    def peer(self) -> str:
        """Who receives the band, as messages name it."""
        return "the decoder pulling it" if self.address.kind == "pull" else self.job.target

    def header(self, settings: HandoffSettings) -> wire.BandHeader:
        """The band's header on WavePP's wire (signed with ``settings.secret``, if any)."""
        job = self.job
        return auth.sign_header(wire.BandHeader(
            request_id=job.request_id, stage=settings.stage, num_stages=settings.num_stages,
            fingerprint=settings.fingerprint,
            layers=sorted({t.layer for t in self.tensors if t.layer >= 0}),
            num_tokens=job.num_tokens,
            tensors=[wire.TensorSpec(t.layer, t.name, t.dtype, list(t.shape), t.num_bytes)
                     for t in self.tensors],
            first_token=job.first_token, top_logit=job.top_logit, sender=settings.sender,
        ), settings.secret)  # fmt: skip

    def check_ack(self, ack: wire.Ack, stage: int) -> int:
        """The payload bytes an acknowledgement of this band accepts; ``BandFailed`` for
        a refusal or an acknowledgement of another band."""
        job = self.job
        if ack.request_id != job.request_id or ack.stage != stage:
            raise BandFailed("bad ack", f"{self.peer} acknowledged {ack.request_id!r} stage "
                             f"{ack.stage}, not {job.request_id!r} stage {stage}")  # fmt: skip
        if not ack.ok:
            raise BandFailed("refused", ack.error or "the receiver refused the band")
        return self.num_bytes


class Transport(Protocol):
    """One way bands travel, for the address kinds in ``kinds``: one object per stage,
    built by the sender (``TransportClass``)."""

    kinds: tuple[str, ...]  # wire.Address kinds it serves
    # its bands wait for their receiver to come (a pull) under the sender's lease, and
    # take their turn themselves; False: the sender gives deliver a band whose turn it is
    parks: bool
    address: str | None  # where it serves receivers (a band server), as they reach it

    async def run(self) -> None:
        """Serve what the transport serves beside its bands (a band server's
        connections) until cancelled; returns at once for a transport that serves
        nothing."""
        ...

    def figures(self) -> dict[str, float]:
        """Its counts for metrics (the stage's figures; empty when it counts nothing)."""
        ...

    async def deliver(self, band: Band) -> int:
        """Hand the band to its receiver: the payload bytes acknowledged, or
        ``BandFailed``. Sets ``band.wire_s``. The sender's cancel scope (the deadline,
        a cancel) may end it at any wait; it returns only once nothing of it reads the
        band's tensors any more, as the stage releases their blocks then."""
        ...


class WorkerThreads:
    """The sender's worker threads, which every transport's blocking work shares: at
    most ``limit`` at once, counted apart from the rest of the process's (anyio's
    default limiter), each running ``setup`` before its work."""

    def __init__(self, limit: int, setup: Callable[[], None] = lambda: None) -> None:
        self.limiter = anyio.CapacityLimiter(limit)
        self.setup = setup

    async def run(self, fn: Callable[..., T], *args, abandon_on_cancel: bool = False) -> T:
        """``fn(*args)`` in one of the threads (``anyio.to_thread.run_sync``)."""

        def work() -> T:
            self.setup()
            return fn(*args)

        return await anyio.to_thread.run_sync(work, abandon_on_cancel=abandon_on_cancel,
                                              limiter=self.limiter)  # fmt: skip


# A transport's class: built with the stage's settings and the sender's worker threads.
TransportClass = Callable[[HandoffSettings, WorkerThreads], Transport]
