"""The router over stand-in replicas behind one httpx MockTransport, each with an index
fed by hand: what the router tests share."""

from __future__ import annotations

import json
from collections.abc import Sequence

import anyio
import httpx

from wavepp.route.app import build_app
from wavepp.route.policies import ROUTE_POLICIES
from wavepp.route.replicas import Replica
from wavepp.route.router import Router

BLOCK = 4


class FakeIndex:
    """The contract's ReplicaIndex, reduced to a set of announced hashes."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.held: set[int] = set()
        self.cleared = 0

    @property
    def num_blocks(self) -> int:
        return len(self.held)

    def predicted_blocks(self, hashes: Sequence[int], probe_limit: int) -> int:
        n = 0
        while n < min(len(hashes), probe_limit) and hashes[n] in self.held:
            n += 1
        return n

    def clear(self) -> None:
        self.held.clear()
        self.cleared += 1


class Fleet:
    """Stand-in replicas behind one MockTransport; ``behave[name]`` answers each request."""

    def __init__(self, names: Sequence[str] = ("r0", "r1")) -> None:
        self.replicas = [Replica(n, f"http://{n}.test") for n in names]
        self.seen: list[tuple[str, str, dict]] = []  # (replica, path, body)
        self.behave = {n: self.done for n in names}
        for r in self.replicas:
            r.state, r.block_size, r.index = "up", BLOCK, FakeIndex(BLOCK)
            r.model_body = {"object": "list", "data": [{"id": "tiny", "wavepp": {
                "vocab_size": 100, "block_size": BLOCK}}]}  # fmt: skip

    async def done(self, name: str, request: httpx.Request, body: dict) -> httpx.Response:
        tokens = body.get("tokens") or body.get("prompt")
        return httpx.Response(200, json={"id": body.get("id"), "status": "done", "first_token": 7,
                                         "num_tokens": len(tokens), "cached_tokens": 0})

    async def handler(self, request: httpx.Request) -> httpx.Response:
        name = request.url.host.split(".")[0]
        body = json.loads(request.content) if request.content else {}
        self.seen.append((name, request.url.path, body))
        return await self.behave[name](name, request, body)

    def router(self, policy: str = "prefix") -> Router:
        client = httpx.AsyncClient(transport=httpx.MockTransport(self.handler))
        return Router(self.replicas, ROUTE_POLICIES[policy], policy, client)


def client_of(router: Router) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=build_app(router))
    return httpx.AsyncClient(transport=transport, base_url="http://router")


def run(test):
    anyio.run(test)
