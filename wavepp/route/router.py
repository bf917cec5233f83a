"""Forwarding one request: choose a replica, send it, retry elsewhere if the replica fails.

Idempotency is by request id. Every request carries one to the replica (the router names
it ``route-<hex>`` when the client gave none), and the router sends one id to one replica
at most once: it remembers, for the last :data:`RECENT_IDS` ids, which replicas saw them.

- While a request is in flight at the router, another with its id is refused (409), as
  one server refuses it.
- A replica that refuses the connection (it is taken out), loses it before answering,
  answers 503 (fault, draining: taken out), or is taken out by its watcher while the
  request waits (its ``/health`` failed or fell silent: the router first sends it
  ``DELETE /v1/requests/{id}``, and the replica also cancels a request whose connection
  closes) has not answered that id; the request is sent again, under the same id, to a
  replica that has not seen it.
- A replica answering 409 for an id the router already sent there has the request (or
  had it, its id still reserved): the router does not ask it again. That happens only
  when a client repeats an id after its earlier request was abandoned; the request goes
  to a replica that has not seen the id, or, when every replica up has, the 409 is the
  answer — what one server answers for a repeated id.
- Once a replica's answer has begun (its status line), it is the answer: a stream that
  breaks halfway ends with an error event, never a second run elsewhere.

Deadlines are the router's to keep too. A request's ``deadline_s`` counts from its arrival
at the router (as a server's counts from its own submission), and each send carries what
is left of it: the replica's clock starts when it takes the request, so its
``deadline_met`` judges the same instant, time spent at the router and at replicas that
failed included. Once the deadline has passed the router sends the request nowhere else:
the client gets a 504 ``deadline_exceeded`` naming what happened at each replica.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence

import anyio
import attrs
import httpx
import msgspec
from starlette.responses import Response, StreamingResponse

from wavepp.ids import RETAINED_IDS
from wavepp.route.body import Peek, read_answer, with_deadline
from wavepp.route.policies import ReplicaView, RouteRequest, reuse_tokens
from wavepp.route.prom import RouteMetrics
from wavepp.route.replicas import Flight, Replica
from wavepp.serve.api import ApiError
from wavepp.state import block_hashes

RECENT_IDS = RETAINED_IDS  # ids remembered with the replicas that saw them (the server's)
MAX_ANSWER_BYTES = 64 * 1024 * 1024  # a replica's non-streamed answer, at most
CANCEL_TIMEOUT_S = 2.0  # DELETE /v1/requests/{id} to a replica taken out


@attrs.frozen
class _Retry:
    reason: str  # the retries counter's label: connect, lost, unavailable, taken-out
    detail: str


class Router:
    """The replicas, the policy and the bookkeeping of requests in flight."""

    def __init__(self, replicas: Sequence[Replica], policy: Callable, policy_name: str,
                 client: httpx.AsyncClient, metrics: RouteMetrics | None = None,
                 explain: bool = False) -> None:  # fmt: skip
        """``explain``: each answer says what the router knew of every replica
        (``x-wavepp-route-views``, :func:`explain_views`)."""
        self.replicas = list(replicas)
        self.explain = explain
        self.policy = policy
        self.policy_name = policy_name
        self.client = client
        self.metrics = metrics or RouteMetrics(policy_name, self.replicas)
        self.seq = 0  # requests routed so far
        self.in_flight: dict[str, Replica | None] = {}  # request id -> replica it is at now
        self.recent: collections.OrderedDict[str, set[str]] = collections.OrderedDict()
        # ids a replica answered 2xx: refused for the window a server keeps its ended ids
        self.finished: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.draining = False

    # -- choosing ---------------------------------------------------------------------

    def views(self, peek: Peek, candidates: Sequence[Replica]) -> list[ReplicaView]:
        num_tokens = 0 if peek.tokens is None else len(peek.tokens)
        return [replica.view(num_tokens, self._hashes(peek, replica), peek.tree_key)
                for replica in candidates]  # fmt: skip

    @staticmethod
    def _hashes(peek: Peek, replica: Replica) -> tuple[int, ...] | None:
        """The prompt's chained block hashes at ``replica``'s block size (once per size)."""
        if peek.tokens is None or not replica.block_size:
            return None
        if replica.block_size not in peek.hashes_of:
            peek.hashes_of[replica.block_size] = tuple(block_hashes(peek.tokens,
                                                                    replica.block_size))
        return peek.hashes_of[replica.block_size]

    def choose(self, peek: Peek, candidates: Sequence[Replica],
               deadline_s: float | None = None
               ) -> tuple[Replica, ReplicaView, list[ReplicaView]]:  # fmt: skip
        """The chosen replica, its view and every candidate's; ``deadline_s``: seconds left
        until the request's deadline (None: none)."""
        now = time.monotonic()
        for replica in candidates:
            replica.settle(now)
        views = self.views(peek, candidates)
        request = RouteRequest(self.seq, 0 if peek.tokens is None else len(peek.tokens),
                               peek.priority, deadline_s)  # fmt: skip
        index = self.policy(request, views)
        if not (isinstance(index, int) and 0 <= index < len(views)):
            raise RuntimeError(f"routing policy {self.policy_name!r} returned {index!r}, not an "
                               f"index into its {len(views)} replicas")  # fmt: skip
        return candidates[index], views[index], views

    def _remember(self, request_id: str, replica: str) -> None:
        seen = self.recent.pop(request_id, set())
        seen.add(replica)
        self.recent[request_id] = seen
        while len(self.recent) > RECENT_IDS:
            self.recent.popitem(last=False)

    def _finish(self, request_id: str | None, code: int) -> None:
        if request_id is None or not 200 <= code < 300:
            return  # refused or failed: the id ran nowhere to the end, so it stays free
        self.finished[request_id] = None
        self.finished.move_to_end(request_id)
        while len(self.finished) > RETAINED_IDS:
            self.finished.popitem(last=False)

    # -- forwarding -------------------------------------------------------------------

    async def forward(self, route: str, peek: Peek, arrived: float) -> Response:
        """The answer to one request (a replica's, or the router's own refusal);
        ``arrived``: when its body was read, on ``time.monotonic``'s clock."""
        if self.draining:
            raise ApiError(503, "the router is draining and takes no new requests", "unavailable")
        rid = peek.request_id
        if rid is not None and rid in self.in_flight:
            raise ApiError(409, f"request id {rid!r} is in flight (ids name one request at a "
                           "time)")  # fmt: skip
        if rid is not None and rid in self.finished:
            raise ApiError(409, f"request id {rid!r} has been answered (an id names one request "
                           f"until {RETAINED_IDS:,} later ones have ended)")  # fmt: skip
        if rid is not None:
            self.in_flight[rid] = None
        response = None
        due = None if peek.deadline_s is None else arrived + peek.deadline_s
        try:
            response = await self._attempts(route, peek, due)
            return response
        finally:  # a stream's id stays in flight until the stream ends
            if rid is not None and not isinstance(response, StreamingResponse):
                self.in_flight.pop(rid, None)
                if response is not None:
                    self._finish(rid, response.status_code)

    async def _attempts(self, route: str, peek: Peek, due: float | None) -> Response:
        """``due``: the request's deadline on ``time.monotonic``'s clock (None: none)."""
        rid = peek.request_id
        seen = set(self.recent.get(rid, ())) if rid is not None else set()
        failures: list[str] = []
        while True:
            up = [r for r in self.replicas if r.routable]
            candidates = [r for r in up if r.name not in seen]
            if not candidates and not failures:
                candidates = up  # every replica up saw this id: its own 409 is the answer
            if not candidates:
                break
            left = self._left(peek, due, failures)
            replica, view, views = self.choose(peek, candidates, left)
            explained = self._explain(peek, candidates, views) if self.explain else None
            body = peek.body  # with what is left of its deadline, the policy's time counted
            if due is not None:
                body = with_deadline(peek.body, self._left(peek, due, failures))
            self.seq += 1
            seen.add(replica.name)
            if rid is not None:
                self._remember(rid, replica.name)
                self.in_flight[rid] = replica
            if peek.tree_key:
                replica.tree.insert(peek.tree_key)
            self.metrics.sent(replica.name)
            outcome = await self._attempt(route, peek, body, replica, view, len(failures) + 1,
                                          explained)  # fmt: skip
            if isinstance(outcome, Response):
                return outcome
            failures.append(f"{replica.name} ({replica.url}): {outcome.detail}")
            self.metrics.retried(outcome.reason)
        if not failures:
            raise ApiError(503, "no replica is up: " + "; ".join(
                f"{r.name} {r.state}" + (f" ({r.reason})" if r.reason else "")
                for r in self.replicas), "unavailable")  # fmt: skip
        raise ApiError(503, "no replica could take the request: " + "; ".join(failures),
                       "unavailable")  # fmt: skip

    def _left(self, peek: Peek, due: float | None, failures: Sequence[str]) -> float | None:
        """Seconds left until the deadline; past it, the router's 504 (it sends no work
        that cannot meet its deadline)."""
        if due is None:
            return None
        left = due - time.monotonic()
        if left > 0:
            return left
        self.metrics.expired()
        tried = (f"not sent again after {len(failures)} failed attempt(s): "
                 + "; ".join(failures)) if failures else "not sent"  # fmt: skip
        raise ApiError(504, f"the request's deadline (deadline_s {peek.deadline_s:g} after "
                       f"its arrival at the router) passed {-left:.3f} s ago; {tried}",
                       "deadline_exceeded")  # fmt: skip

    def _explain(self, peek: Peek, candidates: Sequence[Replica],
                 views: Sequence[ReplicaView]) -> str:  # fmt: skip
        num_tokens = 0 if peek.tokens is None else len(peek.tokens)
        announced = [r.announced_tokens(num_tokens, self._hashes(peek, r)) for r in candidates]
        return explain_views(views, announced)

    def _headers(self, replica: Replica, view: ReplicaView, peek: Peek, attempt: int,
                 explained: str | None) -> dict:  # fmt: skip
        headers = {"x-wavepp-replica": replica.name, "x-wavepp-attempts": str(attempt),
                   "x-wavepp-predicted-cached-tokens": str(view.predicted_tokens)}  # fmt: skip
        if peek.request_id is not None:
            headers["x-wavepp-request-id"] = peek.request_id
        if explained is not None:
            headers["x-wavepp-route-views"] = explained
        return headers

    async def _attempt(self, route: str, peek: Peek, body: bytes, replica: Replica,
                       view: ReplicaView, attempt: int,
                       explained: str | None = None) -> Response | _Retry:  # fmt: skip
        num_tokens = 0 if peek.tokens is None else len(peek.tokens)
        flight = Flight(peek.request_id, num_tokens, max(num_tokens - reuse_tokens(view), 0),
                        self._hashes(peek, replica) or ())  # fmt: skip
        replica.fly(flight)
        handed_on = False  # a stream's flight ends with the stream
        done = False  # answered 2xx: its prompt is cached there now
        try:
            with anyio.CancelScope() as scope:
                flight.scope = scope
                request = self.client.build_request(
                    "POST", replica.url + route, content=body,
                    headers={"content-type": "application/json", **peek.headers},
                )  # fmt: skip
                try:
                    upstream = await self.client.send(request, stream=True)
                except httpx.TransportError as error:
                    return self._lost(replica, error)
                try:
                    if upstream.status_code == 503:
                        return await self._unavailable(replica, upstream)
                    headers = self._headers(replica, view, peek, attempt, explained)
                    if peek.stream and upstream.headers.get("content-type", "").startswith(
                            "text/event-stream"):  # fmt: skip
                        handed_on = True
                        return self._stream(replica, flight, upstream, headers)
                    raw = await read_capped(upstream)
                except httpx.TransportError as error:
                    return self._lost(replica, error)
                finally:
                    if not handed_on:
                        with anyio.CancelScope(shield=True):
                            await upstream.aclose()
            if scope.cancelled_caught:  # the replica was taken out while the request waited
                await self._cancel_at(replica, peek.request_id)
                return _Retry("taken-out", f"taken out while the request waited "
                              f"({replica.reason})")  # fmt: skip
            self._answered(replica, upstream.status_code, raw, view, peek)
            done = 200 <= upstream.status_code < 300
            return Response(raw, status_code=upstream.status_code, headers=headers,
                            media_type=upstream.headers.get("content-type"))  # fmt: skip
        finally:
            if not handed_on:
                self._land(replica, flight, done)

    def _land(self, replica: Replica, flight: Flight, done: bool) -> None:
        replica.land(flight, done, time.monotonic())

    def _lost(self, replica: Replica, error: Exception) -> _Retry:
        """A refused connection takes the replica out; a connection lost before the answer
        only moves this request (the replica may be alive: its watcher decides)."""
        if isinstance(error, httpx.ConnectError):
            replica.take_out(f"cannot connect: {type(error).__name__}: {error}".rstrip(": "))
            return _Retry("connect", f"cannot connect ({type(error).__name__})")
        return _Retry("lost", f"lost the connection before answering ({type(error).__name__})")

    async def _unavailable(self, replica: Replica, upstream: httpx.Response) -> _Retry:
        raw = await read_capped(upstream)
        try:
            error = msgspec.json.decode(raw)["error"]
            message, kind = str(error["message"]), error.get("type")
        except (msgspec.DecodeError, KeyError, TypeError, AttributeError):
            message, kind = raw[:200].decode(errors="replace"), None
        state = "draining" if kind == "draining" else "out"  # the server's error type
        replica.take_out(f"answered 503: {message}", state=state)
        return _Retry("unavailable", f"503 {message[:200]}")

    async def _cancel_at(self, replica: Replica, request_id: str | None) -> None:
        if request_id is None:
            return
        with anyio.move_on_after(CANCEL_TIMEOUT_S, shield=True):
            with contextlib.suppress(httpx.HTTPError):  # gone: nothing of it runs there
                await self.client.delete(f"{replica.url}/v1/requests/{request_id}",
                                         timeout=CANCEL_TIMEOUT_S)  # fmt: skip

    def _answered(self, replica: Replica, code: int, raw: bytes, view: ReplicaView,
                  peek: Peek) -> None:  # fmt: skip
        try:
            body = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            body = None
        self.metrics.answered(replica.name, code, read_answer(body), view.predicted_tokens)

    def _stream(self, replica: Replica, flight: Flight, upstream: httpx.Response,
                headers: dict) -> StreamingResponse:  # fmt: skip
        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            except httpx.TransportError as error:
                message = (f"replica {replica.name} ({replica.url}) lost the stream: "
                           f"{type(error).__name__}")
                failure = ApiError(502, message, "server_error").body()
                yield b"data: " + msgspec.json.encode(failure) + b"\n\n"
            finally:
                with anyio.CancelScope(shield=True):
                    await upstream.aclose()
                self._land(replica, flight, 200 <= upstream.status_code < 300)
                if self.in_flight.get(flight.request_id or "") is replica:
                    self.in_flight.pop(flight.request_id or "", None)
                    self._finish(flight.request_id, upstream.status_code)
                self.metrics.passed_on(replica.name, upstream.status_code)

        return StreamingResponse(relay(), status_code=upstream.status_code, headers=headers,
                                 media_type="text/event-stream")  # fmt: skip

    # -- cancel -----------------------------------------------------------------------

    async def cancel(self, request_id: str) -> tuple[int, bytes]:
        replica = self.in_flight.get(request_id)
        if replica is None:
            raise ApiError(404, f"no request {request_id[:128]!r} in flight at the router",
                           "not_found")  # fmt: skip
        try:
            reply = await self.client.delete(f"{replica.url}/v1/requests/{request_id}",
                                             timeout=CANCEL_TIMEOUT_S)  # fmt: skip
        except httpx.HTTPError as error:
            raise ApiError(502, f"replica {replica.name} did not answer the cancel: "
                           f"{type(error).__name__}", "server_error") from None  # fmt: skip
        return reply.status_code, reply.content


