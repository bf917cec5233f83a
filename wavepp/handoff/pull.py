"""A stage's band server: bands held for the decoder that pulls them (``pull:`` targets,
``docs/handoff.md``).

A request whose handoff target is ``pull:`` parks each stage's band here when it ends
there: :meth:`PullTransport.deliver` registers it and waits — holding its blocks in the
pool, no byte budget, under the sender's lease — for a decoder to ask. A decoder opens a
connection to the stage's band server and sends one pull frame (``wire.Pull``); before
anything of the cache is read the stage checks it: the frame's bounds and strict decoding
(``wire.pull_length``, ``wire.decode_pull``), the stage number, the decoder's model
fingerprint against its own field by field, and that it holds the request for pulling
(a pull may come before the stage has parked its band: it waits up to
``REGISTER_WAIT_S`` for it). Given the shared secret (``settings.secret``), the pull must
be signed with it (``wavepp.handoff.auth``), checked before anything else; the frame must
come whole within ``PULL_TIMEOUT_S`` of the connection. A refused pull gets an
``Ack(ok=False)`` naming why and the connection closes; the band stays parked for another
pull until its lease ends. An accepted pull claims the band (the lease stops, the sender's
timeout starts) and the band goes out over the decoder's connection exactly as a push
would (``socket_send.SocketTransport.send``); the decoder's ack settles it, and so does its
refusal, a closed connection, the timeout or the request's cancel. An ack after that
finds the connection closed.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import anyio
import attrs

from wavepp.handoff import _io, wire
from wavepp.handoff.auth import Verifier
from wavepp.handoff.base import Band, HandoffSettings, WorkerThreads
from wavepp.handoff.socket_send import SocketTransport

log = logging.getLogger("wavepp.handoff")

REGISTER_WAIT_S = 5.0  # a pull for a band not parked yet waits this long for it
PULL_TIMEOUT_S = 10.0  # the whole pull frame must come this soon after the connection
MAX_CONNECTIONS = 256  # pulls served (or waiting for their band) at once
MAX_SETTLED = 4096  # ids of bands no longer held, remembered: a pull for one is refused at once
WILDCARDS = ("0.0.0.0", "::", "")
AUTO = "auto"  # --handoff-serve's default: a Unix socket in a private directory


def band_server_address(option: str, stage: int, folder: Path | None = None) -> wire.Address:
    """Where stage ``stage`` listens for pulls: ``unix:PREFIX`` gives
    ``unix:PREFIX-stage{stage}.sock``; ``tcp://HOST:PORT`` gives PORT + ``stage`` (0
    stays 0: any free port); ``auto`` gives ``h-stage{stage}.sock`` in ``folder``.
    ValueError for anything else."""
    if option == AUTO:
        if folder is None:
            raise ValueError("--handoff-serve auto needs a folder")
        return wire.parse_address(f"unix:{folder / f'h-stage{stage}.sock'}")
    address = wire.parse_address(option, any_port=True)
    if address.kind == "unix":
        return wire.parse_address(f"unix:{address.path}-stage{stage}.sock")
    port = address.port + stage if address.port else 0
    if port > 65535:
        raise ValueError(f"--handoff-serve {option}: stage {stage} would listen on port "
                         f"{port}, above 65535")  # fmt: skip
    return attrs.evolve(address, port=port)


def advertised(bound: wire.Address, advertise: str | None) -> str:
    """The address decoders reach a band server bound at ``bound`` by: a wildcard host
    replaced by ``advertise``."""
    if bound.kind == "tcp" and bound.host in WILDCARDS:
        if not advertise:
            raise ValueError(f"a band server bound to {bound} needs --handoff-advertise HOST "
                             "(the host decoders connect to)")  # fmt: skip
        return str(attrs.evolve(bound, host=advertise))
    return str(bound)


@attrs.define(eq=False)
class _Parked:
    """A band waiting on the band server for its decoder."""

    band: Band
    arrived: anyio.Event = attrs.Factory(anyio.Event)  # a pull was accepted: sock is set
    done: anyio.Event = attrs.Factory(anyio.Event)  # the band no longer uses sock
    sock: socket.socket | None = None  # the decoder's connection, once accepted


class PullTransport:
    """``pull:`` targets (``wavepp.handoff.base.Transport``): the stage's band server,
    listening (bound when built) at ``settings.serve``; serves no kind without one."""

    parks = True

    def __init__(self, settings: HandoffSettings, threads: WorkerThreads) -> None:
        self.settings = settings
        self._wire = SocketTransport(settings, threads)
        self._parked: dict[str, _Parked] = {}
        self._registered: dict[str, anyio.Event] = {}  # pulls waiting for their band
        self._settled: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.counts: collections.Counter[str] = collections.Counter()
        self._verifier = Verifier(settings.secret) if settings.secret else None
        self._listener: socket.socket | None = None
        self._bound: wire.Address | None = None
        self._folder: Path | None = None  # a private directory of its own (auto)
        self.kinds: tuple[str, ...] = ()
        self.address: str | None = None
        if settings.serve is None:
            return
        if settings.serve == AUTO:
            self._folder = Path(tempfile.mkdtemp(prefix="wavepp-pull-"))
        try:
            where = band_server_address(settings.serve, settings.stage, self._folder)
            self._listener, self._bound = _io.listen(where)
            self.address = advertised(self._bound, settings.advertise)
        except BaseException:
            self.close()
            raise
        self.kinds = ("pull",)

    def figures(self) -> dict[str, float]:
        """Bands parked now, and the pulls accepted and refused so far."""
        return {"pull_parked": len(self._parked),
                "pulls_accepted": self.counts["accepted"],
                "pulls_refused": self.counts["refused"]}  # fmt: skip

    def close(self) -> None:
        """Stop listening; remove the socket file (and the private directory)."""
        if self._listener is not None:
            _io.close_socket(self._listener)
            self._listener = None
        if self._bound is not None and self._bound.kind == "unix":
            with contextlib.suppress(OSError):
                os.unlink(self._bound.path)
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    # -- the band's side -----------------------------------------------------------

    async def deliver(self, band: Band) -> int:
        rid = band.job.request_id
        parked = _Parked(band)
        self._parked[rid] = parked
        waiter = self._registered.pop(rid, None)
        if waiter is not None:
            waiter.set()
        try:
            await parked.arrived.wait()  # the lease (the sender's scope) bounds the wait
            async with band.turn():
                return await self._wire.send(band, parked.sock)
        finally:
            del self._parked[rid]
            self._settled[rid] = None
            while len(self._settled) > MAX_SETTLED:
                self._settled.popitem(last=False)
            if parked.sock is not None:
                _io.close_socket(parked.sock)
            parked.done.set()

    # -- the decoders' side --------------------------------------------------------

    async def run(self) -> None:
        if self._listener is None:
            return
        slots = anyio.Semaphore(MAX_CONNECTIONS)
        try:
            async with anyio.create_task_group() as tg:
                while True:
                    await slots.acquire()
                    try:
                        sock = await _io.accept(self._listener)
                    except BaseException:
                        slots.release()
                        raise
                    tg.start_soon(self._connection, sock, slots)
        finally:
            self.close()

    async def _connection(self, sock: socket.socket, slots: anyio.Semaphore) -> None:
        conn = _io.Connection(sock, PULL_TIMEOUT_S)
        conn.set_deadline(PULL_TIMEOUT_S, f"no whole pull frame within {PULL_TIMEOUT_S:g} s")
        parked = None
        try:
            rid, stage = "", -1
            try:
                length = wire.pull_length(await conn.read_exactly(wire.PULL_PREFIX_BYTES))
                pull = wire.decode_pull(await conn.read_exactly(length))
                rid, stage = pull.request_id, pull.stage
                parked = await self._accept(pull)
            except (TimeoutError, OSError):
                return  # gone, or silent: nothing to answer
            except wire.WireError as error:
                self.counts["refused"] += 1
                log.info("pull refused (%r stage %d): %s", rid, stage, error)
                with contextlib.suppress(TimeoutError, OSError):
                    await conn.send(wire.encode_ack(wire.Ack(rid, stage, False, str(error))))
                return
            # handed over on the event loop, no await in between: the lease stops now
            self.counts["accepted"] += 1
            parked.sock = sock
            parked.band.claim()
            parked.arrived.set()
            await parked.done.wait()  # the band's task closes the connection
        except Exception:  # a bug serving one connection must not stop the server
            log.exception("band server connection failed")
        finally:
            if parked is None or parked.sock is None:
                conn.close()
            slots.release()

    async def _accept(self, pull: wire.Pull) -> _Parked:
        """The parked band a pull may take; WireError naming why not. Reads no KV."""
        s = self.settings
        if self._verifier is not None:
            self._verifier.pull(pull)
        if pull.stage != s.stage:
            raise wire.WireError(f"this band server is stage {s.stage}'s, not stage "
                                 f"{pull.stage}'s")  # fmt: skip
        differs = wire.fingerprint_mismatch(pull.fingerprint, s.fingerprint, "the decoder",
                                            "WavePP")  # fmt: skip
        if differs:
            raise wire.WireError(differs)
        rid = pull.request_id
        parked = self._parked.get(rid)
        if parked is None and rid not in self._settled:
            # P may answer before this stage has parked its band
            event = self._registered.setdefault(rid, anyio.Event())
            with anyio.move_on_after(REGISTER_WAIT_S):
                await event.wait()
            if self._registered.get(rid) is event:
                del self._registered[rid]
            parked = self._parked.get(rid)
        if parked is None:
            raise wire.WireError(f"unknown or expired request {rid!r}: stage {s.stage} holds "
                                 "no band of it for pulling")  # fmt: skip
        if parked.sock is not None:
            raise wire.WireError(f"request {rid!r}: stage {s.stage}'s band is already being "
                                 "pulled")  # fmt: skip
        if parked.band.deadline <= time.monotonic():
            raise wire.WireError(f"request {rid!r}: stage {s.stage}'s lease ran out")
        return parked
