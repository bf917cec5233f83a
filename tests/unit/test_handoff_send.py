"""A stage's handoff sender against real receivers on Unix sockets, well and badly behaved:
every band ends with exactly one outcome and one release, whatever the receiver does."""

from __future__ import annotations

import contextlib
import socket
import tempfile
import threading
import time
from functools import partial
from pathlib import Path
from unittest import mock

import anyio
import anyio.to_thread
import attrs
import numpy as np
import pytest
import torch

from tests.helpers.sender_bands import FP, band_of, job
from wavepp.exec.torch_exec import pool_rows
from wavepp.handoff import _io, socket_send, wire
from wavepp.handoff.base import BandJob, BandTensor, HandoffSettings
from wavepp.handoff.send import HandoffSender
from wavepp.handoff.socket_send import INLINE_BYTES


class Receiver(threading.Thread):
    """A receiver on a Unix socket; ``mode`` says how it behaves for every band."""

    def __init__(self, path: str, mode: str = "ok") -> None:
        super().__init__(daemon=True)
        self.path, self.mode = path, mode
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(path)
        self.sock.listen(64)
        self.bands: list[tuple[wire.BandHeader, bytes]] = []
        self.stop = threading.Event()

    def _exactly(self, conn: socket.socket, n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            part = conn.recv(n - len(data))
            if not part:
                raise EOFError
            data += part
        return bytes(data)

    def run(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            with conn, contextlib.suppress(EOFError, OSError):  # a hung-up sender
                self._serve(conn)

    def _serve(self, conn: socket.socket) -> None:
        if self.mode == "close":  # accepts, then hangs up at once
            return
        header = wire.decode_header(self._exactly(conn, wire.header_length(
            self._exactly(conn, wire.PREFIX_BYTES))))  # fmt: skip
        if self.mode == "refuse":  # answers after the header, never reads the payload
            conn.sendall(wire.encode_ack(wire.Ack(header.request_id, header.stage, False,
                                                  "fingerprint differs: num_layers")))  # fmt: skip
            return
        if self.mode == "late":  # reads the payload once the sender has written it all
            time.sleep(0.3)
        if self.mode == "half":  # reads part of the payload, then hangs up
            self._exactly(conn, 16)
            return
        if self.mode == "silent":  # reads everything, never answers
            self._exactly(conn, wire.band_bytes(header))
            self.stop.wait(30)
            return
        payload = self._exactly(conn, wire.band_bytes(header))
        if self.mode == "garbage":
            conn.sendall(b"HTTP/1.1 200 OK\r\n\r\n")
            return
        if self.mode == "wrong-id":
            conn.sendall(wire.encode_ack(wire.Ack("someone-else", header.stage, True)))
            return
        self.bands.append((header, payload))
        conn.sendall(wire.encode_ack(wire.Ack(header.request_id, header.stage, True)))

    def close(self) -> None:
        self.stop.set()
        self.join(5)
        self.sock.close()


def run_jobs(jobs, *, timeout_s=5.0, budget=1 << 20, cancel=(), cancel_after=0.05, peak=None,
             inline=False, band=band_of):  # fmt: skip
    """``inline``: small bands go out from the event loop (a CPU stage's), not a thread."""
    released: list[str] = []
    settings = HandoffSettings(1, 2, FP, timeout_s, budget,
                               inline_bytes=INLINE_BYTES if inline else 0)
    sender = HandoffSender(settings, band, released.append)

    async def main():
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.run)
            for j in jobs:
                sender.send(j)
            if cancel:
                await anyio.sleep(cancel_after)
                for rid in cancel:
                    sender.abort(rid)
            with anyio.fail_after(60):  # hang guard
                while sender.num_pending:
                    if peak is not None:
                        peak.append(sender._in_use)
                    await anyio.sleep(0.001)
            tg.cancel_scope.cancel()

    # an inline band never reaches the worker thread's exchange
    with mock.patch.object(socket_send, "_exchange", side_effect=AssertionError) if inline \
            else contextlib.nullcontext():  # fmt: skip
        anyio.run(main)
    outcomes = {o.request_id: o for o in sender.poll()}
    assert not any("AssertionError" in o.detail for o in outcomes.values()), outcomes
    return outcomes, released


async def _until(condition) -> None:
    with anyio.fail_after(60):  # hang guard
        while not condition():
            await anyio.sleep(0.005)


def send_one(receiver: Receiver, band, one: BandJob) -> bytes:
    """``one`` through a thread-path sender into a started ``receiver`` (closed after):
    its payload as received; the band must be acknowledged."""
    sender = HandoffSender(HandoffSettings(1, 2, FP, 30.0, 1 << 30), band, lambda rid: None)

    async def main():
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.run)
            sender.send(one)
            await _until(lambda: not sender.num_pending)
            tg.cancel_scope.cancel()

    try:
        anyio.run(main)
    finally:
        receiver.close()
    (outcome,) = sender.poll()
    assert outcome.ok, outcome
    ((_, payload),) = receiver.bands
    return payload


