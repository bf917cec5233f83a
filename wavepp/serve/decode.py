"""The server's decoder (``--decode``): where ``/v1/completions`` hands prompts' caches
and gets their continuations from.

``--decode ADDRESS`` names a running decode worker (``python -m wavepp.decode --model DIR
--listen ADDRESS``, or any receiver that speaks its protocol, ``docs/handoff.md``);
``--decode auto`` starts one next to the server, on a Unix socket, for the server's own
model: a Hugging Face checkpoint directory as it is, the built-in ``tiny-kimi`` written
out as a Kimi Linear directory first. It is stopped when the server stops.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import anyio.to_thread

from wavepp.handoff.wire import parse_address

PING_MAGIC = b"WPHP"  # a liveness probe on the worker's address; it answers PONG
PONG = b"WPHP"
START_TIMEOUT_S = 300.0  # loading the model may take minutes for a large checkpoint


def check_decode_option(value: str | None) -> str | None:
    """``--decode``: None, ``auto`` or an address (checked here, before any rank starts)."""
    if value is None:
        return value
    if value == "auto":
        import importlib.util

        if importlib.util.find_spec("transformers") is None:
            raise SystemExit("wavepp serve: --decode auto runs the reference decode worker, "
                             "which needs transformers: pip install -e '.[decode]'")  # fmt: skip
        return value
    try:
        address = parse_address(value)
    except ValueError as error:
        raise SystemExit(f"wavepp serve: --decode: {error}") from None
    if address.kind == "dir":
        raise SystemExit("wavepp serve: --decode takes unix:/path, tcp://host:port or auto")
    return value


def model_directory(model: str, seed: int, scratch: Path) -> Path:
    """A directory ``transformers`` loads for the server's model (writing tiny-kimi out)."""
    from wavepp.model import BUILTIN, random_weights
    from wavepp.model.checkpoint import write_checkpoint

    if Path(model).is_dir() and (Path(model) / "config.json").exists():
        return Path(model)
    cfg = BUILTIN.get(model)
    if cfg is not None and cfg.family == "kimi_linear":
        out = scratch / "model"
        write_checkpoint(out, cfg, random_weights(cfg, seed))
        return out
    raise SystemExit(f"wavepp serve: --decode auto needs a Hugging Face checkpoint directory or "
                     f"the built-in tiny-kimi, not {model!r} (start a decoder yourself and pass "
                     "--decode ADDRESS)")  # fmt: skip


@contextlib.asynccontextmanager
async def decoder(option: str | None, model: str, seed: int, dtype: str,
                  log) -> AsyncIterator[str | None]:  # fmt: skip
    """The decoder's address for the server's lifetime (None without ``--decode``)."""
    if option != "auto":
        yield option
        return
    scratch = Path(tempfile.mkdtemp(prefix="wavepp-decode-"))
    process = None
    try:
        directory = model_directory(model, seed, scratch)
        address = f"unix:{scratch / 'decode.sock'}"
        command = [sys.executable, "-m", "wavepp.decode", "--model", str(directory),
                   "--listen", address, "--dtype", dtype]  # fmt: skip
        log(f"starting the decode worker: {' '.join(command)}")
        process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        ready = await anyio.to_thread.run_sync(_wait_ready, process, START_TIMEOUT_S)
        log(f"decode worker {ready}")
        yield address
    finally:
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                await anyio.to_thread.run_sync(process.wait, 10)
            if process.poll() is None:
                process.kill()
        shutil.rmtree(scratch, ignore_errors=True)


def _wait_ready(process: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise SystemExit(f"wavepp serve: the decode worker exited ({process.wait()}) before "
                             "it listened; its errors are above")  # fmt: skip
        if line.startswith("listening on"):
            # its later output goes on to ours (a pipe nobody reads would block it)
            threading.Thread(target=shutil.copyfileobj, args=(process.stdout, sys.stdout),
                             daemon=True).start()  # fmt: skip
            return line.strip()
    os.kill(process.pid, signal.SIGKILL)
    raise SystemExit(f"wavepp serve: the decode worker did not listen within {timeout_s:g} s")
