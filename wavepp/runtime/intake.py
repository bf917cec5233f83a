"""Request intake on rank 0: every check a request passes, once, before it is queued.

Every request — from a workload generator, a requests file, the Python API or the HTTP
server — enters through :meth:`Intake.submit`, the one place its id, priority, deadline
and prompt (token ids: integers, a flat non-empty list inside the vocabulary, short
enough for the smallest stage pool) are checked. What passes is queued in the request
table (``wavepp.runtime.table``) with its int32 token ids; they travel from there with
its chunks to stage 0 (``StageZero``) and are not checked again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from wavepp.ids import id_problem
from wavepp.rounds.admission import Offer
from wavepp.runtime.records import Record, RequestRejected
from wavepp.runtime.table import RequestTable
from wavepp.state import RequestId, block_hashes, num_blocks_for
from wavepp.workload import MAX_DEADLINE_S, RequestSpec

NO_VOCAB_LIMIT = 2**31  # the sim executor: any int32 id
# where a request's cache goes (``wavepp.runtime.handoff.HandoffTargets``)
HandoffTarget = Callable[[RequestSpec], str]


def prompt_ids(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """A prompt as an integer array; RequestRejected ("invalid") if it is not a flat list
    of integers (its ids and length are :meth:`Intake.submit`'s to check)."""
    if isinstance(tokens, np.ndarray):
        array = tokens
    else:
        if not all(isinstance(t, int | np.integer) and not isinstance(t, bool) for t in tokens):
            raise RequestRejected("token ids must be integers", "invalid")
        array = np.asarray(list(tokens), dtype=np.int64)
    if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
        raise RequestRejected("a prompt is a flat list of integer token ids", "invalid")
    return array


class Intake:
    def __init__(
        self, table: RequestTable, block_size: int, min_capacity: int, vocab_size: int | None,
        handoff_target: HandoffTarget | None = None,
    ) -> None:  # fmt: skip
        """``handoff_target(spec)``: the address a request that asks for a handoff sends
        its cache to (raises RequestRejected); None: this run hands nothing on."""
        self.table = table
        self.block_size = block_size
        self.min_capacity = min_capacity
        self.vocab_size = vocab_size  # None: any int32 id (the sim executor)
        self.handoff_target = handoff_target

    def _problem(self, tokens: np.ndarray) -> tuple[str, str] | None:
        """(why, reason) this prompt can never run, or None."""
        n = tokens.size
        if n == 0:
            return "empty prompt (need at least one token)", "invalid"
        top = self.vocab_size if self.vocab_size is not None else NO_VOCAB_LIMIT
        bad = tokens[(tokens < 0) | (tokens >= top)]
        if bad.size:
            return (f"{bad.size:,} token ids outside the vocabulary 0..{top - 1}, "
                    f"e.g. {int(bad[0])}"), "invalid"  # fmt: skip
        blocks = num_blocks_for(n, self.block_size)
        if blocks > self.min_capacity:
            return (f"prompt of {n:,} tokens needs {blocks:,} blocks; "
                    f"the smallest stage pool holds {self.min_capacity:,}"), "too_long"  # fmt: skip
        return None

    def submit(self, spec: RequestSpec, priority: Any = 0) -> Record:
        """Queue a request for admission. Raises :class:`RequestRejected` with its reason
        for bad input; a well-formed prompt that can never run is also recorded (and
        streamed to subscribers), as rejected."""
        table = self.table
        if table.draining:
            raise RequestRejected("draining: no new requests are taken", "draining")
        problem = id_problem(spec.request_id)  # the one id rule (wavepp.ids.ID_RULE)
        if problem:
            raise RequestRejected(problem, "invalid")
        rid = RequestId(spec.request_id)
        if table.taken(rid):
            raise RequestRejected(f"duplicate request id {rid!r}", "duplicate")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise RequestRejected(f"priority must be an integer, got {priority!r}", "invalid")
        deadline_s = spec.deadline_s
        if deadline_s is not None and not (isinstance(deadline_s, int | float)
                                           and not isinstance(deadline_s, bool)
                                           and 0 < deadline_s <= MAX_DEADLINE_S):  # fmt: skip
            raise RequestRejected(f"deadline_s must be a number of seconds in (0, "
                                  f"{MAX_DEADLINE_S:g}], got {deadline_s!r}", "invalid")
        tokens = prompt_ids(spec.tokens)
        problem = self._problem(tokens)
        tokens = tokens.astype(np.int32, copy=False)  # in range: the ids the stages see
        if tokens is not spec.tokens:
            spec = attrs.evolve(spec, tokens=tokens)
        now = time.time()
        hashes = block_hashes(tokens, self.block_size) if tokens.size else ()
        limit = max(tokens.size - 1, 0) // self.block_size
        target = ""
        if spec.handoff not in (None, False, ""):
            if self.handoff_target is None:
                raise RequestRejected("this run hands no cache on (handoff needs the torch "
                                      "executor)", "invalid")  # fmt: skip
            target = self.handoff_target(spec)
        record = Record(spec, Offer(rid, spec.num_tokens, hashes, limit, target), priority, now)
        if problem is not None:
            why, reason = problem
            table.reject(record, why)  # a rejected request leaves no trace: its id is free
            raise RequestRejected(f"request {rid!r}: {why}", reason)
        table.add(record, None if deadline_s is None else now + deadline_s)
        return record