@pytest.fixture
def sock_path(tmp_path):
    return str(tmp_path / "r.sock")


@pytest.mark.parametrize("inline", [False, True])
def test_an_acknowledged_band_carries_its_header_and_bytes_in_order(sock_path, inline):
    receiver = Receiver(sock_path)
    receiver.start()
    try:
        outcomes, released = run_jobs([job("a", f"unix:{sock_path}", n=7)], inline=inline)
    finally:
        receiver.close()
    assert outcomes["a"].ok and outcomes["a"].reason == "" and released == ["a"]
    ((header, payload),) = receiver.bands
    assert (header.request_id, header.stage, header.num_stages) == ("a", 1, 2)
    assert header.layers == [0, 1] and header.num_tokens == 7 and header.fingerprint == FP
    assert (header.first_token, header.top_logit) == (3, 1.5)
    assert [(t.layer, t.name) for t in header.tensors] == [(0, "k"), (0, "v"), (1, "k"), (1, "v")]
    tensors = np.frombuffer(payload, dtype=np.float32).reshape(4, 7, 4)
    assert tensors[3, 0, 0] == 1001 and tensors[2, 6, 3] == 1000 + 27
    assert outcomes["a"].num_bytes == len(payload) == 4 * 7 * 4 * 4


@pytest.mark.parametrize("inline", [False, True])
@pytest.mark.parametrize(("mode", "reason"), [
    ("refuse", "refused"), ("half", "disconnected"), ("close", "disconnected"),
    ("garbage", "bad ack"), ("wrong-id", "bad ack"), ("silent", "timeout"),
])  # fmt: skip
def test_a_misbehaving_receiver_fails_only_that_band_and_releases_it(sock_path, mode, reason,
                                                                    inline):  # fmt: skip
    receiver = Receiver(sock_path, mode)
    receiver.start()
    try:
        outcomes, released = run_jobs([job("a", f"unix:{sock_path}", n=2000)], timeout_s=1.0,
                                      inline=inline)  # fmt: skip
    finally:
        receiver.close()
    assert not outcomes["a"].ok and outcomes["a"].reason == reason, outcomes["a"]
    assert released == ["a"]
    if mode == "refuse":
        assert "fingerprint differs" in outcomes["a"].detail


@pytest.mark.skipif(int(Path("/proc/sys/net/core/wmem_max").read_text()) < 1 << 20,
                    reason="the kernel caps a socket's send buffer under 1 MiB (wmem_max)")
def test_an_inline_band_goes_into_the_send_buffer_whole_without_waiting(sock_path):
    """A CPU stage's inline band of 640 KiB, three times the default send buffer of a
    Unix socket, is handed to the kernel without the loop waiting on the receiver once
    (its send buffer is raised): one wakeup for the ack, not one per buffer's worth."""
    receiver = Receiver(sock_path, "late")
    receiver.start()
    waits = []
    real = anyio.wait_writable

    async def counting(sock):
        waits.append(sock)
        await real(sock)

    n = 640 * 1024 // 64  # 4 tensors of n x 1 x 4 float32

    def band(one):  # rows as views, as a CPU stage's pool gives them
        return [attrs.evolve(t, pieces=lambda t=t: iter([t.read().numpy().data.cast("B")]))
                for t in band_of(one)]  # fmt: skip

    try:
        with mock.patch.object(_io.anyio, "wait_writable", counting):
            outcomes, _ = run_jobs([job("a", f"unix:{sock_path}", n=n)], inline=True,
                                   band=band)  # fmt: skip
    finally:
        receiver.close()
    assert outcomes["a"].ok and outcomes["a"].num_bytes == 640 * 1024, outcomes
    assert waits == []
    ((header, payload),) = receiver.bands
    assert header.request_id == "a"
    assert payload == b"".join(t.read().numpy().tobytes() for t in band_of(job("a", "", n=n)))


