"""Chaos with careless and hostile clients (issue 57), bounded in time and count, on
loopback: the server at P = 2 (tiny-kimi) with its own decode worker and a shared secret,
driven by good clients (completions, streamed and not, and prefills), clients that
abandon long completions, hostile ones (broken, deeply nested, oversized bodies,
addresses they may not name, unsigned bands and trickled headers at the decode worker's
socket) and trickling ones, while the decode worker is killed and then a rank.

Every good request gets exactly one well-formed answer: its tokens, or the API's JSON
error (a stream: a final error event, then ``[DONE]``) while the worker restarts; every
hostile one its 4xx; the worker is restarted and completions decode again; once the
clients stop, nothing is in flight and every stage holds nothing (the leak check, live);
rank 0's memory stays bounded; a killed rank is named to every caller in JSON, and
nothing reaches the log as a traceback.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers.handoff_peers import band, read_ack, split
from tests.helpers.run import OUR_FRAME, alive
from tests.helpers.serve import start_server
from wavepp.serve.prom import parse_exposition, sample

pytestmark = pytest.mark.slow

HANG_GUARD_S = 120.0
PROMPT = list(range(3, 43))  # 40 tokens: tiny-kimi's vocabulary holds them


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _until(what, guard_s: float = HANG_GUARD_S, every: float = 0.3):
    deadline = time.monotonic() + guard_s  # a hang guard
    while True:
        got = what()
        if got:
            return got
        assert time.monotonic() < deadline, "never happened"
        time.sleep(every)


def _worker_pid(socket_path: str) -> int | None:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"wavepp.decode" in cmd and f"unix:{socket_path}".encode() in cmd:
                return int(entry.name)
    return None


def _answer(client: httpx.Client, url: str, n: int) -> tuple:
    """One good request: (kind, status, what came) — a whole answer's JSON, or a
    stream's events."""
    if n % 3 == 2:
        reply = client.post(f"{url}/v1/prefill", json={"tokens": PROMPT[: 20 + n % 7]})
        return "prefill", reply.status_code, reply.json()
    body = {"prompt": PROMPT[: 30 + n % 9], "max_tokens": 4}
    if n % 3 == 0:
        reply = client.post(f"{url}/v1/completions", json=body)
        return "whole", reply.status_code, reply.json()
    with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as reply:
        if not reply.headers.get("content-type", "").startswith("text/event-stream"):
            reply.read()
            return "stream", reply.status_code, reply.json()
        events = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
        return "stream", reply.status_code, events


def _well_formed(kind: str, status: int | None, got) -> bool:
    """A good request's one answer: done, or the API's JSON error while the decoder
    restarts (503) or its stream broke (an error event, then [DONE])."""
    if status is None:
        return False
    if isinstance(got, dict) and status != 200:
        return status in (502, 503) and set(got["error"]) >= {"message", "type", "code"}
    if kind == "prefill":
        return status == 200 and got["status"] == "done"
    if kind == "whole":
        return status == 200 and len(got["choices"][0]["token_ids"]) == 4
    if status != 200 or not got or got[-1] != "[DONE]":
        return False
    chunks = [json.loads(e) for e in got[:-1]]
    tokens = [t for c in chunks if "choices" in c for t in c["choices"][0].get("token_ids", [])]
    return len(tokens) == 4 or "error" in chunks[-1]


def _abandon(port: int, n: int) -> None:
    """A client that asks for a long completion and leaves."""
    stream = "true" if n % 2 else "false"
    body = f'{{"prompt": {PROMPT[:30]}, "max_tokens": 300, "stream": {stream}}}'.encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: " + str(len(body)).encode()
                     + b"\r\n\r\n" + body)  # fmt: skip
        if n % 2:
            sock.recv(64)  # the stream's first bytes
        time.sleep(0.3)


HOSTILE = [
    (b"{not json", 400),
    (b"[" * 30_000 + b"]" * 30_000, 400),
    (b'{"tokens": [' + b"[" * 30_000 + b"]" * 30_000 + b"]}", 400),
    (json.dumps({"tokens": PROMPT, "handoff": "tcp://127.0.0.1:9"}).encode(), 403),
    (json.dumps({"tokens": PROMPT, "handoff": "unix:/tmp/someone-else.sock"}).encode(), 403),
    (json.dumps({"tokens": [-1, 5]}).encode(), 400),
    (b"x" * 100_000, 413),
]


