"""The bookkeeping packages never import torch (checked in a fresh interpreter).

Every module of each package is imported, so the check cannot pass by importing an
empty namespace package.
"""

import importlib.util
import subprocess
import sys

import pytest

PURE = ["wavepp.state", "wavepp.plan", "wavepp.rounds", "wavepp.policy", "wavepp.checker"]

CHECK = """
import importlib, pkgutil, sys
package = importlib.import_module({name!r})
names = [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
names = [n for n in names if not n.endswith("__main__")]
for name in names:
    importlib.import_module(name)
assert names, "no modules found in " + {name!r}
assert "torch" not in sys.modules, [m for m in sys.modules if m.startswith("torch")][:5]
print(len(names))
"""


@pytest.mark.parametrize("package", PURE)
def test_pure_package_does_not_import_torch(package):
    spec = importlib.util.find_spec(package)
    if spec is None:
        pytest.fail(f"{package} is missing")
    assert spec.origin and spec.origin.endswith("__init__.py"), (
        f"{package} has no __init__.py listing its public names"
    )
    done = subprocess.run(
        [sys.executable, "-c", CHECK.format(name=package)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, f"{package} imports torch or fails to import:\n{done.stderr}"
    assert int(done.stdout.strip()) >= 1


def test_the_package_never_imports_the_benchmarks():
    """``benchmarks`` is not installed: no module of ``wavepp`` imports it."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "wavepp"
    offenders = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])  # fmt: skip
            offenders += [f"{path.relative_to(root)}: {n}" for n in names
                          if n == "benchmarks" or n.startswith("benchmarks.")]
    assert not offenders, offenders