@pytest.mark.parametrize("inline", [False, True])
def test_no_receiver_and_a_bad_address_are_failures_not_crashes(tmp_path, inline):
    outcomes, released = run_jobs([job("a", f"unix:{tmp_path}/nobody.sock"),
                                   job("b", "carrier-pigeon:home")], inline=inline)  # fmt: skip
    assert outcomes["a"].reason == "connect" and outcomes["b"].reason == "error"
    assert sorted(released) == ["a", "b"]


@pytest.mark.parametrize("inline", [False, True])
def test_a_cancel_stops_a_band_on_the_wire_and_releases_it_once(sock_path, inline):
    receiver = Receiver(sock_path, "silent")
    receiver.start()
    try:
        jobs = [job("a", f"unix:{sock_path}"), job("b", f"unix:{sock_path}")]
        outcomes, released = run_jobs(jobs, timeout_s=3.0, cancel=["a"], cancel_after=0.3,
                                      inline=inline)  # fmt: skip
    finally:
        receiver.close()
    assert outcomes["a"].reason == "cancelled"
    assert outcomes["b"].reason == "timeout"  # the receiver never answers
    assert sorted(released) == ["a", "b"]


def test_the_byte_budget_sends_bands_one_at_a_time_when_each_fills_it(sock_path):
    receiver = Receiver(sock_path)
    receiver.start()
    try:
        # each band is 4 x 10 x 4 x 4 = 640 bytes; a budget of 700 lets one go at a time
        peak: list[int] = []
        outcomes, released = run_jobs([job(f"r{i}", f"unix:{sock_path}") for i in range(5)],
                                      budget=700, peak=peak)  # fmt: skip
    finally:
        receiver.close()
    assert max(peak) == 640  # one band's bytes at a time, never two
    assert all(o.ok for o in outcomes.values()) and sorted(released) == [f"r{i}" for i in range(5)]
    assert sorted(h.request_id for h, _ in receiver.bands) == [f"r{i}" for i in range(5)]


def test_pool_rows_read_a_request_through_its_block_table():
    rows = pool_rows((5, 2, 7), block_size=4, num_tokens=10)
    assert rows.tolist() == [20, 21, 22, 23, 8, 9, 10, 11, 28, 29]
    with pytest.raises(ValueError, match="block table of 2 blocks for 10 tokens"):
        pool_rows((5, 2), block_size=4, num_tokens=10)


def test_a_band_larger_than_the_socket_buffers_arrives_whole(sock_path):
    """Tensors of several MiB go out in many partial sends: every byte, in order."""
    receiver = Receiver(sock_path)
    receiver.start()
    big = torch.arange(4096 * 2 * 32, dtype=torch.float32).reshape(4096, 2, 32)

    def band(job):
        return [BandTensor(0, "k", "float32", (4096, 2, 32), lambda: big),
                BandTensor(0, "v", "float32", (4096, 2, 32), lambda: -big)]  # fmt: skip

    payload = send_one(receiver, band, job("big", f"unix:{sock_path}", n=4096))
    got = torch.frombuffer(bytearray(payload), dtype=torch.float32).reshape(2, 4096, 2, 32)
    assert torch.equal(got[0], big) and torch.equal(got[1], -big)


