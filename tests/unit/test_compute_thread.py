"""A rank's torch work runs on one thread (``wavepp.exec.compute``): libgomp keeps a team
of workers per thread that starts a parallel region, and a second team on two cores
stops every team's workers spinning between regions."""

import os
import subprocess
import sys
import textwrap
import threading

import anyio
import numpy as np
import pytest

from wavepp.exec import compute
from wavepp.exec.base import ChunkWork
from wavepp.exec.torch_exec import TorchExecutor
from wavepp.model import BUILTIN, build_stage, random_weights


def test_call_runs_on_one_thread_and_nests_without_waiting():
    main = threading.get_ident()
    first = compute.call(threading.get_ident)
    assert first != main and compute.call(threading.get_ident) == first
    assert compute.call(lambda: compute.call(threading.get_ident)) == first  # inline
    assert not compute.on_compute_thread() and compute.call(compute.on_compute_thread)


def test_waves_run_on_the_compute_thread():
    cfg = BUILTIN["tiny-llama"]
    stage = build_stage(cfg, range(cfg.num_layers), True, True, random_weights(cfg, 0))
    ex = TorchExecutor(stage, 4, 16)
    seen = []
    forward = ex.forward
    ex.forward = lambda *a: (seen.append(threading.get_ident()), forward(*a))[1]
    chunk = ChunkWork("a", 0, 16, 16, (0,), (), False, tokens=np.arange(16, dtype=np.int32))
    out = anyio.run(ex.run, [chunk], None)
    assert out.seconds > 0 and seen == [compute.call(threading.get_ident)]


SCRIPT = """
import os, anyio, numpy as np, torch
torch.set_num_threads(2)
from wavepp.exec import compute
from wavepp.exec.base import ChunkWork
from wavepp.exec.torch_exec import TorchExecutor
from wavepp.model import BUILTIN, build_stage, random_weights

def tasks():
    return len(os.listdir("/proc/self/task"))

def build():
    cfg = BUILTIN["tiny-llama"]
    weights = random_weights(cfg, 0)
    return TorchExecutor(build_stage(cfg, range(cfg.num_layers), True, True, weights), 96, 16)

before = tasks()
ex = compute.call(build)  # as wavepp.main builds a stage
for n in range(3):
    chunk = ChunkWork(f"r{n}", 0, 512, 512, tuple(range(32 * n, 32 * n + 32)), (), False,
                      tokens=np.arange(512, dtype=np.int32))
    anyio.run(ex.run, [chunk], None)
built_and_ran = tasks() - before
torch.randn(1 << 20).mul(2).sum()  # a parallel region on the main thread: its own team
print(built_and_ran, tasks() - before)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_building_and_running_a_stage_makes_one_openmp_team():
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT)], capture_output=True,
                         text=True, timeout=300, check=True)  # fmt: skip
    built_and_ran, with_main = map(int, out.stdout.split())
    # the compute thread and its one worker (2 threads); anyio's loop adds no thread here
    assert built_and_ran == 2, out.stdout
    assert with_main == 3  # the check can fail: a second team is one more thread


SERIAL = """
import os, sys, threading, torch
torch.set_num_threads(2)
from wavepp.exec import compute

def tasks():
    return len(os.listdir("/proc/self/task"))

x = compute.call(lambda: torch.randn(1 << 22))
compute.call(lambda: x.mul(2).sum())  # the compute thread's team
before = tasks()

def gather(serial):
    if serial:
        compute.serial_here()
    torch.cat([x.index_select(0, torch.randperm(1 << 22))] * 2)
    # threads besides this one, counted while it lives (a team's workers live as long as
    # the thread that started them)
    print(torch.get_num_threads(), tasks() - before - 1, end=" ")

for serial in (True, False):  # a band's gather on a sender thread, then the same without
    thread = threading.Thread(target=gather, args=(serial,))
    thread.start()
    thread.join()
print(compute.call(torch.get_num_threads))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_serial_thread_starts_no_openmp_team_and_leaves_the_compute_threads_alone():
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(SERIAL)], capture_output=True,
                         text=True, timeout=300, check=True)  # fmt: skip
    serial_threads, serial_extra, plain_threads, plain_extra, compute_threads = map(
        int, out.stdout.split()
    )
    assert (serial_threads, serial_extra) == (1, 0), out.stdout  # ran inline, no new thread
    assert plain_threads == 2 and plain_extra > 0, out.stdout  # the check can fail
    assert compute_threads == 2
