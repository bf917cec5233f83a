"""A connection's reads are bounded by the time without a byte, not by the read's length:
a peer that trickles bytes slower than the read needs but faster than the timeout is
waited for; one that stops is given up on no earlier than ``timeout_s``."""

import socket
import threading
import time

import anyio
import anyio.to_thread
import pytest

from wavepp.handoff._io import Connection


def trickle(sock: socket.socket, count: int, every_s: float) -> threading.Thread:
    def send() -> None:
        for _ in range(count):
            time.sleep(every_s)
            sock.send(b"x")

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def test_a_read_waits_on_a_peer_that_keeps_sending():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        thread = trickle(theirs, 20, 0.1)  # 2 s in all, a byte every 0.1 s
        view = memoryview(bytearray(20))
        anyio.run(Connection(ours, timeout_s=1.0).read_into, view)
        assert bytes(view) == b"x" * 20
        thread.join()


def test_a_read_gives_up_on_a_peer_that_stops():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        trickle(theirs, 3, 0.01).join()
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="3 of 10 read"):
            anyio.run(Connection(ours, timeout_s=0.3).read_into, memoryview(bytearray(10)))
        assert time.monotonic() - started >= 0.3


@pytest.mark.parametrize("sent, closes, n, outcome", [
    (b"abcd", False, 4, b"abcd"),  # all there: the fast path alone
    (b"", False, 0, b""),  # nothing to read, nothing waited for
    (b"", True, 0, b""),
    (b"", True, 4, ConnectionError),  # closed before a byte
    (b"ab", True, 4, ConnectionError),  # closed half way
    (b"ab", False, 4, TimeoutError),  # half, then silence
])  # fmt: skip
def test_a_read_ends_as_what_is_there_says(sent, closes, n, outcome):
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(sent)
        if closes:
            theirs.shutdown(socket.SHUT_WR)
        view = memoryview(bytearray(n))
        read = Connection(ours, timeout_s=0.2).read_into
        if isinstance(outcome, bytes):
            anyio.run(read, view)
            assert bytes(view) == outcome
        else:
            with pytest.raises(outcome):
                anyio.run(read, view)


def test_a_connect_to_a_unix_listener_with_a_full_backlog_waits_for_room(tmp_path):
    """Such a connect fails at once with EAGAIN (a Unix socket never connects in the
    background): it is tried again until the listener takes a connection."""
    from tests.helpers.handoff_rig import fill_backlog
    from wavepp.handoff._io import connect
    from wavepp.handoff.wire import Address

    path = str(tmp_path / "l.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(0)
    waiting = fill_backlog(path)

    async def main():
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, lambda: (time.sleep(0.2), listener.accept()))
            conn = await connect(Address("unix", path=path), 5.0)
            conn.sock.sendall(b"x")
            conn.close()

    try:
        assert waiting, "the backlog took no connection"
        started = time.monotonic()
        anyio.run(main)
        assert time.monotonic() - started >= 0.2  # it waited for the accept
    finally:
        for sock in waiting:
            sock.close()
        listener.close()


def test_a_tcp_name_connects_over_the_family_listen_binds_for_it(monkeypatch):
    """``localhost`` often resolves to ::1 first; a receiver listening on the same name
    bound IPv4 (``listen``): the connect asks for IPv4 too."""
    from wavepp.handoff import _io
    from wavepp.handoff.wire import Address

    listener, bound = _io.listen(Address("tcp", host="localhost", port=0))
    port = bound.port

    async def resolve(host, port, *, family=0, type=0, **kwargs):
        v6 = (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0))
        v4 = (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))
        return [v4] if family == socket.AF_INET else [v6, v4]

    monkeypatch.setattr(_io.anyio, "getaddrinfo", resolve)

    async def main():
        conn = await _io.connect(Address("tcp", host="localhost", port=port), 5.0)
        conn.close()

    try:
        anyio.run(main)
    finally:
        listener.close()
