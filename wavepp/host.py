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


def cpu_times() -> tuple[int, ...] | None:
    """The machine's CPU time since boot, all cores summed, in clock ticks: the first line
    of ``/proc/stat`` (user, nice, system, idle, iowait, irq, softirq, steal, ...); None
    where there is no such file (not Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    return tuple(int(x) for x in fields[1:])


STEAL = 7  # the eighth counter: time the hypervisor ran other guests on this one's cores


def steal_share(before: tuple[int, ...] | None, after: tuple[int, ...] | None) -> float | None:
    """Of the machine's CPU time between two ``cpu_times()``, the share the hypervisor
    took (``st`` in ``top``). On a shared virtual machine a run's throughput falls with
    it: compare runs' throughput only beside it. None where either is None or no time
    passed."""
    if before is None or after is None:
        return None
    spent = [b - a for a, b in zip(before, after, strict=True)]
    total = sum(spent[: STEAL + 1])  # guest time after it is counted in user time already
    return spent[STEAL] / total if total > 0 else None


def available_memory() -> int | None:
    """Bytes this process could still allocate: the machine's ``MemAvailable`` (Linux's
    estimate of what can be had without swapping), or less where a cgroup limits this
    process (its ``memory.max`` minus its ``memory.current``); None where neither says."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max":
            found.append(max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass
    return min(found) if found else None
