"""The bytes on the wire, and the checks every peer's bytes pass before anything is
allocated for them. Nothing here is unpickled: headers are fixed-size integers, payloads
raw bytes or little-endian int64.

- **Data-plane header** (both link kinds): ten int64 words — magic, sender, descriptor
  length, dtype code, number of dims, five dims — then the descriptor's bytes, then the
  tensor's. :func:`parse_header` is the only way a peer's header is read.
- **Rounds-plane frame** (Unix sockets): a 16-byte header — magic, operation, payload
  length — and the payload (a reduction's: little-endian int64, the number of values
  MIN-ed, those values, then the values AND-ed). :func:`check_frame` refuses another
  operation than the one this rank runs (a protocol error, not data to misread), a wrong
  length, or one past :data:`MAX_FRAME_BYTES`.
- **Gloo broadcast**: one buffer of the payload's length (8 bytes) and its first
  ``inline`` bytes, then, only for a longer payload, the rest; the length is bounded by
  the same :data:`MAX_FRAME_BYTES` before the rest is allocated.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import attrs
import torch

from wavepp.transport.base import PlaneError

# -- the data-plane header ---------------------------------------------------------------

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8]
HEADER_WORDS = 10  # int64 words: [magic, sender, desc_bytes, dtype code, ndim, dims...(5)]
HEADER = struct.Struct(f"<{HEADER_WORDS}q")
DATA_MAGIC = 0x57505044  # "WPPD": the first word of every data-plane header
MAX_DIMS = 5
MAX_TENSOR_BYTES = 8 << 30  # one wave's activations when no run-derived bound is given


@attrs.frozen
class DataLimits:
    """What a data-plane header may announce, derived from the run's config.

    ``max_tokens`` is the most rows a tensor may have: the wave budget (most tokens in
    one wave), twice it on a link after a mixer two stages share; ``width`` the model's
    ``d_model``, which every activation tensor ``[tokens, width]`` must have (None: not
    checked, and ``[tokens]`` stand-ins, as the sim executor sends, are accepted);
    ``dtypes`` the tensor dtypes this run sends. Every tensor is also bounded by
    ``max_tensor_bytes``.
    """

    max_descriptor_bytes: int = 64 << 20
    max_tokens: int = 1 << 20
    width: int | None = None
    dtypes: frozenset[torch.dtype] = frozenset(DTYPES)
    max_tensor_bytes: int = MAX_TENSOR_BYTES

    @classmethod
    def for_run(
        cls, budget: int, width: int | None, dtype: torch.dtype, max_descriptor_bytes: int
    ) -> DataLimits:
        return cls(max_descriptor_bytes, budget, width, frozenset({dtype}))


@attrs.frozen
class Header:
    sender: int
    descriptor_bytes: int
    dtype: torch.dtype | None  # None: no tensor follows
    shape: tuple[int, ...]


def make_header(src: int, descriptor: bytes, tensor: torch.Tensor | None) -> list[int]:
    """The header words of a message from rank ``src``."""
    words = [DATA_MAGIC, src, len(descriptor), 0, 0] + [0] * MAX_DIMS
    if tensor is not None:
        if tensor.dim() > MAX_DIMS or tensor.dtype not in DTYPES:
            raise ValueError(
                f"a {tensor.dim()}-dim {tensor.dtype} tensor does not fit the link header "
                f"(at most {MAX_DIMS} dims of {', '.join(map(str, DTYPES))})"
            )
        words[3] = DTYPES.index(tensor.dtype) + 1
        words[4] = tensor.dim()
        words[5 : 5 + tensor.dim()] = list(tensor.shape)
    return words


def parse_header(
    words: Sequence[int], src: int, limits: DataLimits, max_bytes: int | None = None
) -> Header:
    """Check a peer's header words against the link's sender and the run's limits."""
    limit = limits.max_descriptor_bytes
    if max_bytes is not None:
        limit = min(limit, max_bytes)
    where = f"data-plane header from rank {src}"
    if len(words) != HEADER_WORDS:
        raise PlaneError(f"{where}: {len(words)} words, expected {HEADER_WORDS}")
    magic, sender, size, code, ndim, *dims = (int(w) for w in words)
    if magic != DATA_MAGIC:
        raise PlaneError(f"{where}: bad magic {magic:#x} (not a WavePP data-plane peer)")
    if sender != src:
        raise PlaneError(f"{where}: claims to come from rank {sender}")
    if not 0 < size <= limit:
        raise PlaneError(f"{where}: descriptor of {size} bytes (limit {limit:,})")
    if code == 0:
        if ndim or any(dims):
            raise PlaneError(f"{where}: shape {dims[:ndim]} without a dtype")
        return Header(sender, size, None, ())
    if not 0 < code <= len(DTYPES) or DTYPES[code - 1] not in limits.dtypes:
        allowed = ", ".join(sorted(str(d) for d in limits.dtypes))
        raise PlaneError(f"{where}: dtype code {code} is not one of this run's ({allowed})")
    dtype = DTYPES[code - 1]
    if not 1 <= ndim <= 2 or any(dims[ndim:]):
        raise PlaneError(f"{where}: {ndim}-dim tensor; activations are [tokens] or "
                         "[tokens, width]")  # fmt: skip
    shape = tuple(dims[:ndim])
    tokens = shape[0]
    if not 0 <= tokens <= limits.max_tokens:
        raise PlaneError(f"{where}: {tokens} rows, this link takes at most {limits.max_tokens}")
    if ndim == 2 and limits.width is not None and shape[1] != limits.width:
        raise PlaneError(f"{where}: width {shape[1]}, the model's is {limits.width}")
    if ndim == 1 and limits.width is not None:
        raise PlaneError(f"{where}: shape {list(shape)}, expected [tokens, {limits.width}]")
    numel = tokens * (shape[1] if ndim == 2 else 1)
    if numel * dtype.itemsize > limits.max_tensor_bytes:
        raise PlaneError(f"{where}: tensor {list(shape)} exceeds "
                         f"{limits.max_tensor_bytes:,} bytes")  # fmt: skip
    return Header(sender, size, dtype, shape)


