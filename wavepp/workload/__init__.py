"""Request generators and trace readers (DESIGN §7). Deterministic by seed."""

from wavepp.workload.generators import (
    MAX_DEADLINE_S,
    WORKLOADS,
    RequestSpec,
    cold,
    conversation,
    expected_by_blocks,
    mixed,
    seeded,
    short_suffix,
)
from wavepp.workload.requests_file import read_requests_file
from wavepp.workload.trace import read_trace, trace

__all__ = [
    "MAX_DEADLINE_S",
    "WORKLOADS",
    "RequestSpec",
    "cold",
    "conversation",
    "expected_by_blocks",
    "mixed",
    "read_requests_file",
    "read_trace",
    "seeded",
    "short_suffix",
    "trace",
]
