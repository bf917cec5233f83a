"""A stage's band server (``wavepp.handoff.pull``) against a fake decoder on a plain
socket: a parked band goes to the decoder that pulls it, a pull the stage refuses leaves
the band parked, and every band ends with one outcome and one release — acknowledged,
refused, hung up on, cancelled, or its lease run out."""

from __future__ import annotations

import contextlib
import socket
import struct
from functools import partial

import anyio
import anyio.to_thread
import msgspec
import numpy as np
import pytest

from tests.helpers.puller import pull, pull_frame
from tests.helpers.sender_bands import FP, band_of, job
from wavepp.handoff import pull as pull_module
from wavepp.handoff import wire
from wavepp.handoff.base import HandoffSettings
from wavepp.handoff.pull import advertised, band_server_address
from wavepp.handoff.send import HandoffSender
from wavepp.handoff.socket_send import INLINE_BYTES


class Stage:
    """Stage 1 of 2 with a band server at ``unix:<tmp>/bs-stage1.sock``, its sender
    running in the test's event loop; ``released`` and ``outcomes`` as they come."""

    def __init__(self, tmp_path, **settings) -> None:
        options = {"timeout_s": 5.0, "budget_bytes": 1 << 20, "lease_s": 5.0,
                   "serve": f"unix:{tmp_path}/bs", **settings}  # fmt: skip
        self.settings = HandoffSettings(1, 2, FP, **options)
        self.released: list[str] = []
        self.outcomes: dict[str, object] = {}
        self.sender = HandoffSender(self.settings, band_of, self.released.append)
        self.address = self.sender.address

    async def pull(self, rid: str, **options):
        return await anyio.to_thread.run_sync(
            partial(pull, self.address, rid, options.pop("stage", 1),
                    options.pop("fingerprint", FP), **options))  # fmt: skip

    async def settle(self, *rids: str) -> None:
        with anyio.fail_after(30):  # hang guard
            while not set(rids) <= set(self.outcomes):
                self.outcomes.update({o.request_id: o for o in await self.sender.settled()})


@contextlib.asynccontextmanager
async def running(tmp_path, **settings):
    stage = Stage(tmp_path, **settings)
    async with anyio.create_task_group() as tg:
        tg.start_soon(stage.sender.run)
        yield stage
        tg.cancel_scope.cancel()


def run(test):
    anyio.run(test)


@pytest.mark.parametrize("inline", [False, True])
def test_a_parked_band_goes_to_the_decoder_that_pulls_it(tmp_path, inline):
    async def main():
        async with running(tmp_path, inline_bytes=INLINE_BYTES if inline else 0) as stage:
            assert stage.address == f"unix:{tmp_path}/bs-stage1.sock"
            stage.sender.send(job("a", wire.PULL_TARGET, n=7))
            got = await stage.pull("a")
            await stage.settle("a")
            assert got.refusal is None
            header = got.header
            assert (header.request_id, header.stage, header.num_stages) == ("a", 1, 2)
            assert header.fingerprint == FP and header.num_tokens == 7
            tensors = np.frombuffer(got.payload, dtype=np.float32).reshape(4, 7, 4)
            assert tensors[3, 0, 0] == 1001 and tensors[2, 6, 3] == 1000 + 27
            outcome = stage.outcomes["a"]
            assert outcome.ok and outcome.num_bytes == len(got.payload) == 4 * 7 * 4 * 4
            assert stage.released == ["a"]
            assert stage.sender.figures() == {"pull_parked": 0, "pulls_accepted": 1,
                                              "pulls_refused": 0}  # fmt: skip
            again = await stage.pull("a")  # held no more: refused at once
            assert "unknown or expired request 'a'" in again.refusal.error

    run(main)


def test_a_pull_that_comes_before_the_band_is_parked_waits_for_it(tmp_path):
    async def main():
        async with running(tmp_path) as stage, anyio.create_task_group() as tg:
            got = []

            async def decoder():
                got.append(await stage.pull("early"))

            tg.start_soon(decoder)
            await anyio.sleep(0.3)
            stage.sender.send(job("early", wire.PULL_TARGET))
            await stage.settle("early")
        assert got[0].header.request_id == "early" and stage.outcomes["early"].ok

    run(main)


