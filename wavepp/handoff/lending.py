"""The receiving side of lent segments: a band's buffer lent to its sender on this host.

A sender on this host that offers to (``FLAG_SEGMENT``) is lent the band's buffer
itself, a memfd, and writes the payload into it: one copy in all, none here. A segment
is lent again only to the process it was first lent to (by its Unix socket peer's pid
and start time), so a sender that kept its file can write into the bands it sends, not
another sender's, and only once that sender said it was done writing (a band given up
half way may still be written into: its segment is closed). A sender that asks
(``FLAG_RESERVE``) is also lent a segment for its next band, which that band then names
(``FLAG_RESERVED``) with its payload already in it: no answer before the ack. A
reservation unused for ``RESERVATION_S`` is closed, not lent again. Where no segment is
lent (lending off, not a Unix socket, none to be had), the payload comes on the socket.
The sending side is ``wavepp.handoff.segments``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Hashable

import attrs
import torch

from wavepp.handoff import _io
from wavepp.handoff.buffers import BandBuffers, Memory, views
from wavepp.handoff.gate import Arrival
from wavepp.handoff.wire import (
    DONE_MAGIC,
    FLAG_RESERVE,
    FLAG_RESERVED,
    FLAG_SEGMENT,
    RESERVE_MAGIC,
    BandHeader,
    WireError,
    encode_segment,
    payload_layout,
)

log = logging.getLogger("wavepp.handoff")

RESERVATION_S = 30.0  # a segment reserved for a sender's next band, unused this long, is closed
MAX_RESERVED = 8  # segments reserved for one sender at once

Tensors = dict[tuple[int, str], torch.Tensor]


@attrs.define(eq=False)
class Reservation:
    """A segment reserved for one sender's next band (``FLAG_RESERVE``)."""

    peer: Hashable  # the process it was lent to
    buffer: torch.Tensor  # uint8, the whole segment: its owner while reserved
    memory: Memory
    until: float  # monotonic: closed if not used by then


