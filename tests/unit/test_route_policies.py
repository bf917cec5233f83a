"""Routing policies on made-up replica states, and the text tree (no processes, no sockets)."""

from __future__ import annotations

import pytest

from wavepp.policy.load import PolicyError
from wavepp.route import (
    ROUTE_POLICIES,
    ReplicaView,
    RouteRequest,
    TextTree,
    cost_terms,
    dynamo_cost,
    load_route_policy,
)


def view(name: str, *, load: int = 0, new: int = 0, n: int = 0, predicted: int = 0,
         pending: int = 0, match: int = 0, tree: int = 0,
         block: int = 16) -> ReplicaView:  # fmt: skip
    return ReplicaView(name, block, n, load, new, predicted, pending, match, tree)


def pick(policy: str, views: list[ReplicaView], num_tokens: int = 256, seq: int = 0) -> str:
    return views[ROUTE_POLICIES[policy](RouteRequest(seq, num_tokens), views)].name


def test_round_robin_cycles_through_the_candidates():
    views = [view("r0"), view("r1"), view("r2")]
    assert [pick("round-robin", views, seq=s) for s in range(5)] == ["r0", "r1", "r2", "r0", "r1"]


def test_least_load_counts_tokens_then_requests():
    views = [view("r0", load=300, n=1), view("r1", load=200, n=5), view("r2", load=200, n=2)]
    assert pick("least-load", views) == "r2"


def test_prefix_takes_the_most_predicted_reuse_then_the_least_load():
    views = [view("r0", predicted=64, load=0), view("r1", predicted=128, load=900),
             view("r2", predicted=128, load=100)]  # fmt: skip
    assert pick("prefix", views) == "r2"
    assert pick("prefix", [view("r0", load=5), view("r1", load=1)]) == "r1"  # nothing cached
    # a prefix still being computed at r1 counts as much as one announced at r0
    views = [view("r0", predicted=64, load=0), view("r1", pending=128, load=300)]
    assert pick("prefix", views) == "r1"
    # under 30% of the prompt (76.8 of 256 tokens) a match does not outweigh load
    views = [view("r0", predicted=64, load=300), view("r1", load=0)]
    assert pick("prefix", views) == "r1"
    views = [view("r0", predicted=80, load=300), view("r1", load=0)]
    assert pick("prefix", views) == "r0"


def test_a_replica_knows_the_prefixes_in_flight_there():
    from wavepp.route.replicas import Flight, Replica
    from wavepp.state import block_hashes

    replica = Replica("r0", "http://x")
    replica.block_size = 4
    doc = list(range(100, 120))  # five blocks
    turn = [*doc, 7, 8, 9, 10, 11, 12]
    other = [1, *doc[1:]]
    first = Flight("a", len(doc), len(doc), tuple(block_hashes(doc, 4)))
    replica.fly(first)

    def pending(tokens):
        return replica.view(len(tokens), block_hashes(tokens, 4), None).pending_tokens

    assert pending(turn) == 20  # all of doc's blocks, in flight
    assert pending(doc) == 16  # a prompt's own last token is never reused
    assert pending(other) == 0  # another first block: nothing in common (chained hashes)
    second = Flight("b", len(turn), 6, tuple(block_hashes(turn, 4)))
    replica.fly(second)
    replica.land(first)
    assert pending([*turn, 1]) == 24 and pending([*doc, 5]) == 20  # b still holds doc's blocks
    replica.land(second)
    replica.land(second)  # twice: no effect
    assert pending(turn) == 0 and not replica.sent.in_flight and not replica.flights


def test_cost_is_dynamos_formula():
    request = RouteRequest(0, 256)
    v = view("r0", load=512, new=128, predicted=64)
    # prefill: (128 queued new + 256 - 64) / 16 = 20 blocks; decode: (512 + 256) / 16 = 48
    assert cost_terms(request, v) == (20.0, 48.0)
    # r0 holds 192 tokens of it but has 512 in flight; r1 is idle and holds nothing:
    # cost r0 = 1.0 * (0 + 64) / 16 + (512 + 256) / 16 = 52; r1 = 256 / 16 + 256 / 16 = 32.
    views = [view("r0", load=512, predicted=192), view("r1")]
    assert pick("cost", views) == "r1"
    # a heavier weight on the prefill term makes the cached replica win:
    # r0 = 10 * 4 + 48 = 88 ; r1 = 10 * 16 + 16 = 176
    assert views[dynamo_cost(10.0)(request, views)].name == "r0"
    # equal load: the reuse decides
    assert pick("cost", [view("r0", load=64), view("r1", load=64, predicted=128)]) == "r1"


def test_text_tree_follows_sglangs_three_cases():
    # balanced, a match over 30%: the best match
    views = [view("r0", match=50, tree=10), view("r1", match=200, tree=9000)]
    assert pick("text-tree", views, num_tokens=256) == "r1"
    # balanced, matches under 30%: the smallest tree
    views = [view("r0", match=60, tree=5000), view("r1", match=10, tree=100)]
    assert pick("text-tree", views, num_tokens=256) == "r1"
    # imbalanced (100 - 10 > 64 and 100 > 1.5 x 10): the least loaded, whatever matches
    views = [view("r0", n=100, match=256), view("r1", n=10)]
    assert pick("text-tree", views, num_tokens=256) == "r1"
    # over the absolute threshold but not the relative one: the cache decides
    views = [view("r0", n=200, match=256), view("r1", n=150)]
    assert pick("text-tree", views, num_tokens=256) == "r0"


def test_policies_by_name_and_dotted_path():
    assert load_route_policy("prefix") is ROUTE_POLICIES["prefix"]
    assert load_route_policy("wavepp.route.policies:least_load") is ROUTE_POLICIES["least-load"]
    with pytest.raises(PolicyError, match="not built in"):
        load_route_policy("fastest")
    with pytest.raises(PolicyError, match="not a function"):
        load_route_policy("wavepp.route.policies:CACHE_THRESHOLD")


def test_text_tree_matches_inserted_prefixes_and_splits_edges():
    tree = TextTree()
    tree.insert([1, 2, 3, 4, 5])
    tree.insert([1, 2, 9])
    assert tree.match([1, 2, 3, 4, 5, 6]) == 5
    assert tree.match([1, 2, 9, 9]) == 3
    assert tree.match([1, 2, 7]) == 2
    assert tree.match([7]) == 0
    assert tree.num_tokens == 6  # [1 2] [3 4 5] [9]
    before = tree.num_tokens
    tree.match([1, 2, 3])
    assert tree.num_tokens == before  # a lookup changes nothing


def test_text_tree_evicts_least_recently_used_leaves_first():
    tree = TextTree(max_tokens=10)
    tree.insert([1, 1, 1, 1])
    tree.insert([2, 2, 2, 2])
    tree.insert([1, 1, 1, 1])  # [1...] is now the more recent
    tree.insert([3, 3, 3, 3])  # 12 tokens > 10: evict down to 9, oldest leaf first
    assert tree.num_tokens <= 10
    assert tree.match([2, 2, 2, 2]) == 0
    assert tree.match([1, 1, 1, 1]) == 4
    assert tree.match([3, 3, 3, 3]) == 4