# -- the rounds-plane frame (Unix sockets) ----------------------------------------------

ROUNDS_MAGIC = 0x52505057  # "WPPR"
HELLO, BROADCAST, MIN, AND, GATHER, REDUCE = 1, 2, 3, 4, 5, 6
OPS = {HELLO: "hello", BROADCAST: "broadcast", MIN: "all_reduce MIN", AND: "all_reduce AND",
       GATHER: "gather", REDUCE: "all_reduce MIN + AND"}  # fmt: skip
FRAME = struct.Struct("<IB3xQ")  # magic, op, length
MAX_FRAME_BYTES = 64 << 20  # the largest payload a frame may announce (a broadcast's cap)


def frame(op: int, payload: bytes) -> bytes:
    return FRAME.pack(ROUNDS_MAGIC, op, len(payload)) + payload


def check_frame(raw: bytes, op: int, exact: int | None, who: str) -> int:
    """The payload length a frame header from ``who`` announces, once it is known to be
    ``op`` and of ``exact`` bytes if given, at most :data:`MAX_FRAME_BYTES`."""
    magic, got, n = FRAME.unpack(raw)
    if magic != ROUNDS_MAGIC:
        raise PlaneError(f"{who} sent a frame without WavePP's magic")
    if got != op:
        raise PlaneError(f"{who} sent {OPS.get(got, f'operation {got}')} "
                         f"while this rank runs {OPS[op]}")  # fmt: skip
    if exact is not None and n != exact:
        raise PlaneError(f"{who} sent {n:,} bytes for {OPS[op]}; {exact:,} expected")
    if n > MAX_FRAME_BYTES:
        raise PlaneError(f"{who} announced {n:,} bytes; at most "
                         f"{MAX_FRAME_BYTES:,} are accepted")  # fmt: skip
    return n


def ints(values: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(values)}q", *values)


def unints(raw: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(raw) // 8}q", raw))


# -- the Gloo broadcast ------------------------------------------------------------------

INLINE_MIN_BYTES = 4 << 10  # a broadcast's first collective carries this much payload
INLINE_MAX_BYTES = 256 << 10  # ... growing to the longest payload seen, up to this


def inline_after(inline: int, n: int) -> int:
    """The next broadcast's inline room after a payload of ``n`` bytes: every rank
    computes the same from what it has seen, so no size needs to travel first."""
    want = 1 << max(n - 1, 0).bit_length()
    return min(INLINE_MAX_BYTES, max(inline, want))


def check_broadcast_length(n: int) -> None:
    """Rank 0's announced broadcast length, before anything is allocated for it (the same
    cap as a frame's on the other rounds plane; rank 0 fails alike)."""
    if n > MAX_FRAME_BYTES:
        raise PlaneError(f"rank 0 announced a broadcast of {n:,} bytes; at most "
                         f"{MAX_FRAME_BYTES:,} are accepted")  # fmt: skip