class SegmentLender:
    """One receiver's side of the segment exchanges (``lend``: whether it lends at all;
    when not, it answers every offer and reservation with size 0). ``counts`` is the
    receiver's: ``segments_reserved``, ``reservations_used``, ``reservations_missed``,
    ``reservations_expired``."""

    def __init__(self, buffers: BandBuffers, lend: bool, counts: Counter[str]) -> None:
        self.buffers, self.lend, self.counts = buffers, lend, counts
        self._reserved: dict[int, Reservation] = {}  # segment id -> its reservation

    @staticmethod
    def involved(arrival: Arrival) -> bool:
        """Whether the band's flags start a segment exchange."""
        return bool(arrival.flags & (FLAG_SEGMENT | FLAG_RESERVED))

    async def receive(self, conn: _io.Connection, arrival: Arrival) -> Tensors | None:
        """The band's tensors, written into a segment by its sender (views of it, the
        token ids copied: the sender can still write into it), or None once the exchange
        says the payload follows on the socket."""
        header, reserve = arrival.header, bool(arrival.flags & FLAG_RESERVE)
        if arrival.segment_id is not None:
            return await self._take_reserved(conn, header, arrival.segment_id, reserve)
        return await self._lend(conn, header, reserve)

    def refused(self, conn: _io.Connection, arrival: Arrival) -> None:
        """A refused band that named a reservation: its sender may be writing into it, so
        it is taken out of the table (closed once free, never lent again)."""
        if arrival.segment_id is not None:
            self._unreserve(arrival.segment_id, _peer(conn))

    def expire(self, now: float) -> None:
        for segment_id, reservation in list(self._reserved.items()):
            if reservation.until <= now:  # still spoiled: closed once let go
                del self._reserved[segment_id]
                self.counts["reservations_expired"] += 1

    def close(self) -> None:
        self._reserved.clear()  # closed: a sender may still write into them

    async def _lend(self, conn: _io.Connection, header: BandHeader,
                    reserve: bool) -> Tensors | None:  # fmt: skip
        """A band offered into a segment: lend one (the sender writes the payload into
        it, then says ``DONE_MAGIC``) or — beyond a Unix socket, or when ``BandBuffers``
        has none to lend — decline (size 0). With ``reserve``, a reservation for the
        sender's next band follows the answer."""
        offsets, size = payload_layout(header)
        peer = _peer(conn)
        taken = self._segment(peer, size) if size else None
        if taken is None:
            await conn.send(encode_segment(0))
            if reserve:
                await self._reserve(conn, peer, size)
            return None
        buffer, memory = taken
        tensors = views(buffer, header, offsets)
        memory.spoiled = True  # until the sender says it is done writing
        await conn.send_fd(encode_segment(memory.array.nbytes, memory.segment_id), memory.fd)
        if reserve:
            await self._reserve(conn, peer, size)
        return await self._written(conn, memory, tensors)

    def _segment(self, peer: Hashable | None, size: int, whole: bool = False):
        """A segment of ``size`` bytes for the process ``peer`` (``BandBuffers.lend``), or
        None: lending is off, the peer is not a process this side can name (None), or no
        segment is to be had."""
        if not self.lend or peer is None:
            return None
        try:
            return self.buffers.lend(size, peer, whole)
        except OSError as error:  # this side's failure (no memory, no descriptors)
            log.warning("no segment lent for a band of %d bytes: %r", size, error)
            return None

    async def _written(self, conn: _io.Connection, memory: Memory, tensors: Tensors) -> Tensors:
        """The band's tensors, in ``memory`` (a segment), once the sender says it is done
        writing them."""
        done = await conn.read_exactly(len(DONE_MAGIC))
        if done != DONE_MAGIC:
            raise WireError(f"expected {DONE_MAGIC!r} after the segment's payload, got {done!r}")
        memory.spoiled = False
        # the sender can still write into the segment: the token ids are checked on a copy
        tokens = tensors.get((-1, "tokens"))
        if tokens is not None:
            tensors[(-1, "tokens")] = tokens.clone()
        return tensors

    async def _reserve(self, conn: _io.Connection, peer: Hashable | None, size: int) -> None:
        """Answer ``FLAG_RESERVE``: a segment of at least ``size`` bytes reserved for this
        peer's next band (``RESERVE_MAGIC`` and the memfd), or size 0 — lending is off,
        this peer holds ``MAX_RESERVED`` already, or no segment is to be had. A reserved
        segment counts as lent: the sender may write into it from now on, so it is never
        lent again unless a band that names it says it is done writing."""
        held = sum(1 for r in self._reserved.values() if r.peer == peer)
        taken = self._segment(peer, size, whole=True) if size and held < MAX_RESERVED else None
        if taken is None:
            await conn.send(encode_segment(0, 0, RESERVE_MAGIC))
            return
        buffer, memory = taken
        memory.spoiled = True
        self._reserved[memory.segment_id] = Reservation(
            peer, buffer, memory, time.monotonic() + RESERVATION_S)
        self.counts["segments_reserved"] += 1
        await conn.send_fd(encode_segment(memory.array.nbytes, memory.segment_id,
                                          RESERVE_MAGIC), memory.fd)  # fmt: skip

    def _unreserve(self, segment_id: int, peer: Hashable | None) -> Reservation | None:
        """The reservation ``peer`` names, taken out of the table (None: no such
        reservation of that peer's; another's stays)."""
        reservation = self._reserved.get(segment_id)
        if reservation is None or peer is None or reservation.peer != peer:
            return None
        return self._reserved.pop(segment_id)

    async def _take_reserved(self, conn: _io.Connection, header: BandHeader,
                             segment_id: int, reserve: bool) -> Tensors | None:  # fmt: skip
        """A band written into the segment reserved for its sender: its tensors are views
        of it once the sender says ``DONE_MAGIC``. A reservation this side does not hold
        (expired, another process's, a receiver restarted since) or too small for the
        band is answered with size 0, and the payload follows on the socket after the
        ``DONE_MAGIC``."""
        offsets, size = payload_layout(header)
        peer = _peer(conn)
        reservation = self._unreserve(segment_id, peer)
        if reserve:
            await self._reserve(conn, peer, size)
        if reservation is None or size > reservation.buffer.numel():
            self.counts["reservations_missed"] += 1
            reservation = None  # a too small one stays spoiled: closed, never lent again
            await conn.send(encode_segment(0))
            done = await conn.read_exactly(len(DONE_MAGIC))
            if done != DONE_MAGIC:
                raise WireError(f"expected {DONE_MAGIC!r} before the payload, got {done!r}")
            return None
        self.counts["reservations_used"] += 1
        tensors = views(reservation.buffer, header, offsets)
        memory = reservation.memory
        del reservation
        return await self._written(conn, memory, tensors)


def _peer(conn: _io.Connection) -> tuple[int, int] | None:
    """The process at the other end (``_io.peer_process``); None where it cannot be
    named (not a Unix socket, gone, or unreadable)."""
    try:
        return _io.peer_process(conn.sock)
    except OSError:
        return None
