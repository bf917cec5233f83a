"""Every command the README, the guide and benchmarks/README.md show runs after the README's
install (``pip install -e .``), or the text says which extra it needs: each documented module
answers ``--help``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "docs" / "guide.md", ROOT / "benchmarks" / "README.md"]
README = "\n".join(path.read_text() for path in DOCS)
MODULES = sorted(set(re.findall(r"-m\s+((?:wavepp|benchmarks)[\w.]*\w)", README)))


def test_the_readme_shows_commands():
    assert {"wavepp.main", "wavepp.serve", "wavepp.serve.launch", "benchmarks.kernels"} <= set(
        MODULES
    )


# One interpreter answers every module's --help in turn (two interpreters, not two per
# module: each start imports torch); a module's answer is its exit code and what it printed.
DRIVER = """
import contextlib, io, json, runpy, sys
if sys.argv[1] == "bare":
    sys.modules["transformers"] = None  # the README's install has no dev extra
answers = {}
for module in sys.argv[2:]:
    out = io.StringIO()
    sys.argv = [module, "--help"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_module(module, run_name="__main__")
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException as error:  # an import that fails, say
        code, out = 1, io.StringIO(out.getvalue() + f"{type(error).__name__}: {error}")
    answers[module] = (code, out.getvalue()[:3000])
print("@@answers " + json.dumps(answers))
"""


@pytest.fixture(scope="module")
def answers() -> dict[str, dict[str, tuple[int, str]]]:
    out = {}
    for mode in ("full", "bare"):
        done = subprocess.run([sys.executable, "-c", DRIVER, mode, *MODULES], cwd=ROOT,
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        line = [x for x in done.stdout.splitlines() if x.startswith("@@answers ")]
        assert line, done.stderr[-3000:]
        out[mode] = json.loads(line[-1][len("@@answers ") :])
    return out


@pytest.mark.parametrize("module", MODULES)
def test_each_documented_command_answers_help(module, answers):
    code, text = answers["full"][module]
    assert code == 0, text
    assert "usage" in text.lower()
    # without the dev extra (transformers): it still answers, or the README says it needs it
    code, text = answers["bare"][module]
    if code != 0:
        at = README.index(f"-m {module}")
        assert "dev extra" in README[max(0, at - 300) : at], text
