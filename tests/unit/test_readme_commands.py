"""Every command the README shows runs after the README's install (``pip install -e .``),
or the README says which extra it needs: each documented module answers ``--help``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
MODULES = sorted(set(re.findall(r"-m\s+(wavepp[\w.]*\w)", README)))


def test_the_readme_shows_commands():
    assert {"wavepp.main", "wavepp.serve", "wavepp.serve.launch", "wavepp.bench.kernels"} <= set(
        MODULES
    )


@pytest.mark.parametrize("module", MODULES)
def test_each_documented_command_answers_help(module):
    done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in (done.stdout + done.stderr).lower()
    # without the dev extra (transformers): it still answers, or the README says it needs it
    bare = subprocess.run(
        [sys.executable, "-c", "import runpy, sys; sys.modules['transformers'] = None; "
         f"sys.argv = ['{module}', '--help']; runpy.run_module('{module}', run_name='__main__')"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if bare.returncode != 0:
        at = README.index(f"-m {module}")
        assert "dev extra" in README[max(0, at - 300) : at], bare.stderr[-1000:]