def test_refused_pulls_name_why_and_leave_the_band_parked(tmp_path, monkeypatch):
    monkeypatch.setattr(pull_module, "REGISTER_WAIT_S", 0.2)
    other = msgspec.structs.replace(FP, num_kv_heads=8)

    async def main():
        async with running(tmp_path) as stage:
            stage.sender.send(job("a", wire.PULL_TARGET))
            refusals = [
                (await stage.pull("a", stage=0)).refusal,
                (await stage.pull("a", fingerprint=other)).refusal,
                (await stage.pull("nobody")).refusal,
                (await stage.pull("a", frame=b"WPHB" + bytes(8))).refusal,
                (await stage.pull("a", frame=struct.pack("<4sHHI", b"WPHP", 1, 0, 1 << 20))
                 ).refusal,
                (await stage.pull("a", frame=struct.pack("<4sHHI", b"WPHP", 1, 0, 2) + b"{}")
                 ).refusal,
            ]  # fmt: skip
            errors = [r.error for r in refusals]
            assert all(not r.ok for r in refusals)
            assert "stage 1's, not stage 0's" in errors[0]
            assert errors[1] == "fingerprint num_kv_heads: the decoder has 8, WavePP has 1"
            assert "unknown or expired request 'nobody'" in errors[2]
            assert "bad pull magic" in errors[3]
            assert "pull_len 1048576 outside" in errors[4]
            assert "pull does not decode" in errors[5]
            assert (refusals[1].request_id, refusals[1].stage) == ("a", 1)
            assert stage.released == [] and stage.sender.figures()["pull_parked"] == 1
            got = await stage.pull("a")  # still held: the right pull gets it
            await stage.settle("a")
            assert got.header is not None and stage.outcomes["a"].ok
            assert stage.sender.figures()["pulls_refused"] == 6

    run(main)


def test_a_lease_that_runs_out_releases_the_band_and_later_pulls_are_refused(tmp_path):
    async def main():
        async with running(tmp_path, lease_s=0.3) as stage:
            stage.sender.send(job("a", wire.PULL_TARGET))
            await stage.settle("a")
            outcome = stage.outcomes["a"]
            assert (outcome.ok, outcome.reason) == (False, "expired")
            assert "lease of 0.3 s" in outcome.detail and stage.released == ["a"]
            late = await stage.pull("a")
            assert "unknown or expired request 'a'" in late.refusal.error

    run(main)


def test_a_pull_under_way_is_not_cut_by_the_lease(tmp_path):
    async def main():
        async with running(tmp_path, lease_s=0.4) as stage:
            stage.sender.send(job("a", wire.PULL_TARGET))
            got = await stage.pull("a", hold_s=1.0)  # reads the band after the lease
            await stage.settle("a")
            assert got.header is not None and stage.outcomes["a"].ok

    run(main)


@pytest.mark.parametrize(("ack", "reason"), [("refuse", "refused"), ("hang-up", "disconnected"),
                                             ("none", "disconnected")])
def test_a_decoder_that_gives_up_mid_pull_settles_the_band_failed(tmp_path, ack, reason):
    async def main():
        async with running(tmp_path) as stage:
            stage.sender.send(job("a", wire.PULL_TARGET, n=4000))  # past the socket buffer
            await stage.pull("a", ack=ack)
            await stage.settle("a")
            outcome = stage.outcomes["a"]
            assert (outcome.ok, outcome.reason) == (False, reason), outcome
            assert stage.released == ["a"]

    run(main)


def test_a_silent_decoder_costs_the_timeout_from_its_pull(tmp_path):
    async def main():
        async with running(tmp_path, timeout_s=0.5, lease_s=30.0) as stage:
            stage.sender.send(job("a", wire.PULL_TARGET))
            sock = socket.socket(socket.AF_UNIX)
            sock.connect(stage.address.removeprefix("unix:"))
            sock.sendall(pull_frame("a", 1, FP))  # then reads nothing, acks nothing
            with sock:
                await stage.settle("a")
            assert stage.outcomes["a"].reason == "timeout"

    run(main)


