"""Example policies: three-plus working alternatives and two deliberately broken ones.

Each module exports ``POLICY``. Check one with
``python -m wavepp.checker examples.policies.<name>:POLICY`` and run it with
``torchrun --nproc-per-node 4 -m wavepp.main --policy examples.policies.<name>:POLICY``.

Working: ``lfu`` (least frequently used eviction), ``recompute_cost`` (evict the tails
cheapest to recompute first), ``smallest_fit`` (smallest escrow first with an aging
bound), ``fair_share`` (a planner that splits each wave evenly), ``interval_only`` (the
paper's snapshot placement, without the default's junction snapshots), ``counting`` (the
default, recording each materialize call's rank into ``$WAVEPP_COUNT_FILE``).
Broken on purpose (the tests show the checker rejects them): ``broken_evicts_leased``,
``broken_escrow_double_count``.
"""
