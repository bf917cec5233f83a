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
    prefix_policy,
)


def view(name: str, *, load: int = 0, new: int = 0, n: int = 0, predicted: int = 0,
         pending: int = 0, match: int = 0, tree: int = 0, recent: int = 0,
         block: int = 16) -> ReplicaView:  # fmt: skip
    return ReplicaView(name, block, n, load, new, predicted, pending, match, tree, recent)


def pick(policy: str, views: list[ReplicaView], num_tokens: int = 256, seq: int = 0) -> str:
    return views[ROUTE_POLICIES[policy](RouteRequest(seq, num_tokens), views)].name


def test_round_robin_cycles_through_the_candidates():
    views = [view("r0"), view("r1"), view("r2")]
    assert [pick("round-robin", views, seq=s) for s in range(5)] == ["r0", "r1", "r2", "r0", "r1"]


def test_least_load_counts_tokens_then_requests():
    views = [view("r0", load=300, n=1), view("r1", load=200, n=5), view("r2", load=200, n=2)]
    assert pick("least-load", views) == "r2"


def test_prefix_takes_the_deepest_match_however_short():
    # 64 of 256 tokens (25%) at r0: no cut. Costs (queued + 4 x uncached): 768 against 1024
    assert pick("prefix", [view("r1"), view("r0", predicted=64)]) == "r0"
    # r0: 0 + 4 x 192 = 768, r1: 100 + 4 x 128 = 612, r2: 120 + 4 x 64 = 376
    views = [view("r0", predicted=64), view("r1", predicted=128, new=100),
             view("r2", predicted=192, new=120)]  # fmt: skip
    assert pick("prefix", views) == "r2"
    # whole prompts in flight do not count, only their uncached work: a tie, the earlier one
    assert pick("prefix", [view("r0", load=5), view("r1", load=1)]) == "r0"
    assert pick("prefix", [view("r0", load=900, new=10, n=1), view("r1", new=10, n=2)]) == "r0"


def test_prefix_counts_what_the_router_sent_as_cached():
    # in flight at r1 (it will wait for it) or answered there before its events arrived:
    # as good as announced
    assert pick("prefix", [view("r0", predicted=64), view("r1", pending=192)]) == "r1"
    assert pick("prefix", [view("r0", predicted=64), view("r1", recent=192)]) == "r1"
    assert pick("prefix", [view("r0", predicted=192), view("r1", recent=64)]) == "r0"


def test_prefix_weighs_work_only_where_reuse_differs_little():
    # prompt 1000. r1 holds 50 fewer tokens (a shared head r0 computed and r1 not yet) and
    # has 300 fewer queued: 300 > 4 x 50, the less busy one. r0: 300 + 4 x 500 = 2300,
    # r1: 4 x 550 = 2200
    views = [view("r0", predicted=500, new=300), view("r1", predicted=450)]
    assert pick("prefix", views, num_tokens=1000) == "r1"
    # 200 fewer cached: 300 < 4 x 200, the reuse stays (2300 against 2800)
    views = [view("r0", predicted=500, new=300), view("r1", predicted=300)]
    assert pick("prefix", views, num_tokens=1000) == "r0"
    # equal costs: fewer requests in flight, then the earlier replica
    views = [view("r0", predicted=500, new=100, n=3), view("r1", predicted=500, new=100, n=1),
             view("r2", predicted=500, new=100, n=1)]  # fmt: skip
    assert pick("prefix", views, num_tokens=1000) == "r1"
    assert ROUTE_POLICIES["prefix"](RouteRequest(0, 1000), views[1:]) == 0  # r1 before r2


def test_prefix_keeps_a_conversation_together_unless_its_replica_is_overloaded():
    # r0 holds 900 of 1000 tokens, r1 nothing: r0 keeps the turn while its queue is under
    # 4 x 900 longer than r1's. 3500 + 4 x 100 = 3900 against 4000
    views = [view("r0", recent=900, new=3500), view("r1")]
    assert pick("prefix", views, num_tokens=1000) == "r0"
    # 3700 + 400 = 4100 > 4000: it moves
    views = [view("r0", recent=900, new=3700), view("r1")]
    assert pick("prefix", views, num_tokens=1000) == "r1"
    # to the cheapest, not the next deepest: r1 2000 + 4 x 600 = 4400, r2 4000
    views = [view("r0", recent=900, new=3700), view("r1", predicted=400, new=2000),
             view("r2", new=0)]  # fmt: skip
    assert pick("prefix", views, num_tokens=1000) == "r2"
    # the exchange rate is a parameter: 8 keeps it (4500 < 8000), 1 moves it (3800 > 1000)
    views = [view("r0", recent=900, new=3700), view("r1")]
    assert prefix_policy(8.0)(RouteRequest(0, 1000), views) == 0
    assert prefix_policy(1.0)(RouteRequest(0, 1000), views) == 1
    with pytest.raises(ValueError, match="weight must be in"):
        prefix_policy(0.5)


def test_prefix_without_token_ids_goes_to_the_least_work():
    views = [view("r0", new=500, n=1), view("r1", new=200, n=4)]
    assert pick("prefix", views, num_tokens=0) == "r1"


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


