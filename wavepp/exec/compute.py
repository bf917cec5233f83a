"""The one thread of a process that runs its torch work: building the model and the
pools, timing the layers, and every wave.

OpenMP (libgomp, under the CPU build of torch) keeps a team of worker threads for each
thread that starts a parallel region. Once a process's teams hold more threads than it
has cores, libgomp stops letting idle workers spin (about a hundred tries, then sleep),
so each of a wave's thousands of parallel regions wakes its workers through the kernel.
Start-up work on the main thread and waves on a compute thread made two teams: at P = 1
on two cores (two threads), ``benchmarks.vllm_compare``'s shared-4k row through
``torchrun --nproc-per-node 1 -m wavepp.main`` ran at 41-53K tok/s with 4,400 voluntary
context switches, and at 58-62K with 600 once everything ran on this thread (three
interleaved runs each). So a rank does all of its torch work here, and other threads
touch tensors only in ways that start no parallel region (bytes through memoryviews,
tensors under torch's grain size) or after ``serial_here``. A process with one thread a
rank (P = 2 here) starts no team at all and gains nothing here.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_ident: int | None = None


def _mark() -> None:
    global _ident
    _ident = threading.get_ident()


def pool() -> ThreadPoolExecutor:
    """The process's compute thread (made on first use, never shut down: a process
    ending mid-wave exits without waiting for it)."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(1, thread_name_prefix="wavepp-compute",
                                       initializer=_mark)  # fmt: skip
        return _pool


def on_compute_thread() -> bool:
    return _ident is not None and threading.get_ident() == _ident


def submit(fn: Callable[..., T], *args, **kwargs) -> Future[T]:
    """Run ``fn`` on the compute thread, behind whatever it is running now."""
    return pool().submit(fn, *args, **kwargs)


def call(fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` on the compute thread, waiting for it (at once when this
    is the compute thread)."""
    if on_compute_thread():
        return fn(*args, **kwargs)
    return submit(fn, *args, **kwargs).result()


_serial = threading.local()


def serial_here() -> None:
    """Keep this thread's torch work out of OpenMP: a thread other than the compute thread
    that works on large tensors (a handoff band's gather, a vLLM file's layout) would start
    a team of its own, and with it every team's workers sleep between regions. Under
    OpenMP, torch asks the calling thread's own thread count, which this sets to one
    (``omp_set_num_threads`` of the libgomp torch loaded); ops then run inline. Once per
    thread; a no-op on the compute thread, at one thread, or without libgomp."""
    import torch

    if getattr(_serial, "done", False) or on_compute_thread():
        return
    _serial.done = True
    if torch.get_num_threads() > 1 and (gomp := _libgomp()) is not None:  # torch's set-up first
        gomp.omp_set_num_threads(1)


def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process loaded (torch's own copy in its wheels), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        if os.path.isfile(path):
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    return None
