"""Synthetic workloads of the paper (DESIGN §7).

Each returns the requests in release order. ``warmup`` requests run first (their cost
is not charged, their cache effects are kept: the seeded prefixes, the cold traffic
before short suffixes); measurement starts when they have all finished.
"""

from __future__ import annotations

import attrs
import numpy as np

VOCAB = 32_000
MAX_DEADLINE_S = 1e6  # a request's deadline_s is at most this (every entry point checks it)


@attrs.frozen
class RequestSpec:
    request_id: str
    tokens: np.ndarray  # int32 token ids
    warmup: bool  # run before measurement, not measured
    expected_reuse: int  # tokens a perfect cache would reuse (0: none expected)
    arrival_s: float | None = None  # open-loop arrival after the start; None: closed loop
    handoff: str | bool | None = None  # hand the cache on: an address, or True for the
    #                                    run's default target (--handoff-to)
    deadline_s: float | None = None  # the result is due this many wall seconds after the
    #                                  request enters rank 0's intake; None: no deadline

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


def _tokens(rng: np.random.Generator, n: int, vocab: int = VOCAB) -> np.ndarray:
    return rng.integers(0, vocab, size=n, dtype=np.int32)


def _blocks(tokens: int, block_size: int) -> int:
    return tokens // block_size * block_size


def cold(
    n: int, prompt_tokens: int, seed: int, block_size: int = 64, vocab: int = VOCAB
) -> list[RequestSpec]:
    """Unique prompts of L tokens."""
    rng = np.random.default_rng(seed)
    return [
        RequestSpec(f"cold-{i}", _tokens(rng, prompt_tokens, vocab), False, 0) for i in range(n)
    ]


def seeded(
    n: int, prompt_tokens: int, seed: int, block_size: int = 64, reuse: float = 0.9,
    num_prefixes: int | None = None, vocab: int = VOCAB,
) -> list[RequestSpec]:  # fmt: skip
    """Shared prefixes of ``reuse``·L seeded before measurement, each request a new suffix."""
    rng = np.random.default_rng(seed)
    prefix_len = _blocks(int(prompt_tokens * reuse), block_size)
    k = num_prefixes or max(1, n // 4)
    prefixes = [_tokens(rng, prefix_len, vocab) for _ in range(k)]
    out = [RequestSpec(f"seed-{j}", p, True, 0) for j, p in enumerate(prefixes)]
    for i in range(n):
        suffix = _tokens(rng, prompt_tokens - prefix_len, vocab)
        out.append(
            RequestSpec(f"warm-{i}", np.concatenate([prefixes[i % k], suffix]), False, prefix_len)
        )
    return out


def mixed(
    n: int, warm_tokens: int, cold_tokens: int, seed: int, block_size: int = 64,
    warm_share: float = 0.75, vocab: int = VOCAB,
) -> list[RequestSpec]:  # fmt: skip
    """75% warm seeded requests of L1, 25% cold requests of L2, interleaved."""
    rng = np.random.default_rng(seed + 1)
    num_warm = round(n * warm_share)
    warm = seeded(num_warm, warm_tokens, seed, block_size, vocab=vocab)
    cold_reqs = [
        RequestSpec(f"cold-{i}", _tokens(rng, cold_tokens, vocab), False, 0)
        for i in range(n - num_warm)
    ]
    seeds = [r for r in warm if r.warmup]
    measured = [r for r in warm if not r.warmup] + cold_reqs
    order = rng.permutation(len(measured))
    return seeds + [measured[i] for i in order]


def short_suffix(
    n: int, prompt_tokens: int, seed: int, block_size: int = 64, suffix_tokens: int = 4096,
    vocab: int = VOCAB,
) -> list[RequestSpec]:  # fmt: skip
    """Cold traffic of n prompts (kept, with its eviction history), then n requests that
    each extend one earlier prompt by ``suffix_tokens``."""
    rng = np.random.default_rng(seed)
    prompts = [_tokens(rng, prompt_tokens, vocab) for _ in range(n)]
    out = [RequestSpec(f"doc-{i}", p, True, 0) for i, p in enumerate(prompts)]
    for i, j in enumerate(rng.permutation(n)):
        tokens = np.concatenate([prompts[j], _tokens(rng, suffix_tokens, vocab)])
        out.append(RequestSpec(f"turn-{i}", tokens, False, _blocks(prompt_tokens, block_size)))
    return out


def expected_by_blocks(prompts: list[np.ndarray], block_size: int) -> list[int]:
    """For each prompt in release order, the tokens a perfect cache reuses: its longest
    run of leading full blocks that some earlier prompt also began with (at least one
    token is always computed)."""
    seen: set[bytes] = set()
    out = []
    for tokens in prompts:
        full = (len(tokens) - 1) // block_size  # blocks that may come from the cache
        shared, sharing = 0, True
        for b in range(len(tokens) // block_size):
            key = tokens[: (b + 1) * block_size].tobytes()
            if sharing and b < full and key in seen:
                shared += 1
            else:
                sharing = False
            seen.add(key)
        out.append(shared * block_size)
    return out


def conversation(
    n: int, prompt_tokens: int, seed: int, block_size: int = 64, vocab: int = VOCAB,
    num_system: int = 4, turns: tuple[int, int] = (2, 8),
) -> list[RequestSpec]:  # fmt: skip
    """Chat traffic: conversations start from one of ``num_system`` shared system prompts
    (lengths that are multiples of neither the block size nor a snapshot interval) and
    grow turn by turn — each turn's prompt is the previous one plus the model's answer
    plus a new user message — interleaved across conversations. Shared prefixes end
    inside other requests (a system prompt, an earlier turn), where hybrid models lose
    reuse unless snapshots sit where prefixes branch. ``expected_reuse`` is exact."""
    rng = np.random.default_rng(seed)
    # System prompts of 2.5, 7.5, 12.5, ... blocks (and a few tokens): short next to a
    # snapshot interval, so only a snapshot where they end lets a hybrid stage reuse them.
    systems = [_tokens(rng, block_size * (5 * k + 2) + block_size // 2 + 3 + 7 * k, vocab)
               for k in range(num_system)]  # fmt: skip
    step = max(prompt_tokens // 8, 8)
    conversations: list[list[np.ndarray]] = []
    total = 0
    while total < n:
        count = min(int(rng.integers(turns[0], turns[1] + 1)), n - total)
        prompt = systems[int(rng.integers(num_system))]
        turns_of: list[np.ndarray] = []
        for _ in range(count):
            answer = _tokens(rng, int(rng.integers(step // 4, step)), vocab) if turns_of else None
            user = _tokens(rng, int(rng.integers(step // 4, step)), vocab)
            prompt = np.concatenate([prompt, *([answer] if answer is not None else []), user])
            turns_of.append(prompt)
        conversations.append(turns_of)
        total += count
    # Interleave: each step releases the next turn of a random unfinished conversation.
    order: list[tuple[int, int]] = []
    cursors = [0] * len(conversations)
    live = list(range(len(conversations)))
    while live:
        c = live[int(rng.integers(len(live)))]
        order.append((c, cursors[c]))
        cursors[c] += 1
        if cursors[c] == len(conversations[c]):
            live.remove(c)
    prompts = [conversations[c][t] for c, t in order]
    expected = expected_by_blocks(prompts, block_size)
    return [RequestSpec(f"conv-{c}-turn-{t}", p, False, e)
            for (c, t), p, e in zip(order, prompts, expected, strict=True)]  # fmt: skip


WORKLOADS = ("cold", "seeded", "mixed", "short-suffix", "conversation", "trace")
