"""Routing policies: which replica serves a request.

A routing policy is a plain function ``policy(request, replicas) -> int``: given what the
router knows about the request (:class:`RouteRequest`) and about each replica it may use
(:class:`ReplicaView`, in the order given, never empty), it returns the index of the
chosen view. It reads values and changes nothing; the router owns every piece of state
(load, indexes, text trees) and builds the views fresh for each request. Built in, by
name (``--policy NAME``), or any function as ``pkg.mod:fn``:

- ``round-robin``: the next replica in turn (by the router's request count);
- ``least-load``: the fewest prompt tokens in flight (sent and not yet answered), then
  the fewest requests;
- ``prefix``: the deepest reuse (:func:`reuse_tokens`: the replica's KV-event index probed
  with WavePP's own chained hashes, or, where deeper, what the router sent there — prompts
  in flight and prompts answered before their events arrived) against the work queued
  there, at an exchange rate (:func:`prefix_policy`): a conversation's turns follow its
  earlier ones unless that replica's queue is far longer than another's;
- ``cost``: Dynamo's KV-router cost, lowest first (:func:`dynamo_cost`);
- ``text-tree``: SGLang's gateway ("cache-aware"), over an approximate radix tree of the
  token ids routed to each replica (:func:`text_tree`).

No built-in reads the request's ``priority`` or ``deadline_s``: a choice by deadline
needs each replica's rate to tell whether it would meet it, which the router does not
estimate. A ``pkg.mod:fn`` policy may use them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from wavepp.policy.load import PolicyError, resolve


@attrs.frozen
class RouteRequest:
    """What a policy knows about the request being routed."""

    seq: int  # the router's count of requests routed before this one (round robin)
    num_tokens: int  # prompt length in tokens; 0 when the router could not read token ids
    priority: int = 0  # the body's priority class (higher is admitted first); 0 if none
    # seconds left until the request's deadline as this choice is made (counted from its
    # arrival at the router; what the chosen replica is given); None: no deadline
    deadline_s: float | None = None


@attrs.frozen
class ReplicaView:
    """One replica as a policy sees it, for one request. Token counts are prompt tokens."""

    name: str  # the router's name for it: r0, r1, ... in --replica order
    block_size: int  # its KV block size, tokens (from GET /v1/models)
    num_in_flight: int  # requests the router sent there and has not had answered
    load_tokens: int  # prompt tokens of those requests (cached included)
    load_new_tokens: int  # of which uncached as judged when they were routed (the work)
    predicted_tokens: int  # tokens of this prompt the replica's cache holds (events + probe)
    pending_tokens: int  # tokens of this prompt that requests in flight there are computing
    text_match_tokens: int  # tokens of this prompt matched in its approximate text tree
    text_tree_tokens: int  # tokens its approximate text tree holds
    # tokens of this prompt that prompts answered there a moment ago hold, not yet
    # confirmed by its events (the router's memory of what it sent, wavepp.route.sent)
    recent_tokens: int = 0


RoutePolicy = Callable[[RouteRequest, Sequence[ReplicaView]], int]


def _load_key(view: ReplicaView) -> tuple[int, int]:
    return (view.load_tokens, view.num_in_flight)


def _argmin(replicas: Sequence[ReplicaView], key) -> int:
    """The first index of the smallest key (ties go to the earlier replica)."""
    return min(range(len(replicas)), key=lambda i: (key(replicas[i]), i))


def round_robin(request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
    return request.seq % len(replicas)


def least_load(request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
    return _argmin(replicas, _load_key)


def reuse_tokens(view: ReplicaView) -> int:
    """Tokens of the prompt the replica holds or will hold when it gets there: the deepest of
    what its events announce, what prompts in flight there compute (it waits for a prefix an
    admitted request is computing rather than compute it twice) and what prompts answered
    there a moment ago left (their events may not have arrived)."""
    return max(view.predicted_tokens, view.pending_tokens, view.recent_tokens)


# ``prefix``'s exchange rate: one uncached prompt token weighs as much as PREFIX_WEIGHT
# tokens of work queued ahead. A replica with less reuse wins only when what it saves in
# waiting is over PREFIX_WEIGHT times what it adds in compute: load decides where reuse
# differs little (a shared head that one replica has computed and another not yet), and a
# conversation leaves its replica only when that replica's queue is longer than the
# others' by over four times the conversation's cached prompt. (2 and 4 did within noise
# of each other on the tuning traces; 4 kept more reuse: docs/fleet.md.)
PREFIX_WEIGHT = 4.0


def prefix_policy(weight: float = PREFIX_WEIGHT) -> RoutePolicy:
    """``prefix`` with its exchange rate (:data:`PREFIX_WEIGHT`): the least ``queued
    uncached tokens + weight × this request's uncached tokens``, reuse by
    :func:`reuse_tokens`; ties by requests in flight, then the earlier replica."""
    if not 1 <= weight < 1e6:
        raise ValueError(f"weight must be in [1, 1e6) (1: this request's finish time alone), "
                         f"got {weight:g}")  # fmt: skip

    def prefix(request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        def key(i: int) -> tuple[float, int, int]:
            view = replicas[i]
            new = max(request.num_tokens - reuse_tokens(view), 0)
            return (view.load_new_tokens + weight * new, view.num_in_flight, i)

        return min(range(len(replicas)), key=key)

    return prefix


prefix = prefix_policy()


def prefix_before(request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
    """``prefix`` as it was before issue 58, kept to compare with (``benchmarks.fleet
    --policies prefix-before``; not built in): the larger of predicted and in-flight tokens,
    counted as none under 30% of the prompt; ties by prompt tokens in flight."""

    def reuse(view: ReplicaView) -> int:
        tokens = max(view.predicted_tokens, view.pending_tokens)
        return tokens if tokens >= 0.3 * request.num_tokens else 0

    return _argmin(replicas, lambda v: (-reuse(v), *_load_key(v)))


# Dynamo's KV router (docs.nvidia.com/dynamo, components/router, "Cost Calculation"):
#     cost = overlap_score_weight * prefill_blocks + decode_blocks,   lowest cost wins,
# prefill_blocks: the blocks still to prefill on the worker (its active prompt work plus this
# request's uncached blocks), decode_blocks: the KV blocks its active requests hold plus
# this request's. Its default weight is 1.0 and its default temperature 0 (argmin, no
# sampling); newer releases name the weight --router-prefill-load-scale, also 1.0.
OVERLAP_SCORE_WEIGHT = 1.0


def cost_terms(request: RouteRequest, view: ReplicaView) -> tuple[float, float]:
    """(prefill_blocks, decode_blocks) of Dynamo's cost for ``view``. On a prefill replica a
    request's blocks are held from admission to its answer, so its "active blocks" are the
    whole prompts in flight; the prefill work is their predicted uncached tokens."""
    new_tokens = max(request.num_tokens - view.predicted_tokens, 0)
    prefill_blocks = (view.load_new_tokens + new_tokens) / view.block_size
    decode_blocks = (view.load_tokens + request.num_tokens) / view.block_size
    return prefill_blocks, decode_blocks


def dynamo_cost(overlap_score_weight: float = OVERLAP_SCORE_WEIGHT) -> RoutePolicy:
    """Dynamo's cost policy with its weight on the prefill term."""

    def cost(request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        def key(view: ReplicaView) -> tuple[float, int, int]:
            prefill_blocks, decode_blocks = cost_terms(request, view)
            return (overlap_score_weight * prefill_blocks + decode_blocks, *_load_key(view))

        return _argmin(replicas, key)

    return cost


# SGLang's gateway (sgl-model-gateway / smg, policy cache_aware) and its defaults:
CACHE_THRESHOLD = 0.3  # --cache-threshold: least matched share to follow the tree
BALANCE_ABS_THRESHOLD = 64  # --balance-abs-threshold: requests, max - min load
BALANCE_REL_THRESHOLD = 1.5  # --balance-rel-threshold: max load / min load


def text_tree(request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
    """SGLang's cache-aware choice: when the loads (requests in flight) are imbalanced —
    max − min > 64 and max > 1.5 × min — the least loaded; else, when some replica's tree
    matches more than 30% of the prompt, the best match; else the smallest tree (the most
    room). Ties go to the less loaded, then the earlier replica."""
    loads = [v.num_in_flight for v in replicas]
    low, high = min(loads), max(loads)
    if high - low > BALANCE_ABS_THRESHOLD and high > BALANCE_REL_THRESHOLD * low:
        return _argmin(replicas, lambda v: v.num_in_flight)
    best = max(v.text_match_tokens for v in replicas)
    if request.num_tokens and best / request.num_tokens > CACHE_THRESHOLD:
        return _argmin(replicas, lambda v: (-v.text_match_tokens, *_load_key(v)))
    return _argmin(replicas, lambda v: (v.text_tree_tokens, *_load_key(v)))


ROUTE_POLICIES: dict[str, RoutePolicy] = {
    "round-robin": round_robin,
    "least-load": least_load,
    "prefix": prefix,
    "cost": dynamo_cost(),
    "text-tree": text_tree,
}
DEFAULT_ROUTE_POLICY = "prefix"


def load_route_policy(spec: str) -> RoutePolicy:
    """A built-in name or ``pkg.mod:fn``; :class:`PolicyError` says why not."""
    if spec in ROUTE_POLICIES:
        return ROUTE_POLICIES[spec]
    if ":" not in spec and "." not in spec:
        names = ", ".join(ROUTE_POLICIES)
        raise PolicyError(f"routing policy {spec!r} is not built in ({names}) nor a dotted "
                          "path pkg.mod:fn")  # fmt: skip
    policy = resolve(spec)
    if not callable(policy):
        raise PolicyError(f"routing policy {spec!r} is a {type(policy).__name__}, not a function")
    return policy
