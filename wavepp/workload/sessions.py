"""Multi-turn conversation traces in Mooncake's format, seeded (docs/fleet.md).

A trace line is what :func:`wavepp.workload.read_trace` reads: ``timestamp`` (ms),
``input_length``, ``output_length`` and ``hash_ids`` (one id per 512 tokens), plus two
fields Mooncake's traces do not have, ``session`` and ``turn``, so that a replay can keep
a conversation's order (a turn is sent only once the previous one is answered).

Each conversation (a *session*) starts at a Poisson arrival. Its first prompt is the
shared head — ``system_blocks`` ids every request of the trace starts with, then one of
``num_apps`` application prompts of ``app_blocks`` ids — and a first user message; each
later turn is the previous prompt, the model's answer to it and a new user message, sent
once the answer has been decoded (``output_length`` at :data:`DECODE_TOK_S`) and the user
has thought (lognormal). So every request shares the first block(s), and a
conversation's later turns extend its earlier ones.

The ids follow the replay's rule that an id always stands for the same 512 tokens (cut
to ``input_length`` in the last block): a turn keeps every id of the previous turn,
including the one of its last, partial block, and continues with new ids. Replayed, the
previous turn's tokens are exactly the first tokens of the next turn.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import attrs
import numpy as np

from wavepp.workload.generators import VOCAB, RequestSpec
from wavepp.workload.trace import TRACE_BLOCK, read_trace, trace

DECODE_TOK_S = 40.0  # tokens a second a user sees an answer decoded at (the think clock)


@attrs.frozen
class Lognormal:
    """A lognormal draw by its median and the sigma of its log, clipped to [low, high]."""

    median: float
    sigma: float
    low: float
    high: float

    def draw(self, rng: np.random.Generator) -> float:
        value = self.median * float(np.exp(self.sigma * rng.standard_normal()))
        return min(max(value, self.low), self.high)


@attrs.frozen
class SessionShape:
    """What the conversations of a trace look like. Token counts are prompt tokens."""

    name: str
    num_sessions: int  # conversations in the trace
    sessions_per_s: float  # mean rate of new conversations (Poisson), per trace second
    mean_turns: float  # turns of a conversation: 1 + geometric, this mean
    max_turns: int  # and at most this many
    system_blocks: int  # ids every request starts with (the system prompt, 512 tokens each)
    num_apps: int  # application prompts after it; a conversation uses one
    app_blocks: int  # ids of one application prompt
    first_tokens: Lognormal  # the first user message (a question, a document, a task)
    user_tokens: Lognormal  # each later user message (or tool output)
    answer_tokens: Lognormal  # each answer, part of the next turn's prompt
    think_s: Lognormal  # from an answer's end to the next message, trace seconds
    max_input: int  # a conversation ends before its prompt would pass this

    @property
    def head_tokens(self) -> int:
        """Tokens every request of the trace starts with (system and application prompt)."""
        return (self.system_blocks + self.app_blocks) * TRACE_BLOCK


def _shape(name: str, sessions: tuple[int, float], turns: tuple[float, int],
           head: tuple[int, int, int], first: Lognormal, user: Lognormal, answer: Lognormal,
           think: Lognormal, max_input: int) -> SessionShape:  # fmt: skip
    return SessionShape(name, *sessions, *turns, *head, first, user, answer, think, max_input)


SHAPES: dict[str, SessionShape] = {
    shape.name: shape
    for shape in (
        # chat: short questions and answers, long pauses, a few turns
        _shape("chat", sessions=(240, 1.0), turns=(4.0, 12), head=(1, 6, 1),
               first=Lognormal(900, 0.8, 64, 8000), user=Lognormal(250, 0.8, 16, 4000),
               answer=Lognormal(350, 0.6, 32, 2000), think=Lognormal(15.0, 0.7, 2.0, 120.0),
               max_input=32_768),
        # documents: a long first message (a file to read), short follow-ups
        _shape("docs", sessions=(160, 0.6), turns=(3.5, 10), head=(2, 4, 1),
               first=Lognormal(7000, 0.5, 1000, 24000), user=Lognormal(150, 0.7, 16, 2000),
               answer=Lognormal(300, 0.6, 32, 2000), think=Lognormal(20.0, 0.6, 3.0, 120.0),
               max_input=49_152),
        # agent: a tool-laden system prompt, many fast turns of tool output
        _shape("agent", sessions=(80, 0.3), turns=(10.0, 30), head=(4, 3, 2),
               first=Lognormal(1200, 0.6, 64, 8000), user=Lognormal(900, 0.9, 32, 8000),
               answer=Lognormal(150, 0.6, 16, 1000), think=Lognormal(1.5, 0.8, 0.2, 20.0),
               max_input=32_768),
    )
}  # fmt: skip


def _ids(count: int, start: int) -> list[int]:
    return list(range(start, start + count))


def session_trace(shape: SessionShape, seed: int) -> list[dict]:
    """The trace's lines in arrival order (ties by session, then turn)."""
    rng = np.random.default_rng([seed, 58])
    next_id = 0
    system = _ids(shape.system_blocks, next_id)
    next_id += shape.system_blocks
    apps = []
    for _ in range(shape.num_apps):
        apps.append(_ids(shape.app_blocks, next_id))
        next_id += shape.app_blocks
    lines: list[dict] = []
    start = 0.0
    for session in range(shape.num_sessions):
        start += float(rng.exponential(1.0 / shape.sessions_per_s))
        turns = min(int(rng.geometric(1.0 / max(shape.mean_turns, 1.0))), shape.max_turns)
        ids = [*system, *apps[int(rng.integers(shape.num_apps))]]
        length = len(ids) * TRACE_BLOCK
        clock, answer = start, 0
        for turn in range(turns):
            message = shape.first_tokens if turn == 0 else shape.user_tokens
            added = answer + round(message.draw(rng))  # the last answer, then the message
            if length + added > shape.max_input:
                break
            length += added
            fresh = -(-length // TRACE_BLOCK) - len(ids)  # the last id may be a partial block
            ids += _ids(fresh, next_id)
            next_id += fresh
            answer = round(shape.answer_tokens.draw(rng))
            lines.append({"timestamp": round(clock * 1000), "input_length": length,
                          "output_length": answer, "hash_ids": list(ids),
                          "session": session, "turn": turn})  # fmt: skip
            clock += answer / DECODE_TOK_S + shape.think_s.draw(rng)
    lines.sort(key=lambda line: (line["timestamp"], line["session"], line["turn"]))
    return lines


def write_trace(lines: Sequence[dict], path: str | Path) -> None:
    with open(path, "w") as f:
        for line in lines:
            f.write(json.dumps(line, separators=(", ", ": ")) + "\n")


def read_sessions(path: str | Path, limit: int | None = None) -> list[tuple[int, int] | None]:
    """``(session, turn)`` of each row :func:`wavepp.workload.read_trace` keeps, in its
    order (None where a line has none): what a replay keeps in order."""
    rows, _ = read_trace(path, limit)
    wanted = {row["line"] for row in rows}
    found: dict[int, tuple[int, int] | None] = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if number in wanted:
                row = json.loads(line)
                session, turn = row.get("session"), row.get("turn")
                ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (session, turn))
                found[number] = (session, turn) if ok else None
    return [found[row["line"]] for row in rows]


def previous_turns(sessions: Sequence[tuple[int, int] | None]) -> list[int | None]:
    """For each request, the index of its session's previous turn (None for a first turn
    or a line without a session): what a replay sends it after."""
    last: dict[int, tuple[int, int]] = {}  # session -> (turn, index) of its latest turn
    out: list[int | None] = []
    for i, key in enumerate(sessions):
        if key is None:
            out.append(None)
            continue
        session, turn = key
        before = last.get(session)
        out.append(before[1] if before is not None and before[0] < turn else None)
        last[session] = (turn, i)
    return out


def replay_order(path: str | Path, limit: int | None, seed: int, block_size: int = 64,
                 vocab: int = VOCAB) -> tuple[list[RequestSpec], list[int | None]]:  # fmt: skip
    """A trace's requests (:func:`wavepp.workload.trace`, arrivals in trace seconds) and,
    for each, the request it must follow (its session's previous turn, or None)."""
    specs = trace(path, limit, seed, block_size, open_loop=True, vocab=vocab)
    return specs, previous_turns(read_sessions(path, limit))