def test_a_cancel_releases_a_parked_band_and_one_being_pulled(tmp_path):
    async def main():
        async with running(tmp_path) as stage, anyio.create_task_group() as tg:
            stage.sender.send(job("parked", wire.PULL_TARGET))
            stage.sender.send(job("pulled", wire.PULL_TARGET, n=4000))

            async def decoder():
                with contextlib.suppress(OSError, EOFError):  # the stage hangs up on it
                    await stage.pull("pulled", hold_s=2.0)

            tg.start_soon(decoder)
            await anyio.sleep(0.5)
            stage.sender.abort("parked")
            stage.sender.abort("pulled")
            await stage.settle("parked", "pulled")
        assert {r: o.reason for r, o in stage.outcomes.items()} == {"parked": "cancelled",
                                                                   "pulled": "cancelled"}
        assert sorted(stage.released) == ["parked", "pulled"]

    run(main)


def test_a_second_pull_of_a_band_being_pulled_is_refused(tmp_path):
    async def main():
        async with running(tmp_path) as stage, anyio.create_task_group() as tg:
            stage.sender.send(job("a", wire.PULL_TARGET, n=4000))
            first = []

            async def slow():
                first.append(await stage.pull("a", hold_s=1.0))

            tg.start_soon(slow)
            await anyio.sleep(0.4)
            second = await stage.pull("a")
            assert "already being pulled" in second.refusal.error
            await stage.settle("a")
        assert first[0].header is not None and stage.outcomes["a"].ok

    run(main)


def test_parked_bands_hold_no_budget_until_pulled(tmp_path):
    async def main():
        async with running(tmp_path, budget_bytes=64) as stage:
            for rid in ("a", "b", "c"):
                stage.sender.send(job(rid, wire.PULL_TARGET))
            with anyio.fail_after(10):
                while stage.sender.figures()["pull_parked"] < 3:
                    await anyio.sleep(0.01)
            assert stage.sender._in_use == 0
            for rid in ("c", "a", "b"):  # any order: none waits for another's budget
                assert (await stage.pull(rid)).header is not None
            await stage.settle("a", "b", "c")
        assert all(o.ok for o in stage.outcomes.values())

    run(main)


def test_band_server_addresses_per_stage(tmp_path):
    assert str(band_server_address("unix:/run/w/h", 2)) == "unix:/run/w/h-stage2.sock"
    assert str(band_server_address("tcp://10.0.0.5:7300", 2)) == "tcp://10.0.0.5:7302"
    assert str(band_server_address("tcp://0.0.0.0:0", 3)) == "tcp://0.0.0.0:0"
    assert str(band_server_address("auto", 1, tmp_path)) == f"unix:{tmp_path}/h-stage1.sock"
    with pytest.raises(ValueError, match="above 65535"):
        band_server_address("tcp://h:65535", 1)
    with pytest.raises(ValueError, match="dir:"):
        band_server_address("dir:/x", 0)
    wild = wire.Address("tcp", host="0.0.0.0", port=7300)
    assert advertised(wild, "10.0.0.5") == "tcp://10.0.0.5:7300"
    with pytest.raises(ValueError, match="--handoff-advertise"):
        advertised(wild, None)


def test_a_tcp_band_server_and_a_private_directory_are_cleaned_up(tmp_path):
    async def main():
        async with running(tmp_path, serve="tcp://127.0.0.1:0") as stage:
            assert stage.address.startswith("tcp://127.0.0.1:")
            stage.sender.send(job("a", wire.PULL_TARGET))
            assert (await stage.pull("a")).header is not None
        async with running(tmp_path, serve="auto") as stage:
            path = stage.address.removeprefix("unix:")
            assert path.endswith("/h-stage1.sock")
        return path

    path = anyio.run(main)
    assert not __import__("os").path.exists(path.rpartition("/")[0])


def test_a_stage_without_a_band_server_refuses_pull_targets(tmp_path):
    async def main():
        async with running(tmp_path, serve=None) as stage:
            assert stage.address is None
            stage.sender.send(job("a", wire.PULL_TARGET))
            await stage.settle("a")
        outcome = stage.outcomes["a"]
        assert (outcome.reason, "no transport for pull") == ("error", "no transport for pull")
        assert "no transport for pull" in outcome.detail

    run(main)
