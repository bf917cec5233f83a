"""``torchrun --nproc-per-node P -m wavepp.serve --host 127.0.0.1 --port 8000 [run options]``.

Rank 0 serves HTTP (see :mod:`wavepp.serve.app`) next to the runtime; ranks > 0 serve
their pipeline stage. The run options are those of ``wavepp.main`` (``--model``,
``--rung``, ``--capacity-blocks``, ...); the workload options only size the default
pool (``--prompt-tokens`` x ``--concurrency``). Each stage serves its bands to decoders
that pull them (vLLM's P/D protocol; ``--handoff-serve``, auto here by default).
``--decode ADDRESS|auto`` adds a decoder: ``/v1/completions`` and
``/v1/chat/completions`` with ``max_tokens`` > 1 hand the prompt's cache to it and answer
with its tokens (``wavepp.serve.decode``). SIGTERM drains: no new requests, the
ones in flight answer, the leak check runs, and the exit status says whether it held.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import attrs
import jinja2

from wavepp.config import handoff_secret
from wavepp.serve.allow import AllowError, HandoffAllow
from wavepp.serve.app import DEFAULT_MAX_BODY_BYTES, NO_CHAT, ServeOptions
from wavepp.serve.chat import ChatTemplate
from wavepp.serve.decode import check_decode_option, decoder


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
        help="tokenizer.json for text prompts; its folder's chat template "
        "(chat_template.jinja, or chat_template in tokenizer_config.json) serves "
        "/v1/chat/completions [the checkpoint directory's, if it has one]",
    )  # fmt: skip
    p.add_argument(
        "--max-in-flight", type=int, default=0,
        help="prefill requests awaiting results at once; more get 429 [0: no limit]",
    )  # fmt: skip
    p.add_argument(
        "--drain-timeout-s", type=float, default=25.0,
        help="after SIGTERM, how long requests in flight may take before they are cancelled, "
        "seconds [25]",
    )  # fmt: skip
    p.add_argument(
        "--header-timeout-s", type=float, default=10.0,
        help="a connection whose request headers take longer is closed, seconds [10]",
    )  # fmt: skip
    p.add_argument(
        "--body-timeout-s", type=float, default=30.0,
        help="a request body that takes longer gets 408, seconds [30]",
    )  # fmt: skip
    p.add_argument(
        "--decode", default=None, metavar="ADDRESS|auto",
        help="a decode worker (unix:/path or tcp://host:port, python -m wavepp.decode), or "
        "'auto' to start one for the model: /v1/completions then takes max_tokens > 1 and "
        "stream, prefilling on the pipeline and handing the cache to it [none]",
    )  # fmt: skip
    p.add_argument(
        "--handoff-allow", default=None, metavar="PATTERNS",
        help="where a /v1/prefill body's \"handoff\": \"ADDRESS\" may send the cache, "
        "besides the run's own --handoff-to and --decode: comma-separated unix:/path, "
        "unix:/dir/*, tcp://host:port, tcp://CIDR:PORT, tcp://CIDR:LOW-HIGH or tcp://CIDR:* "
        "(docs/handoff.md); other addresses get 403 [none]",
    )  # fmt: skip
    p.add_argument("--served-model-name", default=None, help="the model's name in answers")
    p.add_argument("--log-level", default="warning", help="uvicorn's log level [warning]")
    p.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    return p


def tokenizer_functions(path: Path | None):
    """(text -> ids, id -> text, the chat template or None, why there is none) from a
    tokenizer.json and the tokenizer files beside it (``wavepp.serve.chat``)."""
    if path is None:
        return None, None, None, NO_CHAT
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as error:  # the library raises its own exception type
        raise SystemExit(f"wavepp serve: cannot load the tokenizer {path}: {error}") from None

    def tokenize(text: str) -> list[int]:
        return tokenizer.encode(text).ids

    def detokenize(token: int) -> str:
        return tokenizer.decode([token])

    def encode_chat(text: str) -> list[int]:  # the template places the special tokens
        return tokenizer.encode(text, add_special_tokens=False).ids

    try:
        chat = ChatTemplate.from_directory(path.parent, encode_chat)
    except (ValueError, jinja2.TemplateError) as error:
        raise SystemExit(f"wavepp serve: the chat template in {path.parent}: {error}") from None
    no_chat = (f"the model has no chat template: {path.parent} holds neither "
               "chat_template.jinja nor a chat_template in tokenizer_config.json (send the "
               "prompt to /v1/completions)")  # fmt: skip
    return tokenize, detokenize, chat, no_chat


def _tokenizer_path(explicit: str | None, model: str | None) -> Path | None:
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise SystemExit(f"wavepp serve: --tokenizer {explicit}: no such file")
        return path
    if model and (Path(model) / "tokenizer.json").is_file():
        return Path(model) / "tokenizer.json"
    return None


def _check_host(host: str) -> None:
    """--host is an address of this machine, checked before any rank starts: a mistake is
    one line, not a run that starts and then fails to bind (the port is bound for real
    later; checking it here would race with whatever else binds it)."""
    from wavepp.serve.server import bind

    try:
        bind(host, 0).close()
    except SystemExit:
        raise SystemExit(f"wavepp serve: --host {host}: not an address this machine can "
                         "listen on (it is not one of its interfaces, or does not "
                         "resolve)") from None


def _own_options_in_config(argv: list[str] | None, own: dict) -> dict:
    """The server's own options in a ``--config`` TOML file (``max_in_flight = 8``), each
    checked for its type; the run options in it are ``wavepp.config``'s to read."""
    import tomllib

    found = argparse.ArgumentParser(add_help=False)
    found.add_argument("--config", default=None)
    path = found.parse_known_args(argv)[0].config
    if path is None:
        return {}
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise SystemExit(f"wavepp: --config {path}: {error}") from None
    values = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in own:
            continue
        kind = own[name].type or str
        ok = (type(value) is int if kind is int
              else type(value) in (int, float) if kind is float
              else isinstance(value, str))  # fmt: skip
        if not ok:
            wanted = {int: "an integer", float: "a number"}.get(kind, "a string")
            raise SystemExit(f"wavepp serve: {path}: option {key!r} must be {wanted}, "
                             f"got {value!r}")  # fmt: skip
        values[name] = kind(value)
    return values


