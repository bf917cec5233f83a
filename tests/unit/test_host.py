"""The machine facts a run's record carries: the share of CPU time the hypervisor took."""

import sys

import pytest

from wavepp.host import STEAL, cpu_times, steal_share


def _times(user: int, idle: int, steal: int) -> tuple[int, ...]:
    counters = [0] * 10
    counters[0], counters[3], counters[STEAL] = user, idle, steal
    return tuple(counters)


def test_the_steal_share_is_steal_over_all_time_spent_between_the_two_readings():
    before, after = _times(100, 50, 10), _times(160, 70, 30)  # 60 + 20 + 20 ticks spent
    assert steal_share(before, after) == pytest.approx(0.2)
    assert steal_share(before, before) is None  # no time passed
    guest = (*after[:8], 50, 0)  # time this machine's own guests ran: part of user time
    assert steal_share(before, guest) == pytest.approx(0.2)
    assert steal_share(None, after) is None and steal_share(before, None) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_the_machine_counters_are_read_and_only_grow():
    first = cpu_times()
    sum(i * i for i in range(200_000))  # some CPU time passes
    second = cpu_times()
    assert first is not None and len(first) > STEAL
    assert all(b >= a for a, b in zip(first, second, strict=True))
    share = steal_share(first, cpu_times())
    assert share is None or 0.0 <= share <= 1.0
