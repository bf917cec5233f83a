"""``python -m wavepp.route --replica URL [--replica URL ...] [--decoder URL ...] --port 8000``.

A router over WavePP servers (``python -m wavepp.serve``): it learns each replica's block
size and KV-event endpoints from its ``GET /v1/models``, keeps one index per replica fed
by its events (given ``--handoff-secret``, only the batches it signed), and sends each
request where the policy says (``docs/fleet.md``). With
``--decoder`` (vLLM servers with WavePP's connector), completions and chats are prefilled
on a replica and decoded on the least busy decoder (``wavepp.route.pd``,
``docs/handoff.md``). SIGTERM or SIGINT drains it: new requests get 503, the ones in
flight answer, exit 0.
"""

from __future__ import annotations

import argparse
import functools
import signal
import sys

import anyio

from wavepp.policy.load import PolicyError
from wavepp.route.app import BODY_TIMEOUT_S, http_client, run_router
from wavepp.route.pd import Decoder, Disaggregated
from wavepp.route.policies import (
    DEFAULT_ROUTE_POLICY,
    PREFIX_WEIGHT,
    ROUTE_POLICIES,
    load_route_policy,
    prefix_policy,
)
from wavepp.route.replicas import Replica, WatchOptions, log
from wavepp.route.router import Router
from wavepp.route.sent import MemoryOptions
from wavepp.serve.app import DEFAULT_MAX_BODY_BYTES
from wavepp.signing import SECRET_ENV, load_secret

MEMORY = MemoryOptions()  # the defaults


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m wavepp.route",
        description="Route /v1/prefill, /v1/completions and /v1/chat/completions over WavePP "
        "servers by their KV events (docs/fleet.md); with --decoder, prefill completions and "
        "chats on a replica and decode them on a vLLM decoder (docs/handoff.md).",
    )
    p.add_argument("--replica", action="append", required=True, metavar="URL",
                   help="a replica's base URL, e.g. http://10.0.0.5:8001 (repeat per replica)")
    p.add_argument("--decoder", action="append", default=[], metavar="URL",
                   help="a decoder's base URL: a vLLM server with WavePP's connector "
                   "(kv_connector WavePPConnector), e.g. http://10.0.0.6:8100 (repeat per "
                   "decoder); completions and chats then go through a replica's prefill "
                   "and the decoder with the fewest requests in flight whose /health "
                   "answers [none: the replicas answer them]")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on [127.0.0.1]")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: any free one) [8000]")
    p.add_argument("--policy", default=DEFAULT_ROUTE_POLICY,
                   help=f"routing policy: {', '.join(ROUTE_POLICIES)}, or pkg.mod:fn "
                   f"[{DEFAULT_ROUTE_POLICY}]")
    p.add_argument("--prefix-weight", type=float, default=PREFIX_WEIGHT,
                   help="prefix: one uncached prompt token weighs as much as this many tokens "
                   "of work queued ahead; the replica with the least queued + weight x "
                   f"uncached is chosen [{PREFIX_WEIGHT:g}]")
    p.add_argument("--sent-memory-s", type=float, default=MEMORY.memory_s,
                   help="a prompt a replica answered counts as cached there this long while its "
                   "KV events have not confirmed it (they may lag the answer); 0: only prompts "
                   f"in flight count, seconds [{MEMORY.memory_s:g}]")
    p.add_argument("--sent-memory-blocks", type=int, default=MEMORY.memory_blocks,
                   help="block hashes of answered prompts remembered per replica, the oldest "
                   f"forgotten first [{MEMORY.memory_blocks}]")
    p.add_argument("--explain", action="store_true",
                   help="each answer carries x-wavepp-route-views: what the router knew of "
                   "every replica when it chose (docs/fleet.md)")
    p.add_argument("--health-interval-s", type=float, default=1.0,
                   help="between two /health probes of a replica, seconds [1]")
    p.add_argument("--health-timeout-s", type=float, default=2.0,
                   help="a /health probe that takes longer failed, seconds [2]")
    p.add_argument("--fail-after", type=int, default=3,
                   help="failed probes in a row that take a replica out [3]")
    p.add_argument("--events-timeout-s", type=float, default=10.0,
                   help="a replica whose event stream stays disconnected this long is taken "
                   "out, seconds [10]")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"largest request body accepted, bytes [{DEFAULT_MAX_BODY_BYTES}]")
    p.add_argument("--drain-timeout-s", type=float, default=25.0,
                   help="after SIGTERM, how long requests in flight may take, seconds [25]")
    p.add_argument("--body-timeout-s", type=float, default=BODY_TIMEOUT_S,
                   help=f"a request body that takes longer gets 408, seconds [{BODY_TIMEOUT_S:g}]")
    p.add_argument("--handoff-secret", default=None, metavar="FILE",
                   help="the replicas' shared secret (their --handoff-secret): apply only KV "
                   "events it signed, an unsigned or forged batch counted as refused and "
                   f"dropped [${SECRET_ENV}'s value, else none: every batch applied]")
    p.add_argument("--log-level", default="warning", help="uvicorn's log level [warning]")
    return p  # fmt: skip