def test_a_band_of_more_runs_than_one_sendmsg_takes_arrives_whole_and_in_order(sock_path):
    """Every other slot of the pool: one run per row, more than IOV_MAX of them, with a
    copied tensor (a recurrent state's kind) between two layers' runs."""
    from wavepp.exec.torch_exec import _gather, _pool_pieces, _row_runs

    n = _io.IOV_MAX + 300
    pool = torch.randn(2 * n, 1, 4)
    table = tuple(range(0, 2 * n, 2))  # block size 1: no two rows adjacent
    runs = _row_runs(table, 1, n)
    assert len(runs) == n
    rows = partial(pool_rows, table, 1, n)
    state = torch.arange(12, dtype=torch.float32).reshape(3, 4)

    def band(job):
        k = BandTensor(0, "k", "float32", (n, 1, 4), partial(_gather, pool, rows),
                       partial(_pool_pieces, pool, runs))  # fmt: skip
        copied = BandTensor(1, "state", "float32", (3, 4), lambda: state)
        v = BandTensor(1, "v", "float32", (n, 1, 4), partial(_gather, pool, rows),
                       partial(_pool_pieces, pool, runs))  # fmt: skip
        return [k, copied, v]

    receiver = Receiver(sock_path)
    receiver.start()
    payload = send_one(receiver, band, job("runs", f"unix:{sock_path}", n=n))
    rows_bytes = _gather(pool, rows).reshape(-1).view(torch.uint8).numpy().tobytes()
    assert payload == rows_bytes + state.numpy().tobytes() + rows_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_pieces_are_views_of_the_pool_one_per_run(dtype):
    from wavepp.exec.torch_exec import _gather, _pool_pieces, _row_runs

    pool = torch.randn(12 * 4, 2, 3).to(dtype)  # 12 blocks of 4 rows
    table, n = (5, 6, 2, 9, 10, 11), 22  # runs: blocks 5-6, 2, 9-11 (the last one partial)
    runs = _row_runs(table, 4, n)
    assert runs == [(20, 28), (8, 12), (36, 46)]
    row = 2 * 3 * pool.element_size()
    expected = _gather(pool, lambda: pool_rows(table, 4, n)).reshape(-1).view(torch.uint8).numpy()
    pieces = list(_pool_pieces(pool, runs))
    assert [p.nbytes // row for p in pieces] == [8, 4, 10]
    assert b"".join(bytes(p) for p in pieces) == expected.tobytes()
    pool[36, 0, 0] = 7.0  # each piece is a view of the pool itself, not a copy
    assert torch.frombuffer(bytearray(bytes(pieces[2])), dtype=dtype)[0] == 7.0


@pytest.mark.parametrize("inline", [False, True])
def test_a_band_over_tcp_to_the_library_receiver_is_checked_and_acknowledged(inline):
    """The other transport, against ``wavepp.handoff``'s own Receiver (which checks the
    band against its model before taking it)."""
    from tests.helpers.handoff_rig import ReceiverThread

    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
              "num_hidden_layers": 2, "hidden_size": 8, "vocab_size": 64,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4}  # fmt: skip
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    rx = ReceiverThread(config, "float32", None, address=f"tcp://127.0.0.1:{port}")
    with rx:
        outcomes, released = run_jobs([job("t", f"tcp://127.0.0.1:{port}", n=33)],
                                      inline=inline)  # fmt: skip
        assert rx.receiver.counts["bands_ok"] == 1
    assert outcomes["t"].ok and released == ["t"]
    assert outcomes["t"].num_bytes == 4 * 33 * 4 * 4


class GatedBand:
    """A band whose second tensor is read like a GPU stage's (a copy to host memory, in
    the worker thread) and holds there until ``gate`` opens; ``reads`` counts reads done."""

    def __init__(self) -> None:
        self.entered, self.gate = threading.Event(), threading.Event()
        self.reads = 0

    def read(self, value: torch.Tensor) -> torch.Tensor:
        self.entered.set()
        self.gate.wait(30)
        self.reads += 1
        return value

    def __call__(self, job: BandJob) -> list[BandTensor]:
        n = job.num_tokens
        k = torch.zeros(n, 1, 4)
        return [BandTensor(0, "k", "float32", (n, 1, 4), lambda: k),
                BandTensor(0, "v", "float32", (n, 1, 4), lambda: self.read(k))]  # fmt: skip


def test_a_cancelled_band_is_released_only_after_its_thread_stops_reading(sock_path):
    """A cancel mid-band shuts the socket, but the worker thread may still be reading the
    pool: the release (which frees the blocks for reuse) waits for it."""
    receiver = Receiver(sock_path, "silent")
    receiver.start()
    band = GatedBand()
    released: list[str] = []
    sender = HandoffSender(HandoffSettings(1, 2, FP, 30.0, 1 << 20), band, released.append)

    async def main():
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.run)
            sender.send(job("a", f"unix:{sock_path}"))
            await _until(band.entered.is_set)  # the thread is inside the second read
            sender.abort("a")
            await anyio.sleep(0.2)  # the event loop is free to settle the band...
            assert released == [] and sender.num_pending == 1  # ...and must not yet
            band.gate.set()
            await _until(lambda: not sender.num_pending)
            tg.cancel_scope.cancel()

    try:
        anyio.run(main)
    finally:
        receiver.close()
    (outcome,) = sender.poll()
    assert outcome.reason == "cancelled" and released == ["a"] and band.reads == 1


