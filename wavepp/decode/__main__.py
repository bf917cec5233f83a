"""``python -m wavepp.decode --model DIR --listen unix:/path|tcp://host:port``

One listening address serves three kinds of connection: bands (``b"WPHB"``, the handoff
wire format), decode requests (``b"WPHD"``, ``wavepp.handoff.client``) and liveness probes
(``b"WPHL"``, answered ``b"WPHL"``: the server's ``/health``). The receiver's limits
(deadlines, per-peer shares) are its options below; with ``--handoff-secret`` (or
``$WAVEPP_HANDOFF_SECRET``) bands and decode requests must be signed with the shared
secret (``docs/handoff.md``). A decode request waits (up
to its ``timeout_s``) for its request's complete cache, then the worker streams the
tokens: the handed-off first token at once, then each greedy token from the rebuilt
cache — what ``generate()`` would produce. Greedy only (temperature 0). The generations in
flight are batched (``wavepp.decode.batch``: one forward per step for all of them, up to
``--max-batch``; a generation joins and leaves between steps), off the event loop, so
bands keep arriving meanwhile. A client that closes its connection stops its request
wherever it is: waiting for its cache, waiting to join, or in the batch (it leaves at
the next step).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path

import anyio
import anyio.to_thread

from wavepp.decode.batch import Batch, Sequence, eos_ids
from wavepp.dtypes import FLOATS
from wavepp.handoff import _io
from wavepp.handoff.assembly import HandoffError
from wavepp.handoff.auth import SECRET_ENV, Verifier, load_secret
from wavepp.handoff.client import (
    DECODE_MAGIC,
    PING_MAGIC,
    PONG,
    TOKENS_MAGIC,
    DecodeChunk,
    DecodeRequest,
    decode_frame,
    encode_frame,
    frame_length,
)
from wavepp.handoff.receive import HEADER_TIMEOUT_S, INCOMPLETE_TIMEOUT_S, Receiver
from wavepp.handoff.wire import WireError, fingerprint_from_hf_config, parse_address

log = logging.getLogger("wavepp.decode")


class Generation:
    """A sequence as the event loop sees it: where its tokens go, whether its client
    left, and how it ended."""

    def __init__(self, handoff, max_tokens: int, push) -> None:
        self.handoff, self.max_tokens, self.push = handoff, max_tokens, push
        self.sequence: Sequence | None = None
        self.cancelled = False  # the client went away: it leaves at the next step
        self.error = ""
        self.ended = anyio.Event()


class Scheduler:
    """Continuous batching (``wavepp.decode.batch``): generations wait to join; one task
    runs the steps, each in a worker thread, so bands keep arriving meanwhile. Between
    two steps the cancelled and the finished leave and the waiting join (up to
    ``max_batch`` in flight)."""

    def __init__(self, model, max_batch: int = 32) -> None:
        self.batch = Batch(model)
        self.max_batch = max_batch
        self.waiting: list[Generation] = []
        self.running: list[Generation] = []
        self._wake = anyio.Event()

    async def generate(self, handoff, max_tokens: int, push) -> Generation:
        """Decode ``max_tokens`` - 1 tokens after the handoff's first, each batch of new
        tokens passed to ``push`` on the event loop as they come. Cancelling the caller
        (its client left) takes the generation out of the batch at the next step."""
        generation = Generation(handoff, max_tokens, push)
        self.waiting.append(generation)
        self._wake.set()
        try:
            await generation.ended.wait()
        finally:
            if not generation.ended.is_set():
                generation.cancelled = True
                self._wake.set()
        return generation

    async def run(self) -> None:
        while True:
            for generation in self.waiting:
                if generation.cancelled:
                    self._log_gone(generation)
            self.waiting = [g for g in self.waiting if not g.cancelled]
            if not self.running and not self.waiting:
                await self._wake.wait()
                self._wake = anyio.Event()
                continue
            room = max(self.max_batch - len(self.running), 0)
            joining, self.waiting = self.waiting[:room], self.waiting[room:]
            leaving = [g for g in self.running if g.cancelled]
            stepped = await anyio.to_thread.run_sync(self._step, joining, leaving)
            for generation in leaving:
                self._log_gone(generation)
            self.running = [g for g in self.running if g not in leaving]
            self.running += [g for g in joining if g.sequence is not None]
            for generation, token, finished in stepped:
                if not generation.cancelled:  # else it leaves at the next step, unsent
                    generation.push([token])
                if finished:
                    generation.ended.set()
            for generation in (*joining, *self.running):
                if generation.error:
                    generation.ended.set()
            self.running = [g for g in self.running if not g.ended.is_set()]

    def _step(self, joining: list[Generation], leaving: list[Generation]):
        """The decode thread's part: leave, join, one forward; (generation, token,
        finished) per member. A failed forward fails every member (the batch resets)."""
        from wavepp.handoff.hf import to_transformers_cache

        batch = self.batch
        batch.leave([g.sequence for g in leaving])
        for generation in joining:
            handoff = generation.handoff
            try:
                cache = to_transformers_cache(handoff, batch.model)
            except Exception as failure:  # reported to the client, the worker lives on
                log.exception("decode %r: the cache does not load", handoff.request_id)
                generation.error = f"generation failed: {failure!r}"
                continue
            generation.sequence = Sequence(handoff.request_id, handoff.first_token,
                                           handoff.num_tokens, generation.max_tokens,
                                           cache=cache)  # fmt: skip
            batch.join(generation.sequence)
        if not len(batch):
            return []
        members = {id(g.sequence): g for g in (*self.running, *joining) if g.sequence}
        try:
            tokens = batch.step()
        except Exception as failure:  # every member fails, the worker lives on
            log.exception("decode step failed (%d sequences)", len(batch))
            for sequence in batch.members:
                members[id(sequence)].error = f"generation failed: {failure!r}"
            batch.leave(list(batch.members))
            return []
        out = [(members[id(s)], t, batch.finished(s, t))
               for s, t in zip(batch.members, tokens, strict=True)]  # fmt: skip
        batch.leave([s for s, t in zip(batch.members, tokens, strict=True)
                     if batch.finished(s, t)])  # fmt: skip
        return out

    @staticmethod
    def _log_gone(generation: Generation) -> None:
        produced = generation.sequence.produced if generation.sequence else 1
        log.info("decode %r: the client went away after %d of %d tokens: stopped",
                 generation.handoff.request_id, produced, generation.max_tokens)  # fmt: skip


class Worker:
    def __init__(self, model_dir: Path, dtype: str, max_band_bytes: int, timeout_s: float,
                 max_batch: int = 32, secret: bytes | None = None,
                 limits: dict | None = None):  # fmt: skip
        """``limits``: the Receiver's (``header_timeout_s``, ``max_peer_connections``, ...)."""
        import torch
        import transformers

        self.config = json.loads((model_dir / "config.json").read_text())
        torch_dtype = getattr(torch, dtype)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch_dtype
        ).eval()
        ours = fingerprint_from_hf_config(self.config, dtype)
        loaded = fingerprint_from_hf_config(self.model.config.to_dict(), dtype)
        if ours != loaded:
            raise SystemExit(f"config.json reads as {ours} but transformers loads {loaded}")
        self.receiver = Receiver(
            self.config, dtype, max_band_bytes=max_band_bytes, request_timeout_s=timeout_s,
            handlers={DECODE_MAGIC: self.serve_decode, PING_MAGIC: self.serve_ping},
            secret=secret, **(limits or {}),
        )  # fmt: skip
        self.verifier = Verifier(secret) if secret else None
        self.scheduler = Scheduler(self.model, max_batch)
        self.eos = eos_ids(self.model)

    async def serve_ping(self, conn: _io.Connection) -> None:
        """A liveness probe (the server's /health): the worker's loop answers."""
        with contextlib.suppress(TimeoutError, OSError):
            await conn.send(PONG)

    async def serve_decode(self, conn: _io.Connection) -> None:
        rid = ""
        try:
            length = frame_length(DECODE_MAGIC + await conn.read_exactly(4), DECODE_MAGIC)
            request = decode_frame(await conn.read_exactly(length), DecodeRequest)
            if self.verifier is not None:
                self.verifier.message(request, "decode request")
        except WireError as error:
            await _send(conn, DecodeChunk("", [], error=str(error)))
            return
        except (TimeoutError, OSError):
            return
        conn.admitted()
        rid = request.request_id
        if request.temperature != 0:
            why = (f"temperature {request.temperature:g} is not supported: this reference "
                   "worker decodes greedily (temperature 0)")  # fmt: skip
            await _send(conn, DecodeChunk(rid, [], error=why))
            return
        # the client sends nothing more: its connection readable means it closed, and
        # whatever this request waits for (its cache, its steps) stops
        async with anyio.create_task_group() as tg:
            tg.start_soon(_cancel_when_closed, conn, tg.cancel_scope, rid)
            await self._serve(conn, request)
            tg.cancel_scope.cancel()

    async def _serve(self, conn: _io.Connection, request: DecodeRequest) -> None:
        rid = request.request_id
        # a cache that has not come within an incomplete request's life will not come
        wait_s = min(request.timeout_s, self.receiver.incomplete_timeout_s)
        try:
            handoff = await self.receiver.wait(rid, wait_s, request.sender)
        except (TimeoutError, HandoffError) as error:
            await _send(conn, DecodeChunk(rid, [], error=str(error)))
            return
        if not await _send(conn, DecodeChunk(rid, [handoff.first_token])):
            return
        if request.max_tokens > 1 and handoff.first_token not in self.eos:
            await self._generate(conn, handoff, request.max_tokens)
        else:
            await _send(conn, DecodeChunk(rid, [], done=True))

    async def _generate(self, conn: _io.Connection, handoff, max_tokens: int) -> None:
        rid = handoff.request_id
        send, receive = anyio.create_memory_object_stream[list[int]](max_buffer_size=1 << 16)
        alive = {"ok": True}

        async def forward(scope: anyio.CancelScope) -> None:
            async with receive:
                async for tokens in receive:
                    while True:  # whatever else came meanwhile goes in the same chunk
                        try:
                            tokens = tokens + receive.receive_nowait()
                        except (anyio.WouldBlock, anyio.EndOfStream):
                            break
                    if not await _send(conn, DecodeChunk(rid, tokens)):
                        alive["ok"] = False
                        scope.cancel()  # the generation leaves the batch
                        return

        generation = None
        async with anyio.create_task_group() as tg:
            with anyio.CancelScope() as scope:
                tg.start_soon(forward, scope)
                try:
                    generation = await self.scheduler.generate(handoff, max_tokens,
                                                               send.send_nowait)  # fmt: skip
                finally:
                    send.close()
        if generation is None or not alive["ok"]:
            return
        if generation.error:
            log.error("decode %r failed: %s", rid, generation.error)
        await _send(conn, DecodeChunk(rid, [], done=not generation.error, error=generation.error))


