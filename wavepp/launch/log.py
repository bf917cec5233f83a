"""One rank's log: a line on stderr, named by the rank."""

from __future__ import annotations

import os
import sys


def log(message: str) -> None:
    # one write per line: two ranks' lines never share one
    sys.stderr.write(f"[wavepp rank {os.environ.get('RANK', '0')}] {message}\n")
    sys.stderr.flush()