def test_an_answered_prompt_counts_until_its_events_confirm_it_or_the_memory_ends():
    from wavepp.route.replicas import Flight, Replica
    from wavepp.route.sent import MemoryOptions
    from wavepp.state import block_hashes

    class Index:  # the events' view: announced blocks, attention only
        def __init__(self) -> None:
            self.blocks: set[int] = set()

        def predicted_blocks(self, hashes, limit):
            n = 0
            while n < min(limit, len(hashes)) and hashes[n] in self.blocks:
                n += 1
            return n

    replica = Replica("r0", "http://x", memory=MemoryOptions(memory_s=5.0))
    replica.block_size, replica.index = 4, Index()
    doc = list(range(100, 120))  # five blocks
    turn = [*doc, 7, 8, 9]

    def seen(tokens):
        v = replica.view(len(tokens), block_hashes(tokens, 4), None)
        return v.predicted_tokens, v.pending_tokens, v.recent_tokens

    first = Flight("a", len(doc), len(doc), tuple(block_hashes(doc, 4)))
    replica.fly(first)
    assert seen(turn) == (0, 20, 0)
    replica.land(first, done=True, now=100.0)  # answered; its events not here yet
    assert seen(turn) == (0, 0, 20)
    replica.settle(104.9)
    assert seen(turn) == (0, 0, 20)
    replica.index.blocks.update(block_hashes(doc, 4)[:3])  # part of it announced: not yet
    replica.settle(104.9)
    assert seen(turn) == (12, 0, 20)
    replica.index.blocks.update(block_hashes(doc, 4))  # all announced: the events own it
    replica.settle(104.9)
    assert seen(turn) == (20, 0, 0) and replica.sent.num_answered == 0
    replica.index.blocks.clear()  # evicted later: the events say so, nothing overrides them
    assert seen(turn) == (0, 0, 0)
    # never confirmed: counted for memory_s, then the (empty) index is believed
    second = Flight("b", len(doc), len(doc), tuple(block_hashes(doc, 4)))
    replica.fly(second)
    replica.land(second, done=True, now=200.0)
    replica.settle(204.0)
    assert seen(turn)[2] == 20
    replica.settle(205.5)
    assert seen(turn) == (0, 0, 0)
    # a failed or refused request left nothing to count
    third = Flight("c", len(doc), len(doc), tuple(block_hashes(doc, 4)))
    replica.fly(third)
    replica.land(third, done=False, now=300.0)
    assert seen(turn) == (0, 0, 0)


def test_the_memory_of_answered_prompts_is_bounded_oldest_first():
    from wavepp.route.sent import MemoryOptions, SentPrefixes

    sent = SentPrefixes(MemoryOptions(memory_s=60.0, memory_blocks=5))
    sent.fly((1, 2, 3))
    sent.land((1, 2, 3), done=True, now=0.0)
    sent.fly((7, 8))
    sent.land((7, 8), done=True, now=1.0)
    assert sent.answered_blocks((1, 2, 3, 4), 4) == 3 and sent.answered_blocks((7, 8, 9), 3) == 2
    sent.fly((20, 21))
    sent.land((20, 21), done=True, now=2.0)  # 7 blocks > 5: the oldest prompt goes
    assert sent.answered_blocks((1, 2, 3, 4), 4) == 0
    assert sent.answered_blocks((7, 8, 9), 3) == 2 and sent.answered_blocks((20, 21), 2) == 2
    sent.fly(tuple(range(30, 36)))
    sent.land(tuple(range(30, 36)), done=True, now=3.0)  # alone over the bound: not kept
    assert sent.answered_blocks(tuple(range(30, 36)), 6) == 0 and sent.num_answered == 2
    off = SentPrefixes(MemoryOptions(memory_s=0.0))
    off.fly((1, 2))
    assert off.in_flight_blocks((1, 2, 3), 3) == 2
    off.land((1, 2), done=True, now=0.0)
    assert off.answered_blocks((1, 2, 3), 3) == 0 and not off.in_flight
    with pytest.raises(ValueError, match="memory_s"):
        MemoryOptions(memory_s=-1.0)


def test_the_routers_options_for_prefix_and_its_memory():
    from wavepp.route.__main__ import check, parser

    args = parser().parse_args(["--replica", "http://a:1", "--prefix-weight", "3",
                                "--sent-memory-s", "0", "--explain"])  # fmt: skip
    check(args)
    assert (args.prefix_weight, args.sent_memory_s) == (3.0, 0.0)
    assert args.explain and args.sent_memory_blocks == 1 << 18
    for argv, why in ((["--prefix-weight", "0.5"], "--prefix-weight must be in"),
                      (["--sent-memory-s", "-1"], "--sent-memory-s must be in"),
                      (["--policy", "least-load", "--prefix-weight", "3"],
                       "an option of --policy prefix, not least-load")):  # fmt: skip
        with pytest.raises(SystemExit, match=why):
            check(parser().parse_args(["--replica", "http://a:1", *argv]))
