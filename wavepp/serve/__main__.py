"""``torchrun --nproc-per-node P -m wavepp.serve --host 127.0.0.1 --port 8000 [run options]``.

Rank 0 serves HTTP (see :mod:`wavepp.serve.app`) next to the runtime; ranks > 0 serve
their pipeline stage. The run options are those of ``wavepp.main`` (``--model``,
``--rung``, ``--capacity-blocks``, ...); the workload options only size the default
pool (``--prompt-tokens`` x ``--concurrency``). SIGTERM drains: no new requests, the
ones in flight answer, the leak check runs, and the exit status says whether it held.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from wavepp.serve.app import DEFAULT_MAX_BODY_BYTES, ServeOptions


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node P -m wavepp.serve",
        description="WavePP's HTTP prefill server on rank 0. Every other option is a run "
        "option of wavepp.main (listed below).",
        add_help=False,
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on [127.0.0.1]")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: any free one) [8000]")
    p.add_argument(
        "--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
        help=f"largest request body accepted, bytes [{DEFAULT_MAX_BODY_BYTES}]",
    )  # fmt: skip
    p.add_argument(
        "--tokenizer", default=None,
        help="tokenizer.json for text prompts [the checkpoint directory's, if it has one]",
    )  # fmt: skip
    p.add_argument(
        "--max-in-flight", type=int, default=0,
        help="prefill requests awaiting results at once; more get 429 [0: no limit]",
    )  # fmt: skip
    p.add_argument("--served-model-name", default=None, help="the model's name in answers")
    p.add_argument("--log-level", default="warning", help="uvicorn's log level [warning]")
    p.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    return p


def tokenizer_functions(path: Path | None):
    """(text -> ids, id -> text) from a tokenizer.json, or (None, None) without one."""
    if path is None:
        return None, None
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as error:  # the library raises its own exception type
        raise SystemExit(f"wavepp serve: cannot load the tokenizer {path}: {error}") from None

    def tokenize(text: str) -> list[int]:
        return tokenizer.encode(text).ids

    def detokenize(token: int) -> str:
        return tokenizer.decode([token])

    return tokenize, detokenize


def _tokenizer_path(explicit: str | None, model: str | None) -> Path | None:
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise SystemExit(f"wavepp serve: --tokenizer {explicit}: no such file")
        return path
    if model and (Path(model) / "tokenizer.json").is_file():
        return Path(model) / "tokenizer.json"
    return None


def main(argv: list[str] | None = None) -> None:
    args, rest = parser().parse_known_args(argv)
    from wavepp.config import load
    from wavepp.config import parser as run_parser

    if args.help:
        parser().print_help()
        print()
        run_parser().print_help()
        sys.exit(0)
    if not 0 <= args.port <= 65535:
        raise SystemExit(f"wavepp serve: --port must be in 0..65535, got {args.port}")
    if args.max_body_bytes < 64:
        raise SystemExit(f"wavepp serve: --max-body-bytes must be ≥ 64, got {args.max_body_bytes}")
    if args.max_in_flight < 0:
        raise SystemExit(f"wavepp serve: --max-in-flight must be ≥ 0, got {args.max_in_flight}")
    config = load(rest)
    tokenize, detokenize = tokenizer_functions(_tokenizer_path(args.tokenizer, config.model))
    options = ServeOptions(
        max_body_bytes=args.max_body_bytes,
        model_name=args.served_model_name or str(config.model or "wavepp"),
        tokenize=tokenize,
        detokenize=detokenize,
        max_in_flight=args.max_in_flight,
    )

    async def client(engine) -> None:
        from wavepp.serve.server import serve

        await serve(engine, args.host, args.port, options, log_level=args.log_level)

    from wavepp.main import run_ranks

    sys.exit(run_ranks(config, client, sigterm_drains=True))


if __name__ == "__main__":
    main()