def check(argv: list[str] | None, world: int | None = None):
    """(server options, run config, argv's server part) with every check that does not
    need the ranks done: the server's options, the run options (``wavepp.config``), and —
    given ``world`` — the split over that many stages (``wavepp.launch.preflight``). Raises
    SystemExit with one line. The launcher calls it before it starts any rank."""
    p = parser()
    own = {a.dest: a for a in p._actions if a.dest != "help"}
    p.set_defaults(**_own_options_in_config(argv, own))
    try:
        args, rest = p.parse_known_args(argv)
    except SystemExit:
        raise SystemExit(2) from None
    from wavepp.config import load

    if not 0 <= args.port <= 65535:
        raise SystemExit(f"wavepp serve: --port must be in 0..65535, got {args.port}")
    _check_host(args.host)
    if args.max_body_bytes < 64:
        raise SystemExit(f"wavepp serve: --max-body-bytes must be ≥ 64, got {args.max_body_bytes}")
    if args.max_in_flight < 0:
        raise SystemExit(f"wavepp serve: --max-in-flight must be ≥ 0, got {args.max_in_flight}")
    for name in ("drain_timeout_s", "header_timeout_s", "body_timeout_s"):
        value = getattr(args, name)
        if not 0 < value < 1e6:
            flag = "--" + name.replace("_", "-")
            raise SystemExit(f"wavepp serve: {flag} must be positive, got {value:g}")
    config = load(rest, others=frozenset(own))
    try:
        allow = HandoffAllow.parse(args.handoff_allow, (config.handoff_to, args.decode))
    except AllowError as error:
        raise SystemExit(f"wavepp serve: {error}") from None
    if config.executor == "torch" and config.handoff_serve is None:
        # the server's stages serve bands to decoders (vLLM's P/D protocol) by default
        config = attrs.evolve(config, handoff_serve="auto")
    if world is not None:
        from wavepp.launch import preflight

        preflight(config, world)
    tokenize, detokenize, chat, no_chat = tokenizer_functions(
        _tokenizer_path(args.tokenizer, config.model))  # fmt: skip
    options = ServeOptions(
        max_body_bytes=args.max_body_bytes,
        model_name=args.served_model_name or str(config.model or "wavepp"),
        tokenize=tokenize,
        detokenize=detokenize,
        max_in_flight=args.max_in_flight,
        body_timeout_s=args.body_timeout_s,
        header_timeout_s=args.header_timeout_s,
        drain_timeout_s=args.drain_timeout_s,
        decode=check_decode_option(args.decode),
        simulated=config.executor == "sim",
        chat=chat,
        no_chat=no_chat,
        secret=handoff_secret(config),
        allow=allow,
    )
    if options.decode is not None and config.executor != "torch":
        raise SystemExit("wavepp serve: --decode needs the torch executor")
    return options, config, args


def main(argv: list[str] | None = None) -> None:
    args, _ = parser().parse_known_args(argv)
    if args.help:
        from wavepp.config import parser as run_parser

        parser().print_help()
        print()
        run_parser().print_help()
        sys.exit(0)
    from wavepp.launch import refuse_once

    try:
        options, config, args = check(argv)
    except SystemExit as error:
        refuse_once(error)

    async def client(engine) -> None:
        from wavepp.launch import log
        from wavepp.serve.server import serve

        async with decoder(options.decode, config.model, config.seed, config.dtype,
                           log, config.handoff_secret) as state:  # fmt: skip
            address = state.address if state is not None else None
            allow = attrs.evolve(options.allow, own=options.allow.own | {address} - {None})
            await serve(engine, args.host, args.port,
                        attrs.evolve(options, decode=address, decoder=state, allow=allow),
                        log_level=args.log_level)  # fmt: skip

    from wavepp.main import run_ranks

    sys.exit(run_ranks(config, client, sigterm_drains=True))


if __name__ == "__main__":
    main()
