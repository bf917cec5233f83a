"""STYLE §1: the bookkeeping packages never import torch (checked in a fresh interpreter)."""

import importlib.util
import subprocess
import sys

import pytest

PURE = ["wavepp.state", "wavepp.plan", "wavepp.rounds"]


@pytest.mark.parametrize("package", PURE)
def test_pure_package_does_not_import_torch(package):
    if importlib.util.find_spec(package) is None:
        pytest.fail(f"{package} is missing")
    code = f"import sys, {package}; assert 'torch' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
