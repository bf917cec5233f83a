"""The heartbeat watchdog's report on its peers, against a real TCPStore; and what it
reads of a peer's process on this machine."""

import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from wavepp.transport import processes
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
        return None, None

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


@pytest.mark.parametrize("failure, lost, word", [(None, None, "done|finished"),
                                                 ("boom", None, "failed|boom"),
                                                 (None, "rank 3 died", "lost|rank 3 died")])
def test_the_last_word_says_whom_a_rank_lost(store, failure, lost, word):
    dog = Watchdog(0, 2, lambda _: None)
    dog.finish(failure, lost=lost)
    assert dog._read(0) == word


def test_a_rank_that_lost_a_peer_is_not_blamed_for_it(store):
    """Rank 1 failed because rank 2 died (a transfer to it broke): rank 0 names rank 2,
    as rank 1 found it, and passes on the same cause, not "rank 1 failed"."""
    ranks = [Watchdog(r, 3, lambda _: None, interval_s=0.05, tp=2) for r in range(3)]
    ranks[1].finish(lost="rank 2 (stage 1, TP rank 0) stopped beating 4.0 s ago")
    problem, cause = ranks[0]._check(time.monotonic())
    assert problem == ("rank 2 (stage 1, TP rank 0) stopped beating 4.0 s ago "
                       "(as rank 1 (stage 0, TP rank 1) found)")  # fmt: skip
    assert cause == "rank 2 (stage 1, TP rank 0) stopped beating 4.0 s ago"
    assert ranks[0].peer_report() == problem


def _published(child: subprocess.Popen) -> str:
    """The child's whereabouts, as it would publish them itself."""
    start = processes._stat(child.pid)[1]
    return f"{child.pid}|{start}|{processes.machine()}"


@pytest.fixture()
def child():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_what_became_of_a_process_on_this_machine(child):
    here = processes.machine()
    assert here is not None  # Linux
    published = _published(child)
    assert processes.fate(published, here) is None  # it runs
    assert processes.fate(processes.whereabouts(), here) is None  # this process
    assert processes.fate(published, "another machine") is None  # nothing known
    assert processes.fate(f"{child.pid}|1|{here}", here) == "ended"  # its pid, reused
    child.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while processes.fate(published, here) != "stopped" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes.fate(published, here) == "stopped"
    child.kill()
    child.wait()
    assert processes.fate(published, here) == "ended"


def test_a_peer_whose_process_ended_is_named_at_once(store, child):
    """A killed peer on this machine: no waiting for its heartbeat to go stale. One that
    wrote its last word before it exited is not taken for dead."""
    ranks = [Watchdog(r, 3, lambda _: None, interval_s=0.05, dead_after_s=60) for r in range(3)]
    store.set("wavepp/process/1", _published(child))
    ranks[1]._write("5|waiting for a wave from rank 0")
    ranks[2]._write("5|rounds plane: all_min")
    assert ranks[0]._check(time.monotonic()) == (None, None)
    assert ranks[0].died() == ""
    child.kill()
    child.wait()
    problem, _ = ranks[0]._check(time.monotonic())
    assert problem == "rank 1 died (its process ended; it was waiting for a wave from rank 0)"
    assert ranks[0].died() == problem
    started = time.monotonic()
    assert ranks[0].suspects(window_s=30) == problem  # certain: no window waited out
    assert time.monotonic() - started < 10  # a hang guard
    ranks[1].finish()  # its last word, written before it ended
    assert ranks[0]._check(time.monotonic()) == (None, None)


def test_a_stopped_peer_is_reported_as_stopped(store, child):
    ranks = [Watchdog(r, 2, lambda _: None, interval_s=0.05, dead_after_s=0.1) for r in range(2)]
    store.set("wavepp/process/1", _published(child))
    ranks[1]._write("5|waiting for a wave from rank 0")
    ranks[0]._check(time.monotonic())
    child.send_signal(signal.SIGSTOP)
    time.sleep(0.3)
    problem, _ = ranks[0]._check(time.monotonic())
    assert problem.startswith("rank 1 sent no heartbeat for ")
    assert problem.endswith("(its process is stopped; it was waiting for a wave from rank 0)")