def test_a_stage_keeps_a_cancelled_requests_blocks_until_its_band_has_stopped():
    """``Stage.drop`` of a request whose band is on its way leaves the blocks (its partial
    last block among them, which the free list would hand out at once) to the sender."""
    from wavepp.exec.stage import Stage
    from wavepp.policy import DEFAULT
    from wavepp.rounds.admission import StageBook
    from wavepp.state import empty_cache, usage

    band = GatedBand()

    class Executor:
        def band(self, job):
            return band(job)

        def cancel(self, rid):
            pass

    settings = HandoffSettings(1, 2, FP, 30.0, 1 << 20)
    stage = Stage(1, StageBook(empty_cache(8)), Executor(), 4, 4, False, handoff=settings)
    cache, _ = DEFAULT.lease(stage.book.cache, "a", [], 0)
    cache, ok = DEFAULT.escrow(cache, "a", 3)
    stage.book.cache, _ = DEFAULT.materialize(cache, "a", 3)  # 10 tokens: 3 blocks
    assert ok and usage(stage.book.cache).num_free == 5

    async def main(path):
        async with anyio.create_task_group() as tg:
            tg.start_soon(stage.handoffs.run)
            stage.handing_off.add("a")
            stage.handoffs.send(job("a", f"unix:{path}"))
            await _until(band.entered.is_set)
            stage.drop("a")
            assert "a" in stage.book.cache.claims  # still held: the thread reads them
            assert usage(stage.book.cache).num_free == 5
            band.gate.set()
            await _until(lambda: not stage.handoffs.num_pending)
            tg.cancel_scope.cancel()

    with tempfile.TemporaryDirectory() as tmp:
        receiver = Receiver(f"{tmp}/r.sock", "silent")
        receiver.start()
        try:
            anyio.run(main, f"{tmp}/r.sock")
        finally:
            receiver.close()
    assert "a" not in stage.book.cache.claims and not stage.handing_off
    assert usage(stage.book.cache).num_free == 8
    (outcome,) = stage.handoffs.poll()
    assert outcome.reason == "cancelled"


def test_the_outcome_tells_the_time_on_the_wire_from_the_whole(sock_path):
    receiver = Receiver(sock_path)
    receiver.start()
    try:
        outcomes, _ = run_jobs([job("a", f"unix:{sock_path}", n=500)])
    finally:
        receiver.close()
    assert 0 < outcomes["a"].wire_s <= outcomes["a"].seconds


def test_a_band_reads_the_cached_slot_of_a_block_another_request_published_first():
    """A prompt of whole blocks that is cached already recomputes its last block (its
    last token's logits are needed); publishing then shares the cached block and gives
    the wave's own slot back to the pool, where the next request may overwrite it. The
    band's table is the one after publishing."""
    from wavepp.exec.base import ChunkWork, StageOutput
    from wavepp.exec.stage import Admitted, Stage
    from wavepp.policy import DEFAULT as p
    from wavepp.rounds.admission import Offer, StageBook
    from wavepp.state import block_hashes, block_table, empty_cache, usage

    class Executor:
        def band(self, job):
            return []

    settings = HandoffSettings(1, 2, FP, 30.0, 1 << 20)
    stage = Stage(1, StageBook(empty_cache(8)), Executor(), 4, 4, False, handoff=settings)
    hashes = tuple(block_hashes(np.arange(8, dtype=np.int32), 4))
    cache, _ = p.lease(stage.book.cache, "a", hashes, 0)  # "a" computes both blocks
    cache, _ = p.escrow(cache, "a", 2)
    cache, _ = p.materialize(cache, "a", 2)
    cached = block_table(cache, "a")
    cache = p.release(p.publish(cache, "a", hashes, 2), "a")
    cache, got = p.lease(cache, "b", hashes, 1)  # "b": the same 8 tokens, block 1 again
    cache, _ = p.escrow(cache, "b", 1)
    stage.book.cache, _ = p.materialize(cache, "b", 1)
    before = block_table(stage.book.cache, "b")
    assert got == 1 and before[0] == cached[0] and before[1] not in cached
    stage.register(Admitted(Offer("b", 8, hashes, 1, "unix:/nowhere"), 1))
    work = ChunkWork("b", 4, 8, 8, before, (), False, handoff=True)
    stage._publish(work, StageOutput(None, 0.0, {"b": (5, 1.0)}), None)
    band = stage.handoffs._jobs.receive_nowait()
    assert band.block_table == cached  # not before[1], which is free again
    assert usage(stage.book.cache).num_free == 8 - 2


