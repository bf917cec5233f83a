"""Installs are reproducible: every requirement in pyproject.toml has a tested range
(a lower and an upper bound, torch pinned exactly), constraints.txt pins each of them
inside its range, and the running environment is the locked one (skipped under
``.ci/drift``, which installs the newest releases on purpose)."""

from __future__ import annotations

import os
import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
REQUIREMENTS = [
    Requirement(r)
    for r in PROJECT["dependencies"]
    + [r for extra in PROJECT["optional-dependencies"].values() for r in extra]
]


def _pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", line)
        assert match, f"constraints.txt: {line!r} is not NAME==VERSION"
        pins[canonicalize_name(match[1])] = Version(match[2])
    return pins


@pytest.mark.parametrize("req", REQUIREMENTS, ids=str)
def test_every_requirement_has_a_tested_range(req):
    ops = {spec.operator for spec in req.specifier}
    if req.name == "torch":
        assert ops == {"=="}, "torch is pinned exactly: a range pulls a CUDA build"
    else:
        assert ">=" in ops and "<" in ops, f"{req}: needs a lower and an upper bound"


def test_the_lock_pins_every_requirement_inside_its_range():
    pins = _pins()
    for req in REQUIREMENTS:
        if req.name.startswith("flashinfer"):  # the cuda extra: not installed on CPU
            continue
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not pinned in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {req.name}=={pins[name]} outside pyproject's {req.specifier}"
        )


@pytest.mark.skipif(os.environ.get("WAVEPP_DEPS") in ("newest", "lowest"),
                    reason=".ci/drift: the newest (or lowest) releases, not the locked ones")
def test_the_environment_is_the_locked_one():
    """A fresh install with -c constraints.txt gets exactly the pins."""
    wrong = []
    for name, version in _pins().items():
        try:
            have = Version(metadata.version(name))
        except metadata.PackageNotFoundError:
            continue  # platform-specific pins (none today) may be absent
        if Version(have.base_version) != version and have != version:
            wrong.append(f"{name} {have} (locked {version})")
    assert not wrong, "installed outside constraints.txt: " + ", ".join(wrong)
