"""A run whose last stage takes 2 s longer to start than rank 0 (torchrun, 2 ranks, sim).

Writes, next to ``argv[1]``, when rank 1's stage was ready and when rank 0 began to
measure, so the test can check that the measured phase began after every stage was
ready (its first round used to wait out the slow stage's start-up, inside the measure).
"""

import sys
import time
from pathlib import Path

import wavepp.main
from wavepp.launch.backends import DatasheetBackend
from wavepp.runtime.feed import Feed

out = Path(sys.argv[1])
build = DatasheetBackend.build_executor


def slow_build(self, rank, *args, **kwargs):
    built = build(self, rank, *args, **kwargs)
    if rank == 1:
        time.sleep(2.0)  # a compile, a large pool to zero
        (out.parent / "ready-1").write_text(repr(time.time()))
    return built


DatasheetBackend.build_executor = slow_build
call = Feed.__call__


async def measured(self):
    await call(self)
    (out.parent / "measure-start").write_text(repr(self.measure_start))


Feed.__call__ = measured

if __name__ == "__main__":
    wavepp.main.main(sys.argv[2:])
