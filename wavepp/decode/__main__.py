"""``python -m wavepp.decode --model DIR --listen unix:/path|tcp://host:port``

One listening address serves both kinds of connection: bands (``b"WPHB"``, the handoff
wire format) and decode requests (``b"WPHD"``, ``wavepp.handoff.client``). A decode
request waits (up to its ``timeout_s``) for its request's complete cache, then the worker
streams the tokens: the handed-off first token at once, then each token ``generate()``
produces from the rebuilt cache. Greedy only (temperature 0); one generation at a time,
off the event loop, so bands keep arriving while it runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path

import anyio
import anyio.from_thread
import anyio.to_thread

from wavepp.dtypes import FLOATS
from wavepp.handoff import _io
from wavepp.handoff.assembly import HandoffError
from wavepp.handoff.client import (
    DECODE_MAGIC,
    TOKENS_MAGIC,
    DecodeChunk,
    DecodeRequest,
    decode_frame,
    encode_frame,
    frame_length,
)
from wavepp.handoff.receive import Receiver
from wavepp.handoff.wire import WireError, fingerprint_from_hf_config, parse_address

log = logging.getLogger("wavepp.decode")


class _Gone(Exception):
    """The client went away: generation stops."""


class _Streamer:
    """transformers' streamer protocol: the prompt first (skipped), then each new token,
    passed to the event loop's queue from generate()'s thread."""

    def __init__(self, send) -> None:
        self.send, self.seen_prompt = send, False

    def put(self, value) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        if not anyio.from_thread.run_sync(self.send, value.reshape(-1).tolist()):
            raise _Gone

    def end(self) -> None:
        pass


class Worker:
    def __init__(self, model_dir: Path, dtype: str, max_band_bytes: int, timeout_s: float):
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
            handlers={DECODE_MAGIC: self.serve_decode},
        )  # fmt: skip
        self.generating = anyio.CapacityLimiter(1)

    async def serve_decode(self, conn: _io.Connection) -> None:
        rid = ""
        try:
            length = frame_length(DECODE_MAGIC + await conn.read_exactly(4), DECODE_MAGIC)
            request = decode_frame(await conn.read_exactly(length), DecodeRequest)
        except WireError as error:
            await _send(conn, DecodeChunk("", [], error=str(error)))
            return
        except (TimeoutError, OSError):
            return
        rid = request.request_id
        if request.temperature != 0:
            why = (f"temperature {request.temperature:g} is not supported: this reference "
                   "worker decodes greedily (temperature 0)")  # fmt: skip
            await _send(conn, DecodeChunk(rid, [], error=why))
            return
        try:
            handoff = await self.receiver.wait(rid, request.timeout_s)
        except (TimeoutError, HandoffError) as error:
            await _send(conn, DecodeChunk(rid, [], error=str(error)))
            return
        if not await _send(conn, DecodeChunk(rid, [handoff.first_token])):
            return
        if request.max_tokens > 1:
            await self._generate(conn, handoff, request.max_tokens)
        else:
            await _send(conn, DecodeChunk(rid, [], done=True))

    async def _generate(self, conn: _io.Connection, handoff, max_tokens: int) -> None:
        from wavepp.handoff.hf import continue_generation

        rid = handoff.request_id
        send, receive = anyio.create_memory_object_stream[list[int]](max_buffer_size=1 << 16)
        alive = {"ok": True}

        def push(tokens: list[int]) -> bool:
            if alive["ok"]:
                send.send_nowait(tokens)
            return alive["ok"]

        def run() -> None:
            continue_generation(handoff, self.model, max_tokens, streamer=_Streamer(push))

        async def forward() -> None:
            async with receive:
                async for tokens in receive:
                    if alive["ok"] and not await _send(conn, DecodeChunk(rid, tokens)):
                        alive["ok"] = False

        error = ""
        async with anyio.create_task_group() as tg:
            tg.start_soon(forward)
            try:
                async with self.generating:
                    await anyio.to_thread.run_sync(run)
            except _Gone:
                log.info("decode %r: the client went away", rid)
            except Exception as failure:  # reported to the client, the worker lives on
                log.exception("decode %r failed", rid)
                error = f"generation failed: {failure!r}"
            finally:
                send.close()
        if alive["ok"]:
            await _send(conn, DecodeChunk(rid, [], done=not error, error=error))


async def _send(conn: _io.Connection, chunk: DecodeChunk) -> bool:
    try:
        await conn.send(encode_frame(TOKENS_MAGIC, chunk))
        return True
    except (TimeoutError, OSError) as error:
        log.info("decode %r: the client is gone: %r", chunk.request_id, error)
        return False


async def _main(args) -> None:
    worker = Worker(Path(args.model), args.dtype, args.max_band_mib << 20, args.request_timeout_s)
    address = parse_address(args.listen)
    async with anyio.create_task_group() as tg:
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
    args = parser.parse_args(argv)
    if args.max_band_mib < 1:
        parser.error("--max-band-mib must be at least 1")
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
    anyio.run(_main, args)


if __name__ == "__main__":
    main()