async def read_capped(upstream: httpx.Response, who: str = "a replica") -> bytes:
    """An answer's whole body, ApiError(502) past ``MAX_ANSWER_BYTES``."""
    parts, size = [], 0
    async for chunk in upstream.aiter_bytes():
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            raise ApiError(502, f"{who}'s answer is over {MAX_ANSWER_BYTES:,} bytes",
                           "server_error")  # fmt: skip
        parts.append(chunk)
    return b"".join(parts)


def explain_views(views: Sequence[ReplicaView], announced: Sequence[int | None]) -> str:
    """``x-wavepp-route-views``: per candidate replica, ``name=p/a/f/r/q/n`` joined by
    ``;`` — predicted cached tokens (the events, as admission would grant), announced tokens
    before a hybrid's snapshot floor (``-`` where unknown), tokens in flight there, tokens
    answered there not yet confirmed by events, uncached prompt tokens queued there
    (``load_new_tokens``), requests in flight there."""
    parts = []
    for view, seen in zip(views, announced, strict=True):
        shown = "-" if seen is None else str(seen)
        parts.append(f"{view.name}={view.predicted_tokens}/{shown}/{view.pending_tokens}/"
                     f"{view.recent_tokens}/{view.load_new_tokens}/{view.num_in_flight}")
    return ";".join(parts)
