"""The server's decoder (``--decode``): where ``/v1/completions`` hands prompts' caches
and gets their continuations from.

``--decode ADDRESS`` names a running decode worker (``python -m wavepp.decode --model DIR
--listen ADDRESS``, or any receiver that speaks its protocol, ``docs/handoff.md``);
``--decode auto`` starts one next to the server, on a Unix socket, for the server's own
model: a Hugging Face checkpoint directory as it is, the built-in ``tiny-kimi`` written
out as a Kimi Linear directory first. It is stopped when the server stops.

The server watches its decoder (:class:`Decoder`): it probes the address every
``PROBE_INTERVAL_S`` (a ``b"WPHL"`` the worker answers); the worker it started it also
restarts when it exits, after ``RESTART_DELAYS_S`` (1 s, then 2, 4, 8, 16, 30 s while it
keeps failing; back to 1 s once one stayed up ``STABLE_S``), saying so in the log and in
``/metrics`` (``wavepp_decoder_up``, ``wavepp_decoder_restarts_total``). While it cannot
serve, ``/health`` answers 503 ``{"status": "degraded", "error": why}`` and a completion
that would decode gets a JSON 503 at once (before its prefill).
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

from wavepp.handoff.client import PING_MAGIC, PONG
from wavepp.handoff.wire import parse_address

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
        parse_address(value)
    except ValueError as error:
        raise SystemExit(f"wavepp serve: --decode: {error}") from None
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


PROBE_INTERVAL_S = 2.0  # how often the server probes its decoder (/health)
PROBE_TIMEOUT_S = 2.0  # a probe not answered within this fails
RESTART_DELAYS_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)  # --decode auto: between restarts
STABLE_S = 60.0  # a worker up this long resets the restart delay to its first


class Decoder:
    """The decoder as the server sees it: its address, whether it can serve now
    (``down``: the reason when not, as ``/health`` says it), and the restarts of the worker
    the server started (``--decode auto``). Read and written on the event loop only."""

    def __init__(self, address: str, managed: bool = False) -> None:
        self.address = address
        self.managed = managed  # started (and restarted) by the server
        self.down: str | None = None
        self.restarts = 0  # times the server restarted its worker
        self.probe_failures = 0

    def collect(self):
        """Prometheus: ``wavepp_decoder_up`` and ``wavepp_decoder_restarts_total``."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        yield GaugeMetricFamily("wavepp_decoder_up", "1 while the decoder (--decode) can serve "
                                "completions, else 0 (/health says why)",
                                value=0.0 if self.down else 1.0)  # fmt: skip
        yield CounterMetricFamily("wavepp_decoder_restarts", "times the server restarted the "
                                  "decode worker it started (--decode auto)",
                                  value=float(self.restarts))  # fmt: skip


