"""The receiver's table of requests whose bands are arriving: each band's claim on its
request (stage, layers, bytes) before its payload is read, the bands stored as they come,
the request's :class:`Handoff` once all P are in, and what expired (``docs/handoff.md``).

Memory is bounded: bytes claimed (incomplete requests, and complete ones not yet taken)
stay under ``max_held_bytes``, and the bytes of the bands one peer sent under
``max_peer_held_bytes``; at most ``max_requests`` are incomplete at once, and at most
``max_peer_requests`` of those opened by one peer (the peer of a request's first band);
a request not complete within ``incomplete_timeout_s`` of its first band is dropped, and
a complete one not taken within ``request_timeout_s``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict

import anyio
import attrs
import torch

from wavepp.handoff.wire import BandHeader, Fingerprint, WireError, band_bytes, request_key

log = logging.getLogger("wavepp.handoff")

MAX_DONE = 4096  # finished request ids remembered (late or repeated bands are refused)


class HandoffError(RuntimeError):
    """A request's handoff failed as a whole (expired, or its bands do not fit together)."""


@attrs.frozen(eq=False)
class Handoff:
    """One request's whole cache, in WavePP's native layout (``docs/handoff.md``)."""

    request_id: str
    tokens: torch.Tensor  # int64 [T]: the prompt
    first_token: int  # argmax of the prompt's last logits
    top_logit: float  # its logit
    layers: dict[int, dict[str, torch.Tensor]]  # global layer -> {k, v | latent | delta, conv}
    fingerprint: Fingerprint  # the model the cache was computed with
    num_stages: int  # bands it came in
    sender: str = ""  # the run that sent it (its bands' sender)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def key(self) -> str:
        """Where the receiver kept it (``wire.request_key``)."""
        return request_key(self.sender, self.request_id)


@attrs.define
class Pending:
    """A request with some bands in: what they claim and what has arrived."""

    num_stages: int
    num_tokens: int
    since: float  # monotonic time of its first band
    stages: set[int] = attrs.Factory(set)  # claimed: stored or being read
    layers: set[int] = attrs.Factory(set)  # claimed by those stages
    held: int = 0  # payload bytes claimed
    peer: str = ""  # who sent its first band (it counts against that peer's requests)
    charges: Counter[str] = attrs.Factory(Counter)  # payload bytes claimed, by peer
    bands: dict[int, dict[tuple[int, str], torch.Tensor]] = attrs.Factory(dict)
    first_token: int = -1
    top_logit: float = 0.0


