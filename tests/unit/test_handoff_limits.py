"""One peer cannot shut a handoff receiver to the others (issue 57): connections that
trickle their header are cut at the header deadline, and each peer (its host; 127.0.0.2
is another peer than 127.0.0.1 on loopback) has a share of the connections, of the
incomplete requests and of the bytes held; incomplete requests expire long before
complete ones."""

from __future__ import annotations

import socket
import time

import anyio

from tests.helpers.handoff_peers import (
    CONFIG,
    band,
    connect,
    exchange,
    in_thread,
    read_ack,
    serving,
    split,
)
from wavepp.handoff import wire
from wavepp.handoff.receive import Receiver

OTHER = "127.0.0.2"  # another peer than 127.0.0.1, on the loopback interface


def trickle(address: wire.Address, data: bytes, every_s: float, most_s: float):
    """Send ``data`` a byte every ``every_s`` until the receiver answers or closes (or
    ``most_s`` passed); (the ack or None, seconds taken, bytes sent)."""
    started = time.monotonic()
    with connect(address) as sock:
        sock.settimeout(every_s)
        sent = 0
        while time.monotonic() - started < most_s:
            try:
                if sent < len(data):
                    sock.send(data[sent : sent + 1])
                    sent += 1
                if sock.recv(1, socket.MSG_PEEK):
                    sock.settimeout(5)
                    return read_ack(sock), time.monotonic() - started, sent
                return None, time.monotonic() - started, sent  # closed
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                return None, time.monotonic() - started, sent
    return None, time.monotonic() - started, sent


def test_a_header_trickled_a_byte_at_a_time_is_cut_at_the_header_deadline():
    """Bytes keep coming (each within read_timeout_s), but the prefix and header must be
    in within header_timeout_s of the connection."""
    receiver = Receiver(CONFIG, "float32", read_timeout_s=30, header_timeout_s=0.5)
    head, _ = split(band("slow"))

    async def main():
        async with serving(receiver) as address:
            return await in_thread(trickle, address, head, 0.05, 20)

    ack, seconds, sent = anyio.run(main)
    assert ack is not None and not ack.ok, (ack, seconds, sent)
    assert "did not arrive within 0.5 s of the connection" in ack.error
    assert sent < len(head) and seconds < 10
    # the magic came, the header did not: a late header of a broken band
    assert receiver.counts["headers_late"] == 1 and receiver.counts["bands_late"] == 0
    assert receiver.counts["bands_broken"] == 1


def test_tricklers_holding_every_slot_are_cut_and_the_next_band_gets_in():
    receiver = Receiver(CONFIG, "float32", read_timeout_s=30, header_timeout_s=0.5,
                        max_connections=2, max_peer_connections=2)  # fmt: skip
    head, _ = split(band("slow"))

    async def main():
        async with serving(receiver) as address, anyio.create_task_group() as tg:
            for _ in range(2):
                tg.start_soon(in_thread, trickle, address, head, 0.05, 20)
            await anyio.sleep(0.1)  # both slots taken
            return await in_thread(exchange, address, band("r", 0, 1))

    ack = anyio.run(main)
    assert ack is not None and ack.ok, ack


def test_a_silent_connection_is_closed_at_the_header_deadline():
    receiver = Receiver(CONFIG, "float32", read_timeout_s=30, header_timeout_s=0.3)

    async def main():
        async with serving(receiver) as address:
            return await in_thread(trickle, address, b"WP", 0.05, 20)

    ack, seconds, _ = anyio.run(main)
    assert ack is None and seconds < 10  # closed: no band magic to answer
    assert receiver.counts["headers_late"] == 1


def test_a_payload_trickled_past_its_requests_expiry_is_cut():
    receiver = Receiver(CONFIG, "float32", read_timeout_s=30, incomplete_timeout_s=0.5)

    async def main():
        async with serving(receiver) as address:
            data = band("slow", 0, 2)
            return await in_thread(trickle, address, data, 0.02, 20)

    ack, seconds, _ = anyio.run(main)
    assert ack is not None and not ack.ok and seconds < 10
    assert ack.error == "request 'slow' expired while this band was read"
    assert receiver.held_bytes == 0 and receiver.pending() == {}


def test_one_peer_cannot_take_every_connection():
    receiver = Receiver(CONFIG, "float32", max_connections=8, max_peer_connections=2)

    async def main():
        async with serving(receiver) as address:

            def hog():
                idle = [connect(address, OTHER) for _ in range(2)]
                time.sleep(0.2)  # accepted
                try:
                    refused = exchange(address, band("hog", 0, 1), OTHER)
                    mine = exchange(address, band("mine", 0, 1))
                    return refused, mine
                finally:
                    for sock in idle:
                        sock.close()

            return await in_thread(hog)

    refused, mine = anyio.run(main)
    assert refused is not None and not refused.ok
    assert refused.error == f"peer {OTHER} has 2 connections open; at most 2 per peer"
    assert mine is not None and mine.ok, mine
    assert receiver.counts["connections_refused"] == 1


