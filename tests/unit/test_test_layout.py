"""Test modules share code through ``tests/helpers`` (or a conftest's fixtures), never by
importing another test module or a conftest: each test module reads alone. The check
reads every file under ``tests/`` as text, so an import in the source of a child
process counts too."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
IMPORT = re.compile(r"^\s*(?:from|import)\s+(tests(?:\.\w+)*)", re.MULTILINE)


def imports_of_tests(source: str) -> list[str]:
    """The ``tests...`` modules ``source`` imports from, other than the helpers."""
    found = IMPORT.findall(source)
    return [name for name in found if name.split(".")[:2] != ["tests", "helpers"]]


def test_no_test_module_imports_another():
    offenders = [f"{path.relative_to(TESTS.parent)}: {name}"
                 for path in sorted(TESTS.rglob("*.py"))
                 for name in imports_of_tests(path.read_text())]  # fmt: skip
    assert not offenders, offenders


def test_the_check_sees_one():
    source = 'from tests.helpers.run import ROOT\ncode = """\n    import tests.unit.test_x\n"""'
    assert imports_of_tests(source) == ["tests.unit.test_x"]
    assert imports_of_tests("from tests.integration.conftest import ROOT") == [
        "tests.integration.conftest"
    ]
    assert (TESTS / "helpers" / "__init__.py").is_file()
