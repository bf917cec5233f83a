"""Launch real multi-process runs: torchrun, Gloo, localhost."""

from __future__ import annotations

import json

import pytest

from tests.helpers.run import torchrun


@pytest.fixture
def run_wavepp(tmp_path):
    def run(nproc: int, *options: str, timeout: float = 240) -> tuple[dict, str]:
        out = tmp_path / f"run-{len(list(tmp_path.iterdir()))}.json"
        proc = torchrun(
            nproc, ["-m", "wavepp.main", "--no-progress", "--json", str(out), *options], timeout
        )
        return json.loads(out.read_text()), proc.stdout

    return run