def _trickle(port: int, what: bytes, every_s: float, most_s: float) -> bytes:
    """Send ``what`` a byte at a time until the server answers or closes."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=every_s) as sock:
        for byte in what:
            if time.monotonic() - started > most_s:
                return b""
            try:
                sock.send(bytes([byte]))
                if sock.recv(256, socket.MSG_PEEK):
                    return sock.recv(4096)
                return b"closed"
            except TimeoutError:
                continue
            except OSError:
                return b"closed"
    return b""


def test_a_server_under_careless_and_hostile_clients_keeps_every_promise(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("a shared secret of 32 bytes.....\n")
    proc, url, rank0 = start_server(tmp_path, [
        "--model", "tiny-kimi", "--seed", "0", "--capacity-blocks", "1024",
        "--decode", "auto", "--handoff-secret", str(secret),
        "--header-timeout-s", "2", "--body-timeout-s", "3", "--drain-timeout-s", "20",
    ])  # fmt: skip
    port = int(url.rsplit(":", 1)[1])
    err_path = tmp_path / "server.err"
    socket_path = re.search(r"--listen unix:(\S+)", err_path.read_text()).group(1)
    answers: list[tuple] = []
    hostile: list[tuple[int, int]] = []
    stop = threading.Event()

    def good(worker: int) -> None:
        with httpx.Client(timeout=HANG_GUARD_S) as client:
            n = worker
            while not stop.is_set() and n < 60:
                try:
                    answers.append(_answer(client, url, n))
                except httpx.HTTPError as error:  # no answer (the test checks when)
                    answers.append(("none", None, type(error).__name__))
                    return
                if answers[-1][1] == 503 and "cannot answer" in json.dumps(answers[-1][2]):
                    return  # the server is going away: a client stops there
                n += 2

    def careless() -> None:
        for n in range(8):
            if stop.is_set():
                return
            _abandon(port, n)

    def hostile_http() -> None:
        with httpx.Client(timeout=HANG_GUARD_S) as client:
            for body, want in HOSTILE * 2:
                reply = client.post(f"{url}/v1/prefill", content=body,
                                    headers={"content-type": "application/json"})  # fmt: skip
                assert reply.headers["content-type"].startswith("application/json")
                hostile.append((reply.status_code, want))

    trickled: list[bytes] = []

    def trickling() -> None:
        head = b"POST /v1/prefill HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\n\r\n"
        trickled.append(_trickle(port, head, 0.5, 20))  # the headers: cut at 2 s
        trickled.append(_trickle(port, head + b'{"tokens": [1, 2, 3' + b" " * 30, 0.3, 20))

    at_worker: list = []

    def hostile_peer() -> None:
        """At the decode worker's own socket: an unsigned band, and a trickled header."""
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(30)
            sock.connect(socket_path)
            sock.sendall(band("forged", 0, 1))
            at_worker.append(read_ack(sock))
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(30)
            sock.connect(socket_path)
            head, _ = split(band("slow", 0, 1))
            started = time.monotonic()
            for byte in head[:20]:
                try:
                    sock.send(bytes([byte]))
                except OSError:
                    break
                time.sleep(1.0)
            at_worker.append(time.monotonic() - started)

    try:
        with httpx.Client(timeout=HANG_GUARD_S) as client:
            assert _answer(client, url, 0)[1] == 200  # warm: the worker answers
        rss_before = _rss_mib(rank0)
        threads = [threading.Thread(target=f, args=a) for f, a in
                   [(good, (0,)), (good, (1,)), (careless, ()), (hostile_http, ()),
                    (trickling, ()), (hostile_peer, ())]]  # fmt: skip
        for thread in threads:
            thread.start()
        _until(lambda: len(answers) >= 8)
        worker = _worker_pid(socket_path)
        os.kill(worker, signal.SIGKILL)  # the decode worker dies mid-load
        _until(lambda: (_worker_pid(socket_path) or worker) != worker)  # restarted
        _until(lambda: httpx.get(f"{url}/health", timeout=10).status_code == 200)
        time.sleep(3)
        stop.set()
        for thread in threads:
            thread.join(HANG_GUARD_S)
            assert not thread.is_alive()
        with httpx.Client(timeout=HANG_GUARD_S) as client:  # decoding again, all of them
            after = [_answer(client, url, n) for n in range(6)]
        assert all(a[1] == 200 and _well_formed(*a) for a in after), after

        def quiet():
            m = parse_exposition(httpx.get(f"{url}/metrics", timeout=10).text)
            held = [sample(m, "wavepp_engine_stages_balanced", stage=s) for s in ("0", "1")]
            return (sample(m, "wavepp_decodes_in_flight") == 0
                    and sample(m, "wavepp_http_in_flight") == 0 and held == [1.0, 1.0]
                    and m)  # fmt: skip

        metrics = _until(quiet)
        assert sample(metrics, "wavepp_decoder_restarts_total") >= 1
        rss_after = _rss_mib(rank0)

        # a rank dies with completions in flight: each is answered once, in JSON
        stop.clear()
        callers = [threading.Thread(target=good, args=(i,)) for i in range(2)]
        for thread in callers:
            thread.start()
        time.sleep(1.0)
        count_before = len(answers)
        os.kill(_rank1(rank0), signal.SIGKILL)
        code = proc.wait(HANG_GUARD_S)
        stop.set()
        for thread in callers:
            thread.join(HANG_GUARD_S)
        late = answers[count_before:]
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
    text = err_path.read_text()
    # torchrun prints its own ChildFailedError for the killed rank; nothing of WavePP's
    assert not OUR_FRAME.search(text), text[-3000:]
    assert "Exception in ASGI" not in text
    bad = [a for a in answers[:count_before] if not _well_formed(*a)]
    assert not bad and count_before >= 16, bad[:3]
    assert [status for status, _ in hostile] == [want for _, want in hostile], hostile
    assert all(t in (b"", b"closed") or t.startswith(b"HTTP/1.1 408") for t in trickled)
    assert at_worker[0] is not None and not at_worker[0].ok
    assert at_worker[0].error.startswith("unsigned band refused"), at_worker[0]
    assert at_worker[1] < 15  # the header deadline (10 s) cut the trickle
    assert rss_after - rss_before < 300, (rss_before, rss_after)
    assert code != 0 and not alive(rank0)
    for kind, status, got in late:  # done before the death, or told which rank died
        if status is None:  # only a connection the dead server never took
            assert got == "ConnectError", (kind, got)
        elif status != 200:
            assert status == 503 and "rank 1" in json.dumps(got), (kind, status, got)


def _rank1(rank0: int) -> int:
    """The other serving rank: torchrun's child that is not rank 0."""
    torchrun = int(Path(f"/proc/{rank0}/stat").read_text().rsplit(")", 1)[1].split()[1])
    children = Path(f"/proc/{torchrun}/task/{torchrun}/children").read_text().split()
    return next(int(pid) for pid in children if int(pid) != rank0)
