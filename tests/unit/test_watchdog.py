"""The heartbeat watchdog's report on its peers, against a real TCPStore."""

import socket
import threading
import time

import pytest
import torch.distributed as dist

from wavepp.transport.watchdog import Watchdog


@pytest.fixture()
def store(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    yield master


def test_a_peer_that_finished_is_not_reported_as_gone(store):
    """Both ranks of a run interrupted by Ctrl-C: rank 0 ends first and says so; rank 1,
    looking for a dead peer to blame before it stops, must not name rank 0 (it then
    failed the run instead of reporting the interrupt: a flaky SIGINT test under load)."""
    ranks = [Watchdog(r, 3, lambda _: None, interval_s=0.05) for r in range(3)]
    ranks[0]._write("7|waiting for a wave")
    ranks[2]._write("4|rounds plane: all_min")
    ranks[1]._check(time.monotonic())  # rank 1 sees both beat
    ranks[0].finish()  # ended its run
    time.sleep(0.2)  # past two intervals: both are quiet now
    report = ranks[1].peer_report()
    assert "rank 0" not in report
    assert "rank 2 stopped beating" in report and "rounds plane: all_min" in report
    ranks[2].finish("its model failed to load")
    assert "rank 2 failed: its model failed to load" in ranks[1].peer_report()


def test_a_peer_that_beat_since_the_last_look_is_not_reported_as_gone(store):
    """The report reads the peers afresh: a peer whose beat moved since this rank's own
    heartbeat thread last looked (that thread starved on a loaded host) is alive, however
    long ago the last look was."""
    ranks = [Watchdog(r, 2, lambda _: None, interval_s=0.05) for r in range(2)]
    ranks[1]._write("3|waiting for a wave")
    ranks[0]._check(time.monotonic())
    time.sleep(0.2)  # past two intervals since rank 0 looked
    ranks[1]._write("4|waiting for a wave")
    assert ranks[0].peer_report() == ""
    time.sleep(0.2)  # and now it has been quiet for two intervals
    assert "rank 1 stopped beating" in ranks[0].peer_report()


def test_finish_returns_once_the_heartbeat_thread_has_stopped(store):
    """A heartbeat thread still inside a store call when the interpreter shuts down
    aborts the rank as that call returns (SIGABRT, after a run that went well), so
    finish() waits for it."""
    dog = Watchdog(0, 2, lambda _: None, interval_s=0.01)
    in_check = threading.Event()

    def slow_check(started):  # a store read that takes a while
        in_check.set()
        time.sleep(0.3)

    dog._check = slow_check
    dog.start()
    assert in_check.wait(5)
    dog.finish()
    assert not dog._thread.is_alive()


@pytest.mark.parametrize("failure, word", [(None, "done|finished"), ("boom", "failed|boom")])
def test_a_beat_that_comes_after_finish_leaves_the_final_word(store, failure, word):
    """A beat already past the stop check when finish() ran must not overwrite "done" or
    "failed": peers would take a counter that never moves for a dead rank."""
    dog = Watchdog(0, 2, lambda _: None)
    dog.finish(failure)
    dog._write("7|a late beat")
    assert dog._read(0) == word