def _events(secret: bytes | None):
    """The KV-event index and subscriber (wavepp.kv_events.index; given the secret, one
    that applies only batches it signed), or (None, None) without them."""
    try:
        from wavepp.kv_events.index import ReplicaIndex, subscribe
    except ImportError as error:
        log(f"no KV-event index ({error}): predicted reuse is 0 everywhere")
        return None, None
    return ReplicaIndex, functools.partial(subscribe, secret=secret)


def secret_of(args: argparse.Namespace) -> bytes | None:
    """The shared secret ``--handoff-secret`` (or the environment) names, or None."""
    try:
        return load_secret(args.handoff_secret)
    except ValueError as error:
        raise SystemExit(f"wavepp route: --handoff-secret: {error}") from None


def check(args: argparse.Namespace) -> None:
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise SystemExit(f"wavepp route: {message}")

    for option, urls in (("--replica", args.replica), ("--decoder", args.decoder)):
        for url in urls:
            need(url.startswith(("http://", "https://")), f"{option} {url!r} is not an http(s) "
                 "URL")
        need(len(set(urls)) == len(urls), f"a {option} URL is given twice")
    need(0 <= args.port <= 65535, f"--port must be in 0..65535, got {args.port}")
    for name in ("health_interval_s", "health_timeout_s", "events_timeout_s", "drain_timeout_s",
                 "body_timeout_s"):
        value = getattr(args, name)
        need(0 < value < 1e6, f"--{name.replace('_', '-')} must be positive, got {value:g}")
    need(args.fail_after >= 1, f"--fail-after must be ≥ 1, got {args.fail_after}")
    need(1 <= args.prefix_weight < 1e6, f"--prefix-weight must be in [1, 1e6), got "
         f"{args.prefix_weight:g}")
    need(args.policy == "prefix" or args.prefix_weight == PREFIX_WEIGHT, "--prefix-weight is "
         f"an option of --policy prefix, not {args.policy}")
    need(0 <= args.sent_memory_s < 1e6, f"--sent-memory-s must be in [0, 1e6), got "
         f"{args.sent_memory_s:g}")
    need(args.sent_memory_blocks >= 0, f"--sent-memory-blocks must be ≥ 0, got "
         f"{args.sent_memory_blocks}")
    need(args.max_body_bytes >= 64, f"--max-body-bytes must be ≥ 64, got {args.max_body_bytes}")


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    check(args)
    try:
        policy = load_route_policy(args.policy)
        if args.policy == "prefix":
            policy = prefix_policy(args.prefix_weight)
    except PolicyError as error:
        raise SystemExit(f"wavepp route: --policy: {error}") from None
    watch = WatchOptions(args.health_interval_s, args.health_timeout_s, args.fail_after,
                         args.events_timeout_s)  # fmt: skip
    make_index, subscribe = _events(secret_of(args))

    async def run() -> None:
        stop = anyio.Event()

        async def on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    stop.set()

        memory = MemoryOptions(args.sent_memory_s, args.sent_memory_blocks)
        replicas = [Replica(f"r{i}", url, memory=memory) for i, url in enumerate(args.replica)]
        async with http_client() as client, anyio.create_task_group() as tg:
            tg.start_soon(on_signal)
            router = Router(replicas, policy, args.policy, client, explain=args.explain)
            decoders = [Decoder(f"d{i}", url) for i, url in enumerate(args.decoder)]
            pd = Disaggregated(router, decoders) if decoders else None
            await run_router(router, args.host, args.port, watch=watch, make_index=make_index,
                             subscribe=subscribe, max_body_bytes=args.max_body_bytes,
                             drain_timeout_s=args.drain_timeout_s,
                             body_timeout_s=args.body_timeout_s, log_level=args.log_level,
                             stop=stop, pd=pd)  # fmt: skip
            tg.cancel_scope.cancel()

    anyio.run(run)
    sys.exit(0)


if __name__ == "__main__":
    main()
