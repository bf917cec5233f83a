"""The server's decoder under faults, at P = 2 with ``--decode auto`` (tiny-kimi), in
order on one server: a client that leaves a completion stops its decode at the worker
(streamed or not); a killed decode worker makes ``/health`` degraded (a JSON 503 with the
reason) and completions a JSON 503 until the server has restarted it (the log and
``/metrics`` say so); SIGTERM with completions decoding waits for them, then answers the
non-streamed one a JSON 503 and ends the stream with an error event and ``[DONE]``, with
no traceback in the log and exit 0."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time

import httpx
import numpy as np
import pytest

from tests.helpers.serve import start_server
from wavepp.serve.prom import parse_exposition, sample

pytestmark = pytest.mark.slow

# prompts tiny-kimi (seed 0) continues greedily for over 1,200 tokens without its
# end-of-sequence token: their decodes of 4096 tokens outlast every step below
LONG = [np.random.default_rng(seed).integers(3, 512, 40).tolist() for seed in (1, 2, 3)]
HANG_GUARD_S = 120
WORKER = re.compile(r"decode worker (?:restarted \(restart \d+\): )?listening on \S+ \(pid (\d+)\)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("decode-faults")
    proc, url, _ = start_server(tmp, ["--model", "tiny-kimi", "--seed", "0", "--decode", "auto",
                                      "--drain-timeout-s", "2"])  # fmt: skip
    try:
        yield proc, url, tmp / "server.err"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def until(what, seconds: float = HANG_GUARD_S, every: float = 0.2):
    """``what()`` once it is truthy (polled; a hang guard, not a bound on the time)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"still not so after {seconds} s: {what}")


def metric(url: str, name: str) -> float | None:
    return sample(parse_exposition(httpx.get(f"{url}/metrics", timeout=30).text), name)


def raw_request(url: str, body: dict) -> socket.socket:
    """A POST sent on a raw socket, its answer not read (the client may just leave)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))  # fmt: skip
    return sock


def test_a_client_that_leaves_stops_its_decode(server):
    proc, url, err = server
    for i, stream in enumerate((False, True)):
        sock = raw_request(url, {"prompt": LONG[i], "max_tokens": 4096, "stream": stream})
        until(lambda: metric(url, "wavepp_decodes_in_flight") == 1)
        if stream:
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")  # the first events came
        sock.close()  # the client leaves (it timed out, say)
        until(lambda: metric(url, "wavepp_decodes_in_flight") == 0)
        stopped = re.compile(r"the client went away after (\d+) of 4096 tokens: stopped")
        found = until(lambda: stopped.findall(err.read_text())[i:])  # noqa: B023
        assert int(found[0]) < 4096
    # the worker serves on
    answer = httpx.post(f"{url}/v1/completions", json={"prompt": LONG[0][:20], "max_tokens": 4},
                        timeout=60)  # fmt: skip
    assert answer.status_code == 200 and len(answer.json()["choices"][0]["token_ids"]) == 4
    assert proc.poll() is None


def test_a_killed_decode_worker_is_restarted_and_health_says_so_meanwhile(server):
    proc, url, err = server
    with httpx.Client(timeout=60) as client:
        assert client.get(f"{url}/health").json() == {"status": "ok"}
        pid = int(WORKER.findall(err.read_text())[-1])
        os.kill(pid, signal.SIGKILL)
        health = until(lambda: (h := client.get(f"{url}/health")).status_code == 503 and h)
        assert health.json()["status"] == "degraded", health.json()
        assert "the decode worker exited (killed by SIGKILL)" in health.json()["error"]
        assert health.headers["retry-after"]
        refused = client.post(f"{url}/v1/completions", json={"prompt": LONG[0], "max_tokens": 8})
        if client.get(f"{url}/health").status_code == 503:  # not yet restarted meanwhile
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["type"] == "unavailable"
            assert "the decode worker exited" in refused.json()["error"]["message"]
        until(lambda: client.get(f"{url}/health").status_code == 200)
        assert metric(url, "wavepp_decoder_restarts_total") == 1
        assert metric(url, "wavepp_decoder_up") == 1
        answer = client.post(f"{url}/v1/completions", json={"prompt": LONG[1], "max_tokens": 8})
        assert answer.status_code == 200 and len(answer.json()["choices"][0]["token_ids"]) == 8
    text = err.read_text()
    assert "restarting it in 1 s (restart 1)" in text
    assert re.search(r"decode worker restarted \(restart 1\): listening on", text)
    assert int(WORKER.findall(text)[-1]) != pid and proc.poll() is None


def test_sigterm_waits_for_decoding_completions_then_answers_them_503(server):
    proc, url, err = server
    answers: dict[str, object] = {}

    def whole() -> None:
        with httpx.Client(timeout=HANG_GUARD_S) as client:
            answers["whole"] = client.post(
                f"{url}/v1/completions", json={"prompt": LONG[1], "max_tokens": 4096}
            )

    def streamed() -> None:
        with (
            httpx.Client(timeout=HANG_GUARD_S) as client,
            client.stream(
                "POST",
                f"{url}/v1/completions",
                json={"prompt": LONG[2], "max_tokens": 4096, "stream": True},
            ) as response,
        ):
            assert response.status_code == 200
            answers["events"] = [line[6:] for line in response.iter_lines()
                                 if line.startswith("data: ")]  # fmt: skip

    threads = [threading.Thread(target=f) for f in (whole, streamed)]
    for thread in threads:
        thread.start()
    until(lambda: metric(url, "wavepp_decodes_in_flight") == 2)
    proc.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(HANG_GUARD_S)
    code = proc.wait(HANG_GUARD_S)
    text = err.read_text()
    assert code == 0, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert "2 in flight (2 decoding)" in text
    assert "drain timeout: cancelled 0 requests and 2 completions still in flight" in text
    whole_answer = answers["whole"]
    assert whole_answer.status_code == 503, whole_answer.text
    error = whole_answer.json()["error"]
    assert error["type"] == "unavailable" and "drain timeout" in error["message"]
    events = answers["events"]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["error"]["type"] == "unavailable" and "drain timeout" in last["error"]["message"]
    assert len(events) > 3  # tokens came before the drain's end