async def _cancel_when_closed(conn: _io.Connection, scope: anyio.CancelScope, rid: str) -> None:
    """Cancel ``scope`` once the client's side of ``conn`` closes (or errs)."""
    while True:
        await anyio.wait_readable(conn.sock)
        try:
            if conn.sock.recv(1, socket.MSG_PEEK):
                await anyio.sleep(0.05)  # bytes nobody asked for: not a close
                continue
        except BlockingIOError:
            continue
        except OSError:
            pass
        log.info("decode %r: the client closed its connection", rid)
        scope.cancel()
        return


async def _send(conn: _io.Connection, chunk: DecodeChunk) -> bool:
    try:
        await conn.send(encode_frame(TOKENS_MAGIC, chunk))
        return True
    except (TimeoutError, OSError) as error:
        log.info("decode %r: the client is gone: %r", chunk.request_id, error)
        return False


async def _main(args, secret: bytes | None) -> None:
    limits = {"header_timeout_s": args.header_timeout_s,
              "incomplete_timeout_s": args.incomplete_timeout_s,
              "max_connections": args.max_connections,
              "max_peer_connections": args.max_peer_connections,
              "max_peer_requests": args.max_peer_requests,
              "max_peer_held_bytes": (None if args.max_peer_held_mib is None
                                      else args.max_peer_held_mib << 20)}  # fmt: skip
    worker = Worker(Path(args.model), args.dtype, args.max_band_mib << 20, args.request_timeout_s,
                    args.max_batch, secret, limits)  # fmt: skip
    address = parse_address(args.listen)
    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.scheduler.run)
        bound = await tg.start(worker.receiver.serve, address)
        print(f"listening on {bound} (pid {os.getpid()})", flush=True)
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("signal %d: stopping", signum)
                tg.cancel_scope.cancel()
                break


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m wavepp.decode",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", required=True,
                        help="a Hugging Face checkpoint directory (Llama, Kimi Linear, Qwen3-Next, "
                        "MiniMax-M2): the one the pipeline prefilled with")  # fmt: skip
    parser.add_argument("--listen", required=True, help="unix:/abs/path or tcp://HOST:PORT")
    parser.add_argument("--max-band-mib", type=int, default=4096,
                        help="largest band accepted, MiB (default 4096)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads (default: torch's choice)")  # fmt: skip
    parser.add_argument("--dtype", default="float32",
                        choices=FLOATS,
                        help="the model's and the handed-off attention tensors' dtype "
                        "(the pipeline's --dtype)")  # fmt: skip
    parser.add_argument("--request-timeout-s", type=float, default=300.0,
                        help="an incomplete or untaken cache is dropped after this "
                        "long (default 300)")  # fmt: skip
    parser.add_argument("--max-batch", type=int, default=32,
                        help="generations decoded together, one forward per step for all "
                        "of them (default 32; 1 decodes one at a time)")  # fmt: skip
    parser.add_argument("--handoff-secret", default=None, metavar="FILE",
                        help="a file holding the shared secret the pipeline signs with "
                        "(--handoff-secret of wavepp.serve / wavepp.main): bands and decode "
                        f"requests not signed with it are refused [${SECRET_ENV}, else none]")
    parser.add_argument("--header-timeout-s", type=float, default=HEADER_TIMEOUT_S,
                        help="a connection's first frame (a band's prefix and header, a "
                        f"decode request) must arrive within this [{HEADER_TIMEOUT_S:g}]")
    parser.add_argument("--incomplete-timeout-s", type=float, default=INCOMPLETE_TIMEOUT_S,
                        help="a request whose bands are not all in this long after its first "
                        f"is dropped; a decode request waits at most this long for its cache "
                        f"[{INCOMPLETE_TIMEOUT_S:g}]")  # fmt: skip
    parser.add_argument("--max-connections", type=int, default=256,
                        help="connections served at once [256]")  # fmt: skip
    parser.add_argument("--max-peer-connections", type=int, default=None,
                        help="connections one peer (a TCP host; a Unix socket's user) may "
                        "hold at once, until its frame is admitted (to the end of the "
                        "connection for a TCP peer without --handoff-secret) "
                        "[a quarter of --max-connections]")  # fmt: skip
    parser.add_argument("--max-peer-requests", type=int, default=None,
                        help="incomplete requests one untrusted peer (TCP, no secret) may "
                        "open [1024, a quarter of the whole]")  # fmt: skip
    parser.add_argument("--max-peer-held-mib", type=int, default=None,
                        help="MiB of bands one untrusted peer (TCP, no secret) may hold "
                        "[a quarter of 4 x --max-band-mib]")  # fmt: skip
    args = parser.parse_args(argv)
    if args.max_batch < 1:
        parser.error("--max-batch must be at least 1")
    if args.max_band_mib < 1:
        parser.error("--max-band-mib must be at least 1")
    for name in ("max_connections", "max_peer_connections", "max_peer_requests",
                 "max_peer_held_mib"):  # fmt: skip
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    for name in ("header_timeout_s", "incomplete_timeout_s", "request_timeout_s"):
        value = getattr(args, name)
        if not 0 < value < 1e6:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value:g}")
    try:
        secret = load_secret(args.handoff_secret)
    except ValueError as error:
        parser.error(f"--handoff-secret: {error}")
    try:
        address = parse_address(args.listen)
    except ValueError as error:
        parser.error(str(error))
    if address.kind not in ("unix", "tcp"):
        parser.error(f"--listen {args.listen}: a socket address (unix: or tcp://) is needed")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(message)s")  # fmt: skip
    anyio.run(_main, args, secret)


if __name__ == "__main__":
    main()
