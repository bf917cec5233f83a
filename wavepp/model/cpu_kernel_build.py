"""Builds WavePP's CPU attention kernel into one cache directory, at most once.

:mod:`wavepp.model.cpu_kernel` runs this file by its path, in a subprocess it can kill
when the build outlasts its timeout, so it imports only the standard library and
torch. ``python cpu_kernel_build.py SPEC`` (a JSON object: ``name``, ``sources``,
``directory``, ``cflags``, ``ldflags``) exits 0 once ``directory/<name>.so`` exists,
or 1 with the reason in ``directory/FAILED``.

The build is ``torch.utils.cpp_extension.load`` (ninja, and its file baton ``lock``
in the directory). The baton cannot tell a holder that died (a rank killed while it
compiled) from a live one, so every builder first takes an exclusive ``flock`` on
``directory/build.flock``, which the kernel releases when its holder exits: under it,
a baton left behind is stale and removed, a library a builder made while this one
waited is taken as it is, and a failure another builder remembered is not retried.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
from pathlib import Path


def first_error(output: str) -> str:
    """The line of a compiler's output that says what went wrong."""
    lines = output.strip().splitlines()
    errors = [ln for ln in lines if "error" in ln]
    return (errors or lines or ["no output"])[0].strip()


def build(spec: dict) -> int:
    directory = Path(spec["directory"])
    failed = directory / "FAILED"
    with open(directory / "build.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if failed.exists():
            return 1
        (directory / "lock").unlink(missing_ok=True)
        if (directory / f"{spec['name']}.so").exists():
            return 0
        from torch.utils.cpp_extension import load

        try:
            load(spec["name"], spec["sources"], extra_cflags=spec["cflags"],
                 extra_ldflags=spec["ldflags"], build_directory=str(directory),
                 is_python_module=False)  # fmt: skip
        except Exception as error:  # the compiler's or the loader's, to remember
            written = directory / "FAILED.tmp"
            written.write_text(first_error(str(error)) + "\n")
            written.replace(failed)
            return 1
    return 0


if __name__ == "__main__":
    os.umask(0o077)  # what the build writes is this user's alone
    sys.exit(build(json.loads(sys.argv[1])))