def test_one_peer_cannot_fill_the_incomplete_requests():
    """Tiny "stage 0 of 2" bands: one peer opens at most its share of incomplete
    requests; another peer's request still gets in, and completes."""
    receiver = Receiver(CONFIG, "float32", max_requests=8, max_peer_requests=2)

    async def main():
        async with serving(receiver) as address:

            def flood():
                theirs = [exchange(address, band(f"f{i}", 0, 2), OTHER) for i in range(3)]
                mine = [exchange(address, band("mine", s, 2)) for s in (0, 1)]
                return theirs, mine

            return await in_thread(flood)

    theirs, mine = anyio.run(main)
    assert [a.ok for a in theirs] == [True, True, False]
    assert theirs[2].error == f"peer {OTHER} has 2 incomplete requests; at most 2 per peer"
    assert all(a.ok for a in mine), mine
    assert sorted(receiver.pending()) == ["f0", "f1"]
    assert receiver.counts["requests_complete"] == 1


def test_one_peer_cannot_pin_the_memory():
    """Large partial bands: one peer's bands hold at most its share of the bytes."""
    size = len(split(band("x", 0, 2))[1])  # one such band's payload
    receiver = Receiver(CONFIG, "float32", max_held_bytes=8 * size,
                        max_peer_held_bytes=2 * size)  # fmt: skip

    async def main():
        async with serving(receiver) as address:

            def pin():
                theirs = [exchange(address, band(f"p{i}", 0, 2), OTHER) for i in range(3)]
                mine = exchange(address, band("mine", 0, 2))
                return theirs, mine

            return await in_thread(pin)

    theirs, mine = anyio.run(main)
    assert [a.ok for a in theirs] == [True, True, False]
    assert theirs[2].error == (f"peer {OTHER}'s bands hold {2 * size:,} bytes; a band of "
                               f"{size:,} exceeds {2 * size:,} per peer")  # fmt: skip
    assert mine.ok and receiver.held_bytes == 3 * size


def test_the_default_shares_are_a_quarter_and_incomplete_requests_expire_sooner():
    receiver = Receiver(CONFIG, "float32", max_band_bytes=1 << 20)
    a = receiver._assembly
    assert receiver.max_peer_connections == 64 and a.max_peer_requests == 1024
    assert a.max_held_bytes == 4 << 20 and a.max_peer_held_bytes == 1 << 20
    assert a.incomplete_timeout_s == 60 < a.request_timeout_s == 300
    assert receiver.header_timeout_s == 10
    # a share never below one band's worth
    assert Receiver(CONFIG, "float32", max_band_bytes=1 << 20,
                    max_held_bytes=1 << 21)._assembly.max_peer_held_bytes == 1 << 20  # fmt: skip


def test_incomplete_requests_expire_before_complete_ones_and_free_their_peers_share():
    receiver = Receiver(CONFIG, "float32", incomplete_timeout_s=5, request_timeout_s=100)

    async def main():
        async with serving(receiver) as address:

            def send():
                return [exchange(address, band("half", 0, 2), OTHER),
                        exchange(address, band("whole", 0, 1), OTHER)]  # fmt: skip

            return await in_thread(send)

    assert all(a.ok for a in anyio.run(main))
    a = receiver._assembly
    assert a.peer_requests == {OTHER: 1} and set(a.peer_held) == {OTHER}
    assert receiver.expire(time.monotonic() + 10) == ["half"]
    assert a.peer_requests == {} and receiver.pending() == {}
    assert receiver.expire(time.monotonic() + 200) == ["whole"]
    assert receiver.held_bytes == 0 and a.peer_held == {}


def test_a_unix_peer_is_its_user():
    import os

    left, right = socket.socketpair(socket.AF_UNIX)
    with left, right:
        from wavepp.handoff._io import peer_of

        assert peer_of(left) == f"unix uid {os.getuid()}"


def test_the_deadline_ends_a_drain_that_keeps_getting_bytes():
    from wavepp.handoff._io import Connection, DeadlineError

    async def main():
        left, right = socket.socketpair()
        with left, right:
            conn = Connection(left, timeout_s=30)
            conn.set_deadline(0.3, "drained long enough")

            async def drip():
                while True:
                    right.send(b"x")
                    await anyio.sleep(0.05)

            async with anyio.create_task_group() as tg:
                tg.start_soon(drip)
                try:
                    await conn.drain(1 << 20)
                except DeadlineError as error:
                    tg.cancel_scope.cancel()
                    return str(error)
            return None

    assert anyio.run(main) == "drained long enough"


