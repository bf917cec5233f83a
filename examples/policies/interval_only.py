"""The placement of the paper and of WavePP before junction snapshots: a snapshot every
``--snapshot-interval`` blocks and at each request's end, none where prefixes branch.
Kept as a working alternative to compare against (``--policy
examples.policies.interval_only:POLICY``): on the conversation workload a hybrid model
loses most reuse of shared system prompts with it."""

import attrs

from wavepp.policy import DEFAULT, every_interval_and_end

POLICY = attrs.evolve(DEFAULT, name="interval-only", snapshot_placement=every_interval_and_end)
