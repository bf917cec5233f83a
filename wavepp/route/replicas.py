"""The router's view of each replica: its state, load, KV-event index and text tree.

A replica is ``starting`` until its ``GET /v1/models`` answers (block size, the KV-event
endpoints), then ``up``. It is taken ``out`` when a request to it fails to connect or
loses its connection, when ``/health`` fails ``fail_after`` times in a row (a refused
connection, a timeout: a replica fallen silent, or a 503 naming a fault), or when its
event stream has been disconnected for ``events_timeout_s``; ``draining`` when it says
so. A replica out or draining gets no new requests; one that answers ``/health`` again
comes back ``up`` with its index cleared (rebuilt from the events that follow: an index
that missed events would overstate what the replica holds).
"""

from __future__ import annotations

import inspect
import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol
from urllib.parse import urlsplit

import anyio
import attrs
import httpx

from wavepp.route.policies import ReplicaView
from wavepp.route.sent import MemoryOptions, SentPrefixes
from wavepp.route.texttree import TextTree
from wavepp.state import longest_prefix

logger = logging.getLogger("wavepp.route")

STATES = ("starting", "up", "draining", "out")


class Index(Protocol):
    """What the router asks of a replica's index (``wavepp.kv_events.index.ReplicaIndex``)."""

    num_blocks: int

    def predicted_blocks(self, hashes: Sequence[int], probe_limit: int) -> int: ...

    def clear(self) -> None: ...


MakeIndex = Callable[[int], Index]  # block size -> an empty index
Subscribe = Callable[..., Any]  # (endpoint, replay_endpoint, index, topic) -> task or feed


def log(message: str) -> None:
    print(f"[wavepp route] {message}", file=sys.stderr, flush=True)


@attrs.define(eq=False)
class Flight:
    """One attempt of one request at one replica, from the send to the answer."""

    request_id: str | None  # None: the body's id could not be read (the replica refuses it)
    num_tokens: int  # prompt tokens (0 when the router could not read token ids)
    new_tokens: int  # of which uncached as the router judged when it routed (reuse_tokens)
    hashes: tuple[int, ...] = ()  # its prompt's chained block hashes at the replica's size
    scope: anyio.CancelScope | None = None  # cancelled when the replica is taken out


@attrs.frozen
class WatchOptions:
    health_interval_s: float = 1.0  # between two /health probes of one replica
    health_timeout_s: float = 2.0  # a probe that takes longer failed (a silent replica)
    fail_after: int = 3  # failed probes in a row that take a replica out
    events_timeout_s: float = 10.0  # a disconnected event stream that long takes it out
    models_timeout_s: float = 5.0  # GET /v1/models at start-up


def events_endpoint(endpoint: str, replica_url: str) -> str:
    """A replica's ``tcp://*:Q`` (or 0.0.0.0) as reached from here: the replica's host."""
    wildcard = ("tcp://*:", "tcp://0.0.0.0:", "tcp://[::]:")
    for prefix in wildcard:
        if endpoint.startswith(prefix):
            host = urlsplit(replica_url).hostname or "127.0.0.1"
            host = f"[{host}]" if ":" in host else host
            return f"tcp://{host}:{endpoint[len(prefix):]}"
    return endpoint