@pytest.mark.parametrize("how", ["timeout", "cancel"])
def test_a_band_given_up_before_its_thread_began_settles_at_once_and_reads_nothing(
    sock_path, how
):
    """Every band thread busy (bands whose reads hang, as on a stuck GPU copy): the next
    band waits for one. Timed out or cancelled there, it settles and is released at once
    without its thread ever reading it; the planes' threads (anyio's default limiter) are
    untouched throughout."""
    from wavepp.handoff.send import BAND_THREADS

    receiver = Receiver(sock_path)
    receiver.start()
    stuck, reads = GatedBand(), []

    def bands(job: BandJob) -> list[BandTensor]:
        if job.request_id.startswith("stuck"):
            return stuck(job)
        k = torch.zeros(job.num_tokens, 1, 4)
        return [BandTensor(0, "k", "float32", (job.num_tokens, 1, 4),
                           lambda: reads.append(1) or k)]  # fmt: skip

    released: list[str] = []
    sender = HandoffSender(HandoffSettings(1, 2, FP, 30.0, 1 << 20), bands, released.append)

    async def main():
        default = anyio.to_thread.current_default_thread_limiter()
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.run)
            for i in range(BAND_THREADS):
                sender.send(job(f"stuck-{i}", f"unix:{sock_path}"))
            await _until(lambda: sender._threads.limiter.borrowed_tokens == BAND_THREADS)
            assert default.borrowed_tokens == 0
            late = job("late", f"unix:{sock_path}")
            if how == "timeout":  # its last chunk ended 29.8 s ago: 0.2 s left
                late = attrs.evolve(late, ended_at=late.ended_at - 29.8)
            sender.send(late)
            if how == "cancel":
                await anyio.sleep(0.1)
                sender.abort("late")
            await _until(lambda: "late" in released)
            assert sender.num_pending == BAND_THREADS  # the stuck ones are still on
            stuck.gate.set()
            await _until(lambda: not sender.num_pending)
            tg.cancel_scope.cancel()

    try:
        anyio.run(main)
    finally:
        stuck.gate.set()
        receiver.close()
    outcomes = {o.request_id: o for o in sender.poll()}
    assert outcomes["late"].reason == ("timeout" if how == "timeout" else "cancelled")
    assert reads == [] and released.count("late") == 1
    assert all(outcomes[f"stuck-{i}"].ok for i in range(BAND_THREADS))


def test_a_band_whose_reads_wait_on_other_ranks_never_goes_out_from_the_event_loop(sock_path):
    """A TP leader's band waits for its followers' shards in ``read()``: however small,
    it takes a worker thread, so the stage's event loop never blocks on it."""
    receiver = Receiver(sock_path)
    receiver.start()
    k = torch.ones(4, 1, 4)

    def band(job):
        return [BandTensor(0, "k", "float32", (4, 1, 4), lambda: k, waits=True)]

    sender = HandoffSender(HandoffSettings(1, 2, FP, 30.0, 1 << 20, inline_bytes=INLINE_BYTES),
                           band, lambda rid: None)  # fmt: skip
    transport = sender._transports["unix"]
    assert not transport.inline(band(None))
    plain = [BandTensor(0, "k", "float32", (4, 1, 4), lambda: k)]
    assert transport.inline(plain)  # the same band without the wait would go inline

    async def main():
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.run)
            sender.send(job("tp", f"unix:{sock_path}", n=4))
            await _until(lambda: not sender.num_pending)
            tg.cancel_scope.cancel()

    try:
        with mock.patch.object(socket_send.SocketTransport, "_on_loop",
                               side_effect=AssertionError):  # fmt: skip
            anyio.run(main)
    finally:
        receiver.close()
    (outcome,) = sender.poll()
    assert outcome.ok, outcome


def test_a_thread_band_waits_for_room_in_a_full_unix_backlog(sock_path):
    """A receiver behind on ``accept``: its listener's backlog is full, and a Unix
    connect fails at once (EAGAIN). The band tries again until there is room."""
    from tests.helpers.handoff_rig import fill_backlog

    receiver = Receiver(sock_path)  # listening, not accepting yet
    fillers = fill_backlog(sock_path)

    def later() -> None:
        time.sleep(0.3)
        for sock in fillers:
            sock.close()
        receiver.start()

    threading.Thread(target=later, daemon=True).start()
    try:
        outcomes, released = run_jobs([job("a", f"unix:{sock_path}")])
    finally:
        receiver.close()
    assert outcomes["a"].ok, outcomes["a"]
    assert released == ["a"] and [h.request_id for h, _ in receiver.bands] == ["a"]