class Assembly:
    """Requests by id, from their first band's claim to their Handoff taken (or their
    expiry). ``counts`` is the receiver's (``requests_expired``)."""

    def __init__(self, fingerprint: Fingerprint, *, max_requests: int, max_held_bytes: int,
                 request_timeout_s: float, counts: Counter[str],
                 incomplete_timeout_s: float | None = None,
                 max_peer_requests: int | None = None,
                 max_peer_held_bytes: int | None = None) -> None:  # fmt: skip
        """Without them, a peer may take all: ``max_peer_requests`` is ``max_requests``,
        ``max_peer_held_bytes`` is ``max_held_bytes``, and ``incomplete_timeout_s`` is
        ``request_timeout_s``."""
        self.fingerprint = fingerprint
        self.max_requests, self.max_held_bytes = max_requests, max_held_bytes
        self.max_peer_requests = max_requests if max_peer_requests is None else max_peer_requests
        self.max_peer_held_bytes = (max_held_bytes if max_peer_held_bytes is None
                                    else max_peer_held_bytes)  # fmt: skip
        self.request_timeout_s = request_timeout_s
        self.incomplete_timeout_s = (request_timeout_s if incomplete_timeout_s is None
                                     else incomplete_timeout_s)  # fmt: skip
        self.counts = counts
        self.held_bytes = 0
        self.peer_held: Counter[str] = Counter()  # payload bytes held, by the peer that sent them
        self.peer_requests: Counter[str] = Counter()  # incomplete requests, by who opened them
        self._pending: dict[str, Pending] = {}
        # id -> (it, since, bytes, bytes by peer)
        self._ready: dict[str, tuple[Handoff, float, int, Counter[str]]] = {}
        self._done: OrderedDict[str, str] = OrderedDict()  # id -> "" (taken) or why it failed
        self._events: dict[str, anyio.Event] = {}

    # -- a band's way in ---------------------------------------------------------

    def claim(self, header: BandHeader, peer: str = "", limited: bool = True) -> Pending:
        """Reserve the band's stage, layers and bytes in its request (WireError if the
        band cannot be part of it, or — ``limited`` — if it would take ``peer`` past its
        share), before anything is allocated; the bytes count as ``peer``'s either way."""
        rid, stage, size = _key(header), header.stage, band_bytes(header)
        if rid in self._ready or self._done.get(rid) == "":
            raise WireError(f"request {rid!r} is already complete")
        entry = self._pending.get(rid)
        if entry is None:
            if len(self._pending) >= self.max_requests:
                raise WireError(f"{len(self._pending)} requests are incomplete; at most "
                                f"{self.max_requests}")  # fmt: skip
            if limited and self.peer_requests[peer] >= self.max_peer_requests:
                raise WireError(f"peer {peer} has {self.peer_requests[peer]} incomplete "
                                f"requests; at most {self.max_peer_requests} per peer")  # fmt: skip
            entry = Pending(header.num_stages, header.num_tokens, time.monotonic(), peer=peer)
        if (entry.num_stages, entry.num_tokens) != (header.num_stages, header.num_tokens):
            raise WireError(
                f"request {rid!r}: this band says {header.num_stages} stages and "
                f"{header.num_tokens} tokens, earlier bands {entry.num_stages} and "
                f"{entry.num_tokens}"
            )
        if stage in entry.stages:
            raise WireError(f"request {rid!r}: stage {stage}'s band was already received")
        twice = sorted(entry.layers.intersection(header.layers))
        if twice:
            raise WireError(f"request {rid!r}: layers {twice} already came from another stage")
        if len(entry.stages) + 1 == entry.num_stages:
            covered = entry.layers.union(header.layers)
            missing = sorted(set(range(self.fingerprint.num_layers)) - covered)
            if missing:
                raise WireError(f"request {rid!r}: its {entry.num_stages} bands leave layers "
                                f"{missing[:16]} uncovered")  # fmt: skip
        if self.held_bytes + size > self.max_held_bytes:
            raise WireError(f"receiver holds {self.held_bytes:,} bytes; a band of {size:,} "
                            f"exceeds max_held_bytes {self.max_held_bytes:,}")  # fmt: skip
        if limited and self.peer_held[peer] + size > self.max_peer_held_bytes:
            raise WireError(f"peer {peer}'s bands hold {self.peer_held[peer]:,} bytes; a "
                            f"band of {size:,} exceeds {self.max_peer_held_bytes:,} per "
                            "peer")  # fmt: skip
        if rid not in self._pending:
            self._pending[rid] = entry
            self.peer_requests[entry.peer] += 1
        entry.stages.add(stage)
        entry.layers.update(header.layers)
        self._hold(entry.charges, peer, size)
        entry.held += size
        return entry

    def _hold(self, charges: Counter[str], peer: str, size: int) -> None:
        """``size`` bytes more (or fewer: negative) held for ``peer``."""
        charges[peer] += size
        self.peer_held[peer] += size
        self.held_bytes += size
        if not charges[peer]:
            del charges[peer]
        if not self.peer_held[peer]:
            del self.peer_held[peer]

    def _unhold(self, charges: Counter[str]) -> None:
        for peer, size in list(charges.items()):
            self._hold(charges, peer, -size)

    def _unpend(self, rid: str) -> Pending:
        entry = self._pending.pop(rid)
        self.peer_requests[entry.peer] -= 1
        if not self.peer_requests[entry.peer]:
            del self.peer_requests[entry.peer]
        return entry

    def expires_in(self, entry: Pending) -> float:
        """Seconds until an incomplete request is dropped (a band being read for it
        need not arrive after that)."""
        return max(entry.since + self.incomplete_timeout_s - time.monotonic(), 0.0)

    def release(self, entry: Pending, header: BandHeader, peer: str = "") -> None:
        """Undo ``peer``'s claim whose band did not arrive (unless its request is gone
        already)."""
        if self._pending.get(_key(header)) is not entry:
            return
        size = band_bytes(header)
        entry.stages.discard(header.stage)
        entry.layers.difference_update(header.layers)
        entry.held -= size
        self._hold(entry.charges, peer, -size)
        if not entry.stages:
            self._unpend(_key(header))

    def store(self, entry: Pending, header: BandHeader, tensors) -> Handoff | None:
        """Keep a band that arrived whole; the request's Handoff once all P are in (kept
        until :meth:`take` or :meth:`wait`)."""
        rid = _key(header)
        if self._pending.get(rid) is not entry:
            raise WireError(f"request {rid!r} expired while this band was read")
        entry.bands[header.stage] = tensors
        if header.stage == header.num_stages - 1:
            entry.first_token, entry.top_logit = header.first_token, header.top_logit
        if len(entry.bands) < entry.num_stages:
            return None
        self._unpend(rid)
        layers: dict[int, dict[str, torch.Tensor]] = {}
        tokens = None
        for band in entry.bands.values():
            for (layer, name), tensor in band.items():
                if layer == -1:
                    tokens = tensor.to(torch.int64)
                else:
                    layers.setdefault(layer, {})[name] = tensor
        handoff = Handoff(
            request_id=header.request_id, tokens=tokens, first_token=entry.first_token,
            top_logit=entry.top_logit, layers=dict(sorted(layers.items())),
            fingerprint=self.fingerprint, num_stages=entry.num_stages, sender=header.sender,
        )  # fmt: skip
        self._ready[rid] = (handoff, time.monotonic(), entry.held, entry.charges)
        return handoff

    # -- taking a complete request -------------------------------------------------

    def take(self, request_id: str) -> Handoff:
        """A complete request's Handoff, taken (``request_id``: its key, ``wire.request_key``):
        its bytes are no longer held here, and a band for it is refused from now on.
        KeyError if it is not complete."""
        handoff, _, _, charges = self._ready.pop(request_id)
        self._unhold(charges)
        self._finish(request_id, "")
        return handoff

    async def wait(self, request_id: str, timeout_s: float) -> Handoff:
        """The request's Handoff once all its bands are in (taken: a second wait for it
        fails); ``TimeoutError`` after ``timeout_s``; ``HandoffError`` if it failed."""
        deadline = time.monotonic() + timeout_s
        while True:
            if request_id in self._ready:
                return self.take(request_id)
            reason = self._done.get(request_id)
            if reason is not None:
                raise HandoffError(
                    f"request {request_id!r}: " + (reason or "its handoff was already taken")
                )
            left = deadline - time.monotonic()
            if left <= 0:
                entry = self._pending.get(request_id)
                got = f"stages {sorted(entry.bands)} of {entry.num_stages}" if entry else "no band"
                raise TimeoutError(f"request {request_id!r}: {got} arrived in {timeout_s:g} s")
            event = self._events.setdefault(request_id, anyio.Event())
            with anyio.move_on_after(left):
                await event.wait()
            if self._events.get(request_id) is event and event.is_set():
                del self._events[request_id]

    def pending(self) -> dict[str, tuple[list[int], int]]:
        """Incomplete requests: id -> (stages stored, num_stages)."""
        return {rid: (sorted(e.bands), e.num_stages) for rid, e in self._pending.items()}

    def expire(self, now: float) -> list[str]:
        """Drop requests incomplete for longer than ``incomplete_timeout_s``, and complete
        but not taken for longer than ``request_timeout_s``; returns their ids."""
        gone = []
        for rid, entry in list(self._pending.items()):
            if entry.since <= now - self.incomplete_timeout_s:
                self._unpend(rid)
                self._unhold(entry.charges)
                self._fail(rid, f"expired: stages {sorted(entry.bands)} of {entry.num_stages} "
                                f"arrived in {self.incomplete_timeout_s:g} s")  # fmt: skip
                gone.append(rid)
        for rid, (_, since, _, charges) in list(self._ready.items()):
            if since <= now - self.request_timeout_s:
                del self._ready[rid]
                self._unhold(charges)
                self._fail(rid, f"expired: complete but not taken in {self.request_timeout_s:g} s")
                gone.append(rid)
        return gone

    def notify(self, request_id: str) -> None:
        """Wake a :meth:`wait` for the request (it is complete, or failed)."""
        event = self._events.pop(request_id, None)
        if event is not None:
            event.set()

    def _finish(self, request_id: str, reason: str) -> None:
        self._done[request_id] = reason
        self._done.move_to_end(request_id)
        while len(self._done) > MAX_DONE:
            self._done.popitem(last=False)

    def _fail(self, request_id: str, reason: str) -> None:
        self.counts["requests_expired"] += 1
        log.info("handoff %r %s", request_id, reason)
        self._finish(request_id, reason)
        self.notify(request_id)


def _key(header: BandHeader) -> str:
    return request_key(header.sender, header.request_id)