class Replica:
    """One replica: owned by the router, changed only by it and its watcher."""

    def __init__(self, name: str, url: str, tree_tokens: int | None = None,
                 memory: MemoryOptions | None = None) -> None:  # fmt: skip
        self.name = name
        self.url = url.rstrip("/")
        self.state = "starting"
        self.reason: str | None = None  # why it is out or draining
        self.info: dict = {}  # GET /v1/models' "wavepp" part
        self.model_body: dict | None = None  # the whole /v1/models answer
        self.block_size = 0
        self.events: dict | None = None  # {"endpoint", "replay", "topic"}, when it publishes
        self.index: Index | None = None
        self.feed: Any = None  # what subscribe returned (last_seq, connected), if anything
        self._feed_scope: anyio.CancelScope | None = None  # the subscription's task, running
        self.tree = TextTree(tree_tokens) if tree_tokens else TextTree()
        self.flights: set[Flight] = set()
        # the block hashes of the prompts in flight here and of those answered recently
        # that the events have not confirmed yet (wavepp.route.sent)
        self.sent = SentPrefixes(memory)
        self.failures = 0  # failed health probes in a row
        self._disconnected_since: float | None = None

    @property
    def routable(self) -> bool:
        return self.state == "up"

    def fly(self, flight: Flight) -> None:
        self.flights.add(flight)
        self.sent.fly(flight.hashes)

    def land(self, flight: Flight, done: bool = False, now: float = 0.0) -> None:
        """``flight`` ended; ``done``: answered 2xx at ``now`` (monotonic seconds), so its
        prompt counts as cached here until the events confirm it (or ``memory_s``)."""
        if flight in self.flights:
            self.flights.discard(flight)
            self.sent.land(flight.hashes, done, now)

    def settle(self, now: float) -> None:
        """Forget answered prompts the events confirm or that are past the memory: the
        router calls it before it builds the views (they read, never change, the state)."""
        index = self.index
        if index is None:
            self.sent.settle(now, None)
            return
        self.sent.settle(now, lambda h: index.predicted_blocks(h, len(h)) == len(h))

    def view(self, num_tokens: int, hashes: Sequence[int] | None,
             tree_key: Sequence[int] | None) -> ReplicaView:  # fmt: skip
        predicted = pending = recent = 0
        if hashes and num_tokens > 0:
            limit = (num_tokens - 1) // self.block_size
            if self.index is not None:
                predicted = self.index.predicted_blocks(hashes, limit) * self.block_size
            pending = self.sent.in_flight_blocks(hashes, limit) * self.block_size
            recent = self.sent.answered_blocks(hashes, limit) * self.block_size
        return ReplicaView(
            name=self.name,
            block_size=self.block_size,
            num_in_flight=len(self.flights),
            load_tokens=sum(f.num_tokens for f in self.flights),
            load_new_tokens=sum(f.new_tokens for f in self.flights),
            predicted_tokens=predicted,
            pending_tokens=pending,
            text_match_tokens=self.tree.match(tree_key) if tree_key else 0,
            text_tree_tokens=self.tree.num_tokens,
            recent_tokens=recent,
        )

    def announced_tokens(self, num_tokens: int, hashes: Sequence[int] | None) -> int | None:
        """Tokens of the prompt whose blocks the events announce, before a hybrid's snapshot
        floor (what ``--explain`` shows beside the prediction); None without a block set."""
        blocks = getattr(self.index, "blocks", None)
        if not hashes or num_tokens <= 0 or not isinstance(blocks, set | frozenset):
            return None
        limit = (num_tokens - 1) // self.block_size
        return longest_prefix(blocks, hashes, limit) * self.block_size

    def take_out(self, reason: str, state: str = "out") -> None:
        """No new requests; requests waiting on it (not streams) are cancelled and retried."""
        if self.state != state:
            log(f"replica {self.name} {self.url} {state}: {reason}")
        self.state, self.reason = state, reason
        if state == "out":
            for flight in list(self.flights):
                if flight.scope is not None:
                    flight.scope.cancel()
            # what it announced is gone with it, and whoever binds its freed port next is
            # not to be believed: no index, no subscription until it is up again
            if self.index is not None:
                self.index.clear()
            if self._feed_scope is not None:
                self._feed_scope.cancel()
                self._feed_scope = None

    def come_back(self) -> None:
        if self.state in ("out", "draining"):
            log(f"replica {self.name} {self.url} up again (its index starts empty)")
            if self.index is not None:
                self.index.clear()
        self.state, self.reason, self.failures = "up", None, 0

    def snapshot(self) -> dict:
        feed = self.feed
        return {
            "name": self.name,
            "url": self.url,
            "state": self.state,
            "reason": self.reason,
            "in_flight": len(self.flights),
            "block_size": self.block_size or None,
            "events": None if self.events is None else {
                **self.events,
                "blocks": getattr(self.index, "num_blocks", None),
                "last_seq": getattr(feed, "last_seq", None),
                "connected": getattr(feed, "connected", None),
            },
        }  # fmt: skip

    # -- the watcher ------------------------------------------------------------------

    async def watch(self, client: httpx.AsyncClient, options: WatchOptions,
                    make_index: MakeIndex | None, subscribe: Subscribe | None) -> None:  # fmt: skip
        """Learn the replica (``/v1/models``), subscribe to its events, then probe it."""
        async with anyio.create_task_group() as tg:
            while self.model_body is None:
                if await self._learn(client, options):
                    break
                await anyio.sleep(options.health_interval_s)
            events = bool(self.events and make_index is not None and subscribe is not None)
            if events:
                self.index = make_index(self.block_size)
                self._subscribe(tg, subscribe)
            self.state = "up"
            log(f"replica {self.name} {self.url} up (block size {self.block_size}, events "
                f"{self.events['endpoint'] if self.events else 'none: predicted reuse 0'})")
            while True:
                await anyio.sleep(options.health_interval_s)
                await self._probe(client, options)
                if events and self.state == "up" and self._feed_scope is None:
                    self._subscribe(tg, subscribe)  # back after being out: subscribe anew

    def _subscribe(self, tg: anyio.abc.TaskGroup, subscribe: Subscribe) -> None:
        endpoint = events_endpoint(self.events["endpoint"], self.url)
        replay = self.events.get("replay")
        replay = events_endpoint(replay, self.url) if replay else None
        feed = subscribe(endpoint, replay, self.index, self.events.get("topic") or "")
        self.feed = feed  # wavepp.kv_events': awaitable, and shows last_seq, connected
        scope = self._feed_scope = anyio.CancelScope()

        async def run() -> None:
            with scope:
                if inspect.isawaitable(feed):
                    await _await(feed)
                else:  # a feed someone else runs: it stands until the replica is out
                    await anyio.sleep_forever()

        tg.start_soon(run)

    async def _learn(self, client: httpx.AsyncClient, options: WatchOptions) -> bool:
        try:
            reply = await client.get(self.url + "/v1/models", timeout=options.models_timeout_s)
            body = reply.json()
            info = body["data"][0].get("wavepp", {})
            block_size = int(info["block_size"])
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as error:
            self.reason = f"no /v1/models yet: {type(error).__name__}: {error}"
            return False
        if block_size < 1:
            self.reason = f"/v1/models says block size {block_size}"
            return False
        events = info.get("kv_events") or body["data"][0].get("kv_events")
        self.model_body, self.info, self.block_size = body, info, block_size
        self.events = events if isinstance(events, dict) and events.get("endpoint") else None
        return True

    async def _probe(self, client: httpx.AsyncClient, options: WatchOptions) -> None:
        try:
            reply = await client.get(self.url + "/health", timeout=options.health_timeout_s)
        except httpx.HTTPError as error:
            self._failed(options, f"/health: {type(error).__name__}: {error}".rstrip(": "))
            return
        if reply.status_code == 200:
            if self._silent_events(options):
                return
            if self.state != "up":
                self.come_back()
            self.failures = 0
            return
        try:
            body = reply.json()
        except ValueError:
            body = {}
        status = body.get("status") if isinstance(body, dict) else None
        if status == "draining":
            self.take_out("it is draining", state="draining")
            return
        why = body.get("error") if isinstance(body, dict) else None
        self._failed(options, f"/health answered {reply.status_code}: {why or status}")

    def _failed(self, options: WatchOptions, reason: str) -> None:
        self.failures += 1
        if self.failures >= options.fail_after and self.state != "out":
            self.take_out(f"{reason} ({self.failures} probes in a row)")

    def _silent_events(self, options: WatchOptions) -> bool:
        """Whether its event stream has been disconnected past the timeout (then: out)."""
        connected = getattr(self.feed, "connected", None)
        if connected is None or connected:
            self._disconnected_since = None
            return False
        now = time.monotonic()
        self._disconnected_since = self._disconnected_since or now
        if now - self._disconnected_since < options.events_timeout_s:
            return False
        self.take_out(f"its event stream has been silent for {options.events_timeout_s:g} s")
        return True


async def _await(awaitable: Any) -> None:
    try:
        await awaitable
    except Exception as error:  # the feed's own failure: predictions from a stale index
        logger.exception("event feed ended")
        log(f"event feed ended: {type(error).__name__}: {error}")
