"""The executor protocol: what a stage runs for one wave (DESIGN §6)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import attrs
import numpy as np
import torch

from wavepp.state import BlockHash, RequestId, SlotId
from wavepp.transport.frames import DataLimits

if TYPE_CHECKING:
    from wavepp.handoff.base import BandJob, BandTensor


@attrs.frozen
class ChunkWork:
    """One chunk as this stage runs it, with the cache effects already decided."""

    request_id: RequestId
    start: int  # first token computed; tokens 0..start-1 are in the cache (KV + snapshot)
    end: int  # one past the last token computed
    num_tokens: int  # the whole prompt; end == num_tokens means the request ends here
    block_table: tuple[SlotId, ...]  # KV slot of every block 0..blocks(end)-1
    snapshot_points: tuple[int, ...]  # block counts after which to save recurrent state
    free: bool  # warm-up chunk: run for its cache effects, not charged
    # Snapshot pool slot (0..snapshot_capacity-1) to save the state into, per snapshot
    # point, same order.
    snapshot_slots: tuple[int, ...] = ()
    resume_slot: int | None = None  # slot holding the state after block start/bs - 1
    tokens: np.ndarray | None = None  # stage 0: token ids start..end-1
    handoff: bool = False  # the request hands its cache on: on its last chunk, keep its
    #                        final recurrent states for the band (TorchExecutor.take_final)

    @property
    def is_last(self) -> bool:
        return self.end == self.num_tokens


@attrs.frozen
class StageOutput:
    activations: torch.Tensor | None  # to the next stage; None on the last stage
    seconds: float  # executor busy time charged to this stage
    results: dict[RequestId, tuple[int, float]]  # last stage: first token, top logit


@runtime_checkable
class Executor(Protocol):
    """Everything the runtime calls on a stage's executor (``docs/executors.md``).

    WavePP owns the KV pool's slots and the block tables: the state reducers decide
    which slot holds which block, and an executor only reads the rows of the block
    tables it is given and writes the rows of the tokens it computes. It keeps no cache
    of its own that outlives WavePP's decisions: what :meth:`forget` names is gone, and
    nothing is cached or evicted behind the state's back.
    """

    simulated: bool  # True: times are predicted, not measured (labelled in every output)
    has_recurrent: bool  # the stage holds recurrent mixers: its cache keeps snapshots

    async def run(
        self, chunks: Sequence[ChunkWork], activations: torch.Tensor | None
    ) -> StageOutput:
        """Run one wave; ``activations`` come from the previous stage (None on stage 0).

        Every chunk's slots were materialized before the call; the executor may write
        the rows of tokens ``start..end-1`` and the snapshot slots it is given, and
        read rows ``0..start-1`` (and the snapshot it resumes from)."""
        ...

    def forget(self, evicted: Sequence[BlockHash]) -> None:
        """The state dropped these blocks (and their snapshots): their slots may be
        reused by the next materialization; drop anything kept for them."""
        ...

    def cancel(self, request_id: RequestId) -> None:
        """Drop the request's live per-request state (recurrent states, logits). Its
        slots are released by the state, after the chunks already in flight."""
        ...

    def memory_report(self) -> dict[str, int]:
        """Bytes (and counts) held by kind, e.g. ``weights_bytes``, ``kv_pool_bytes``."""
        ...

    def prior_cost(self) -> tuple[float, float, float, float]:
        """(a, c, d, floor) seconds for the cost planner's prior: a wave of t tokens
        after p cached ones costs about ``d + max(floor, a·t + c·t·(p + t/2))``."""
        ...

    def limits(self, budget: int) -> DataLimits:
        """What the stage's data-plane links carry for waves of at most ``budget``
        tokens: the activations' rows, width and dtype."""
        ...

    def take_final(self, request_id: RequestId) -> dict[int, dict[str, torch.Tensor]]:
        """The recurrent states after a handed-off request's last token, by layer and
        part (``ChunkWork.handoff``); empty when the stage keeps none."""
        ...

    def band(self, job: BandJob) -> list[BandTensor]:
        """This stage's band of an ended request's cache, for the handoff sender."""
        ...

    def describe(self) -> list[str]:
        """Lines for the log: how the stage computes (its attention kernel, what was
        compiled); none where there is nothing to say."""
        ...

    def finish(self) -> str:
        """The run ended (not interrupted): stop whatever runs beside the executor; ""
        when all is well, else what went wrong (for the leak check)."""
        ...
