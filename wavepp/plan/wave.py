"""Plans are data: chunks and waves, with a short text form that parses back."""

from __future__ import annotations

import re

import attrs

from wavepp.state.ids import RequestId


@attrs.frozen
class Chunk:
    """Tokens ``start..end-1`` of one request, run by every stage in one wave."""

    request_id: RequestId
    start: int  # first token position computed (≥ the request's reuse point in tokens)
    end: int  # one past the last; end - start ≥ 1
    num_tokens: int  # the request's whole prompt length; end == num_tokens ends it

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def is_last(self) -> bool:
        return self.end == self.num_tokens

    def __str__(self) -> str:
        return f"{self.request_id}[{self.start}:{self.end}/{self.num_tokens}]"


@attrs.frozen
class Wave:
    """One micro-batch: chunks whose sizes sum to at most the budget it was planned at."""

    wave_id: int
    budget: int  # the token budget b the planner chose for this wave
    chunks: tuple[Chunk, ...]

    @property
    def num_tokens(self) -> int:
        return sum(c.size for c in self.chunks)

    def __str__(self) -> str:
        return f"w{self.wave_id}@{self.budget}: " + " ".join(str(c) for c in self.chunks)


_CHUNK = re.compile(r"^(?P<rid>[^\s\[\]]+)\[(?P<start>\d+):(?P<end>\d+)/(?P<n>\d+)\]$")
_WAVE = re.compile(r"^w(?P<wid>\d+)@(?P<budget>\d+):(?P<rest>.*)$")


def parse_wave(text: str) -> Wave:
    """Inverse of ``str(wave)``."""
    match = _WAVE.match(text.strip())
    if match is None:
        raise ValueError(f"not a wave: {text!r}")
    chunks = []
    for part in match["rest"].split():
        piece = _CHUNK.match(part)
        if piece is None:
            raise ValueError(f"not a chunk: {part!r} in {text!r}")
        chunks.append(
            Chunk(RequestId(piece["rid"]), int(piece["start"]), int(piece["end"]), int(piece["n"]))
        )
    return Wave(int(match["wid"]), int(match["budget"]), tuple(chunks))