async def probe(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None when the worker at ``address`` answers a liveness probe, else why not."""
    from wavepp.handoff import _io

    try:
        with anyio.fail_after(timeout_s):
            conn = await _io.connect(parse_address(address), timeout_s)
            try:
                await conn.send(PING_MAGIC)
                answer = await conn.read_exactly(len(PONG))
            finally:
                conn.close()
    except (OSError, TimeoutError) as error:
        return f"the decode worker at {address} does not answer: {error!r}"
    if answer != PONG:
        return f"the decode worker at {address} answered a probe with {answer!r}"
    return None


async def _watch(decoder: Decoder, log) -> None:
    """``--decode ADDRESS``: probe it every PROBE_INTERVAL_S; say when it goes and comes."""
    while True:
        why = await probe(decoder.address)
        if why and not decoder.down:
            log(f"decoder down: {why}; completions that decode get 503 until it answers")
        elif decoder.down and not why:
            log(f"decoder at {decoder.address} answers again")
        decoder.down = why
        await anyio.sleep(PROBE_INTERVAL_S)


@contextlib.asynccontextmanager
async def decoder(option: str | None, model: str, seed: int, dtype: str, log,
                  secret_file: str | None = None) -> AsyncIterator[Decoder | None]:  # fmt: skip
    """The decoder for the server's lifetime (None without ``--decode``): probed
    (``--decode ADDRESS``), or started, watched and restarted with backoff (``auto``:
    given the run's ``--handoff-secret`` file, or $WAVEPP_HANDOFF_SECRET, which it
    inherits)."""
    if option is None:
        yield None
        return
    if option != "auto":
        state = Decoder(option)
        state.down = await probe(option)
        if state.down:
            log(f"decoder down: {state.down}; completions that decode get 503 until it answers")
        async with anyio.create_task_group() as tg:
            tg.start_soon(_watch, state, log)
            try:
                yield state
            finally:
                tg.cancel_scope.cancel()
        return
    scratch = Path(tempfile.mkdtemp(prefix="wavepp-decode-"))
    worker = _Managed(log)
    try:
        directory = model_directory(model, seed, scratch)
        address = f"unix:{scratch / 'decode.sock'}"
        worker.command = [sys.executable, "-m", "wavepp.decode", "--model", str(directory),
                          "--listen", address, "--dtype", dtype]  # fmt: skip
        if secret_file:
            worker.command += ["--handoff-secret", secret_file]
        state = Decoder(address, managed=True)
        log(f"starting the decode worker: {' '.join(worker.command)}")
        ready = await worker.start()
        log(f"decode worker {ready}")
        async with anyio.create_task_group() as tg:
            tg.start_soon(worker.supervise, state)
            try:
                yield state
            finally:
                tg.cancel_scope.cancel()
    finally:
        worker.stop()
        shutil.rmtree(scratch, ignore_errors=True)


class _Managed:
    """The worker process ``--decode auto`` started, restarted when it exits."""

    def __init__(self, log) -> None:
        self.log = log
        self.command: list[str] = []
        self.process: subprocess.Popen | None = None

    async def start(self) -> str:
        """Start it and wait for its ready line (SystemExit: it exited or never listened)."""
        self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, text=True)
        return await anyio.to_thread.run_sync(_wait_ready, self.process, START_TIMEOUT_S)

    async def supervise(self, state: Decoder) -> None:
        """Watch the process (and probe it: a hung worker is down too); when it exits,
        restart it after RESTART_DELAYS_S (longer each time it fails again soon)."""
        failures, up_since = 0, time.monotonic()
        next_probe = time.monotonic() + PROBE_INTERVAL_S
        while True:
            await anyio.sleep(0.2)
            code = self.process.poll()
            if code is None:
                if time.monotonic() - up_since > STABLE_S:
                    failures = 0
                if time.monotonic() >= next_probe:
                    why = await probe(state.address)
                    if why and not state.down:
                        self.log(f"decoder down: {why}")
                    elif state.down and not why:
                        self.log("decode worker answers again")
                    state.down, next_probe = why, time.monotonic() + PROBE_INTERVAL_S
                continue
            while True:  # exited: restart until one listens
                delay = RESTART_DELAYS_S[min(failures, len(RESTART_DELAYS_S) - 1)]
                failures += 1
                state.down = (f"the decode worker exited ({_how(code)}); restarting it in "
                              f"{delay:g} s (restart {state.restarts + 1})")  # fmt: skip
                self.log(state.down)
                await anyio.sleep(delay)
                state.restarts += 1
                try:
                    ready = await self.start()
                except SystemExit as error:
                    code = self.process.wait()
                    self.log(f"decode worker restart {state.restarts} failed: {error}")
                    continue
                break
            state.down, up_since = None, time.monotonic()
            next_probe = up_since + PROBE_INTERVAL_S
            self.log(f"decode worker restarted (restart {state.restarts}): {ready}")

    def stop(self) -> None:
        process = self.process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)
            if process.poll() is None:
                process.kill()
                process.wait()


def _how(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit {code}"


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
