"""Facts about the machine a process runs on (torch-free: launchers and benches use it)."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask: a cpuset or ``taskset``
    may allow fewer than the machine has)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
