"""``python -m benchmarks.handoff``: what handing caches on costs (``docs/handoff.md``).

Three measurements, each a ratio or a time from this invocation's own runs:

- **bandwidth**: the server (``wavepp.serve.launch``, ``--stages`` stages, one request at
  a time) prefills fresh prompts of each length (default 4,096 and 32,768 tokens) and
  hands each to ``wavepp.handoff``'s ``Receiver`` in a process of its own (checking every
  band; a band sent from a stage's worker thread is written into a segment the receiver
  lends). Every sample also hands a fresh prompt to a second receiver that declines
  segments: the same stages' bands **over the socket** (after the offer and its refusal,
  one round trip), read into its recycled buffers: the transports compared in one run.
  Each stage's band bytes over its **wire time** — the stage's sender thread, from
  connect to the acknowledgement received (``wire_s`` in the record; ``seconds``, from
  the last chunk on that stage to the acknowledgement handled, adds the queueing and
  setup) — against a **plain copy**
  timed the same way: this process connects to a receiver process of its own (with the
  send buffer the stage's sender asks for, ``SOCKET_BUFFER``: the copy ran ~10% faster
  with it than with the kernel's default), writes the
  same number of bytes from memory it holds (``sendall`` of one buffer) and stops the
  clock at the receiver's 1-byte answer, sent once it holds every byte in a buffer it
  keeps from copy to copy (as the library's receiver recycles band buffers: neither
  pays for fresh pages; a fresh ``bytearray`` per copy came from the heap at 8 MiB but
  from new pages at 64 MiB, a baseline that changed with the size).
  A third row, **plain sender into the library receiver**, sends bands of the same
  layers from this process (blocking ``sendall`` per tensor, the same send buffer) into
  the same ``Receiver``:
  its gap to the plain copy is the receiver's cost. A fourth, **the stage's sender
  alone**, sends the same bands with a stage's own ``HandoffSender`` (the rows as views,
  here one a tensor where a stage has one a run of blocks; a large band from a worker
  thread) from this process, with no pipeline running, into each receiver: its gap to
  the handoff is what sending from inside the running pipeline costs. Both plain
  rows are also timed **beside a busy core**: a helper process
  computing on one thread (torch matmuls), resumed 50 ms before the sample and stopped
  after it — the machine as stage 0's sender finds it at P = 2, its band leaving while
  stage 1 computes the prompt's last chunk. The eight (``SAMPLE_KINDS``) are
  interleaved, one of each per sample, in turn; every figure is the median over
  ``--samples`` with its min–max, and the idle plain copy's median per length is the
  denominator of every ratio;
- **latency**: from the request's last chunk (on the last stage) to the receiver
  holding every band (the last stage's ``ended_at`` to the latest ``ended_at +
  seconds``);
- **throughput**: the default job (``wavepp.main`` with no options but ``--json``)
  with every request handing its cache to the receiver process (``--handoff-all``)
  against the same job without, ``--repeats`` alternating pairs: the median of the
  pairs' ratios, and the mean throughput on over the mean off with its 95% interval (a
  paired bootstrap: ``benchmarks._stats.ratio_of_means_interval``). Each run's CPU
  steal (``cpu_steal_share`` in its record: the share of the machine's CPU time the
  hypervisor gave other guests while it measured) is printed and recorded, and the same
  figures are given again over the **quiet pairs**, those where neither run lost more
  than ``QUIET_STEAL`` to it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import numpy as np

from benchmarks._stats import emit, ratio_of_means_interval

RECEIVER = """
import json, sys, anyio
from wavepp.handoff.receive import Receiver

async def main():
    rx = Receiver(json.loads(sys.argv[2]), "float32", on_complete=lambda handoff: None)
    async with anyio.create_task_group() as tg:
        await tg.start(rx.serve, sys.argv[1])
        print("ready", flush=True)

anyio.run(main)
"""

COPY_RECEIVER = """
import socket, struct, sys
listener = socket.socket(socket.AF_UNIX)
listener.bind(sys.argv[1])
listener.listen(8)
print("ready", flush=True)
buffer = bytearray()
while True:
    conn, _ = listener.accept()
    with conn:
        head = conn.recv(8, socket.MSG_WAITALL)
        (size,) = struct.unpack("<Q", head)
        if len(buffer) < size:  # kept from copy to copy, as the library's band buffers
            buffer = bytearray(size)
        view, got = memoryview(buffer)[:size], 0
        while got < size:
            n = conn.recv_into(view[got:])
            if not n:
                raise SystemExit("the sender hung up")
            got += n
        conn.sendall(b"k")
        del view
"""

BUSY = """
import sys, torch
torch.set_num_threads(1)
a = torch.randn(512, 512)
print("ready", flush=True)
while True:
    a = torch.tanh(a @ a)
"""

BLOCK = 16  # the server's block size (tokens)
# A pair counts as quiet when neither run lost more than this share of the machine's CPU
# to other guests (its record's cpu_steal_share). Steal falls on one run of a pair more
# than the other and moves that pair's ratio either way (docs/benchmarks.md); the quiet
# pairs are the comparison without it.
QUIET_STEAL = 0.02
LISTENING = re.compile(r"listening on (http://\S+) \(pid")


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


@contextmanager
def _child(script: str, *args: str):
    """A helper process that prints ``ready`` once it listens."""
    proc = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        if proc.stdout.readline().strip() != "ready":
            raise SystemExit(f"a helper process did not start ({' '.join(args)[:200]})")
        yield proc
    finally:
        proc.kill()
        proc.wait(30)


@contextmanager
def _busy(proc: subprocess.Popen):
    """The BUSY helper computing for the duration (stopped again after)."""
    proc.send_signal(signal.SIGCONT)
    try:
        time.sleep(0.05)  # running, as a stage's compute thread is, when the sample starts
        yield
    finally:
        proc.send_signal(signal.SIGSTOP)


@contextmanager
def _server(args, tmp: Path):
    """The server for the bandwidth runs; yields its URL."""
    blocks = -(-max(args.lengths) // BLOCK) + 16  # the longest prompt, and some
    cmd = [sys.executable, "-m", "wavepp.serve.launch", "--nproc-per-node", str(args.stages),
           "--host", "127.0.0.1", "--port", "0", "--model", args.model, "--budget",
           str(args.budget), "--concurrency", "1", "--block-size", str(BLOCK),
           "--capacity-blocks", str(blocks)]  # fmt: skip
    log = tmp / "server.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 300
        while not (match := LISTENING.search(log.read_text())):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield match.group(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()


def _torchrun(stages: int, args: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={stages}", "-m", "wavepp.main", "--no-progress", *args]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def _sender_socket() -> socket.socket:
    """A Unix socket with the send buffer a stage's band sender asks for."""
    from wavepp.handoff.socket_send import SOCKET_BUFFER

    sock = socket.socket(socket.AF_UNIX)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    return sock


def plain_copy_s(path: Path, data: bytearray) -> float:
    """Connect to the copy receiver, write ``data``, wait for its answer: seconds."""
    with _sender_socket() as sock:
        start = time.perf_counter()
        sock.connect(str(path))
        sock.sendall(struct.pack("<Q", len(data)))
        sock.sendall(data)
        if sock.recv(1) != b"k":
            raise SystemExit("the copy receiver hung up")
        return time.perf_counter() - start


class LibraryBands:
    """Bands of a prompt length, from this process into the library receiver: stage s of
    ``stages`` holding an even split of the layers (stage 0 the token ids)."""

    def __init__(self, config: dict, stages: int, length: int, portal=None) -> None:
        """``portal``: an ``anyio`` blocking portal, the event loop :meth:`stage_sender_s`
        runs the stage senders on."""
        import torch

        from wavepp.handoff import wire

        fp = wire.fingerprint_from_hf_config(config, "float32")
        self.stages, self.length = stages, length
        self._portal = portal
        self._senders: dict = {}
        self._tasks: list = []
        self._fp = fp
        self._tensors = []
        bounds = np.linspace(0, fp.num_layers, stages + 1).round().astype(int)
        for stage in range(stages):
            tensors = {(-1, "tokens"): torch.zeros(length, dtype=torch.int32)} if stage == 0 else {}
            for layer in range(bounds[stage], bounds[stage + 1]):
                for name, (_, shape) in wire.expected_tensors(config, "float32", layer,
                                                               length).items():  # fmt: skip
                    tensors[(layer, name)] = torch.ones(shape)  # touched pages
            self._tensors.append(tensors)

    def send_s(self, path: Path, request_id: str, stage: int) -> tuple[int, float]:
        """(payload bytes, seconds from connect to the acknowledgement)."""
        import torch

        from wavepp.handoff import wire
        from wavepp.handoff.client import build_band

        last = stage == self.stages - 1
        header, payload = build_band(request_id, stage, self.stages, self._fp,
                                     self._tensors[stage], self.length,
                                     0 if last else -1)  # fmt: skip
        prefix = wire.encode_band_prefix(header)
        with _sender_socket() as sock:
            start = time.perf_counter()
            sock.connect(str(path))
            sock.sendall(prefix)
            for tensor in payload:
                sock.sendall(tensor.reshape(-1).view(torch.uint8).numpy())
            length = wire.ack_length(sock.recv(wire.ACK_PREFIX_BYTES, socket.MSG_WAITALL))
            ack = wire.decode_ack(sock.recv(length, socket.MSG_WAITALL))
            seconds = time.perf_counter() - start
        if not ack.ok:
            raise SystemExit(f"the library receiver refused a plain band: {ack.error}")
        return wire.band_bytes(header), seconds

    def stage_sender_s(self, path: Path, request_id: str, stage: int) -> tuple[int, float]:
        """The same band sent by a stage's own sender (``HandoffSender``, as a CPU stage
        runs it: the pool's rows as views, one run a tensor here, a large band from a
        worker thread) into the same receiver, with no pipeline beside it: (payload
        bytes, its ``wire_s``). The senders run on the portal's event loop (in a thread
        of this process; :meth:`close` stops them), their worker threads kept from band
        to band as a stage's are."""
        sender = self._senders.get(stage)
        if sender is None:
            sender = self._senders[stage] = self._stage_sender(stage)
            self._tasks.append(self._portal.start_task_soon(sender.run))
        from wavepp.handoff.base import BandJob

        last = stage == self.stages - 1
        job = BandJob(request_id, f"unix:{path}", self.length, (), {}, None,
                      first_token=0 if last else -1)  # fmt: skip

        async def one() -> list:
            sender.send(job)
            return await sender.settled()

        (outcome,) = self._portal.call(one)
        if not outcome.ok:
            raise SystemExit(f"the stage sender's band failed: {outcome.detail}")
        return outcome.num_bytes, outcome.wire_s

    def _stage_sender(self, stage: int):
        from wavepp.exec.torch_exec import _pool_pieces
        from wavepp.handoff.base import BandJob, BandTensor, HandoffSettings
        from wavepp.handoff.send import HandoffSender
        from wavepp.handoff.socket_send import INLINE_BYTES

        def band(job: BandJob) -> list[BandTensor]:
            return [BandTensor(layer, name, str(t.dtype).removeprefix("torch."),
                               tuple(t.shape), lambda t=t: t,
                               None if layer < 0 else partial(_pool_pieces, t,
                                                              [(0, self.length)]))
                    for (layer, name), t in self._tensors[stage].items()]  # fmt: skip

        settings = HandoffSettings(stage, self.stages, self._fp, timeout_s=60.0,
                                   budget_bytes=1 << 40, inline_bytes=INLINE_BYTES)
        return HandoffSender(settings, band, release=lambda rid: None)

    def close(self) -> None:
        """Stop the stage senders started on the portal."""
        for task in self._tasks:
            task.cancel()
        self._tasks, self._senders = [], {}


def _handoff_sample(client, rx: str, tokens: list[int]) -> dict:
    answer = client.post("/v1/prefill", json={"tokens": tokens, "handoff": rx})
    body = answer.json()
    handoff = body.get("handoff") or {}
    if answer.status_code != 200 or handoff.get("status") != "done":
        raise SystemExit(f"a handoff failed: {answer.status_code} {body}")
    return handoff


def bandwidth(args, config: dict, tmp: Path) -> list[dict]:
    import anyio.from_thread
    import httpx

    rows = []
    rng = np.random.default_rng(0)
    rx_path, socket_path = tmp / "rx.sock", tmp / "rx-socket.sock"
    copy_path = tmp / "copy.sock"
    rx, rx_socket = f"unix:{rx_path}", f"unix:{socket_path}"
    with (_child(RECEIVER, rx, json.dumps(config), "lend"),
          _child(RECEIVER, rx_socket, json.dumps(config), "decline"),
          _child(COPY_RECEIVER, str(copy_path)), _child(BUSY) as busy,
          _server(args, tmp) as url, httpx.Client(base_url=url, timeout=600) as client,
          anyio.from_thread.start_blocking_portal() as portal):  # fmt: skip
        busy.send_signal(signal.SIGSTOP)
        for length in args.lengths:
            library = LibraryBands(config, args.stages, length, portal)

            def draw(n: int = length) -> list[int]:
                return rng.integers(3, config["vocab_size"], n).tolist()

            warm = _handoff_sample(client, rx, draw())  # warm-up, not counted
            _handoff_sample(client, rx_socket, draw())
            data = bytearray(b"\x01") * max(s["bytes"] for s in warm["stages"])
            plain_copy_s(copy_path, data)
            for stage in range(args.stages):
                library.send_s(rx_path, f"warm-{length}-{stage}", stage)
                library.stage_sender_s(rx_path, f"warm-s-{length}", stage)
                library.stage_sender_s(socket_path, f"warm-s-{length}", stage)
            got: dict[str, list] = {kind: [] for kind, _ in SAMPLE_KINDS}

            def one(kind: str, k: int, library=library, data=data, length=length) -> object:
                if kind in ("handoff", "handoff socket"):
                    return _handoff_sample(client, rx if kind == "handoff" else rx_socket,
                                           draw())  # fmt: skip
                if kind in ("copy", "copy busy"):
                    return plain_copy_s(copy_path, data)
                if kind in ("plain", "plain busy"):
                    return [library.send_s(rx_path, f"p{length}-{k}-{kind}", stage)
                            for stage in range(args.stages)]  # fmt: skip
                path = rx_path if kind == "alone" else socket_path
                return [library.stage_sender_s(path, f"s{length}-{k}", stage)
                        for stage in range(args.stages)]  # fmt: skip

            for k in range(args.samples):
                # one of each per sample, the kind that goes first moving on one a sample
                turn = k % len(SAMPLE_KINDS)
                for kind, loaded in SAMPLE_KINDS[turn:] + SAMPLE_KINDS[:turn]:
                    with _busy(busy) if loaded else contextlib.nullcontext():
                        got[kind].append(one(kind, k))
            rows.append(_row(length, args.stages, got, len(data)))
            library.close()
            _print_row(rows[-1])
    return rows


# what one sample of a length takes, each once, and whether beside a busy core
SAMPLE_KINDS = [("handoff", False), ("copy", False), ("plain", False), ("copy busy", True),
                ("plain busy", True), ("alone", False), ("handoff socket", False),
                ("alone socket", False)]  # fmt: skip


def _row(length: int, stages: int, got: dict[str, list], copy_bytes: int) -> dict:
    """One length's figures from its samples by kind (``SAMPLE_KINDS``). Every ratio
    divides by the idle plain copy's median."""
    plain = statistics.median(got["copy"])
    plain_gb_s = copy_bytes / plain / 1e9

    def against_copy(samples: list[tuple[int, float]]) -> dict:
        gb_s = [n / s / 1e9 for n, s in samples]
        return {"bytes": samples[0][0], "gb_s": _spread(gb_s),
                "ratio": {k: v / plain_gb_s for k, v in _spread(gb_s).items()}}  # fmt: skip

    def latency(handoffs: list[dict]) -> dict:
        return _spread([max(s["ended_at"] + s["seconds"] for s in h["stages"])
                        - h["stages"][-1]["ended_at"] for h in handoffs])  # fmt: skip

    def in_pipeline(bands: list[dict]) -> dict:
        return {**against_copy([(b["bytes"], b["wire_s"]) for b in bands]),
                "wire_s": _spread([b["wire_s"] for b in bands]),
                "setup_s": _spread([b["seconds"] - b["wire_s"] for b in bands]),
                "seconds": _spread([b["seconds"] for b in bands])}  # fmt: skip

    row = {
        "tokens": length, "samples": len(got["handoff"]),
        "latency_s": latency(got["handoff"]),
        "latency_socket_s": latency(got["handoff socket"]),
        "plain_copy": {"bytes": copy_bytes, "seconds": _spread(got["copy"]),
                       "gb_s": _spread([copy_bytes / s / 1e9 for s in got["copy"]])},
        "plain_copy_busy_core": against_copy([(copy_bytes, s) for s in got["copy busy"]]),
        "stages": [],
    }  # fmt: skip
    for stage in range(stages):
        row["stages"].append({
            "stage": stage,
            **in_pipeline([h["stages"][stage] for h in got["handoff"]]),
            "socket": in_pipeline([h["stages"][stage] for h in got["handoff socket"]]),
            "plain_sender_library_receiver": against_copy([p[stage] for p in got["plain"]]),
            "plain_sender_library_receiver_busy_core": against_copy(
                [p[stage] for p in got["plain busy"]]),
            "stage_sender_alone": against_copy([a[stage] for a in got["alone"]]),
            "stage_sender_alone_socket": against_copy([a[stage] for a in got["alone socket"]]),
        })  # fmt: skip
    return row


def _print_row(row: dict) -> None:
    lat, plain = row["latency_s"], row["plain_copy"]["gb_s"]
    lat_socket = row["latency_socket_s"]
    print(f"{row['tokens']:>7,} tokens, {row['samples']} samples: cache held "
          f"{lat['median'] * 1e3:.1f} ms ({lat['min'] * 1e3:.1f}-{lat['max'] * 1e3:.1f}) after "
          f"the last chunk ({lat_socket['median'] * 1e3:.1f} ms over the socket); plain copy "
          f"{plain['median']:.2f} GB/s ({plain['min']:.2f}-{plain['max']:.2f}); beside a busy "
          f"core {_spell(row['plain_copy_busy_core']['ratio'])} of it", flush=True)  # fmt: skip
    for s in row["stages"]:
        lib = s["plain_sender_library_receiver"]["ratio"]
        busy = s["plain_sender_library_receiver_busy_core"]["ratio"]
        print(f"  stage {s['stage']}: {s['bytes'] / 2**20:.1f} MiB at {s['gb_s']['median']:.2f} "
              f"GB/s on the wire = {_spell(s['ratio'])} the plain copy (over the socket "
              f"{_spell(s['socket']['ratio'])}); setup {s['setup_s']['median'] * 1e3:.1f} ms; "
              f"its sender alone {_spell(s['stage_sender_alone']['ratio'])} (over the socket "
              f"{_spell(s['stage_sender_alone_socket']['ratio'])}); plain sender into the "
              f"library receiver {_spell(lib)}, beside a busy core {_spell(busy)}",
              flush=True)  # fmt: skip


def _spell(ratio: dict) -> str:
    return f"{ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f})"


def _on_over_off(on: list[float], off: list[float]) -> dict:
    """The pairs' ratios, their spread, and mean on / mean off with its 95% interval."""
    ratios = [a / b for a, b in zip(on, off, strict=True)]
    interval = ratio_of_means_interval(on, off) if len(ratios) > 1 else None
    return {"ratios": ratios, "ratio": _spread(ratios),
            "ratio_of_means": statistics.mean(on) / statistics.mean(off),
            "ratio_of_means_95": None if interval is None else list(interval)}  # fmt: skip


def _say(what: str, ratio: dict) -> None:
    spread, interval = ratio["ratio"], ratio["ratio_of_means_95"]
    within = "" if interval is None else f" (95% interval {interval[0]:.3f}-{interval[1]:.3f})"
    print(f"on / off, {len(ratio['ratios'])} pairs{what}: median {spread['median']:.3f} "
          f"({spread['min']:.3f}-{spread['max']:.3f}); mean on / mean off "
          f"{ratio['ratio_of_means']:.3f}{within}", flush=True)  # fmt: skip


def throughput(args, tmp: Path) -> dict:
    from wavepp.model import BUILTIN, hf_config

    runs: dict[str, list[float]] = {"off": [], "on": []}
    steal: dict[str, list[float | None]] = {"off": [], "on": []}
    config = json.dumps(hf_config(BUILTIN["tiny-kimi"]))
    for repeat in range(args.repeats):
        order = ("off", "on") if repeat % 2 == 0 else ("on", "off")
        for mode in order:
            out = tmp / f"default-{mode}-{repeat}.json"
            if mode == "on":
                rx = f"unix:{tmp / f'rx-default-{repeat}.sock'}"
                with _child(RECEIVER, rx, config, "lend"):  # a fresh receiver a run
                    _torchrun(4, ["--handoff-all", "--handoff-to", rx, "--json", str(out)])
                record = json.loads(out.read_text())
                if record["handoff"].get("done") != len(record["requests"]):
                    errors = {(r.get("handoff") or {}).get("error") for r in record["requests"]}
                    errors.discard(None)
                    raise SystemExit(f"not every handoff was done: {record['handoff']}, "
                                     f"e.g. {sorted(errors)[:3]}")  # fmt: skip
            else:
                _torchrun(4, ["--json", str(out)])
                record = json.loads(out.read_text())
            runs[mode].append(record["throughput_tok_s"])
            steal[mode].append(record.get("cpu_steal_share"))
            taken = "" if steal[mode][-1] is None else f", CPU steal {steal[mode][-1]:.1%}"
            print(f"default job, handoff {mode}: {record['throughput_tok_s']:,.0f} tok/s{taken}",
                  flush=True)  # fmt: skip
    result = {"tok_s_off": runs["off"], "tok_s_on": runs["on"], "steal_off": steal["off"],
              "steal_on": steal["on"], **_on_over_off(runs["on"], runs["off"])}  # fmt: skip
    _say("", result)
    quiet = [i for i, pair in enumerate(zip(steal["on"], steal["off"], strict=True))
             if all(x is not None and x <= QUIET_STEAL for x in pair)]  # fmt: skip
    result["quiet_pairs"] = quiet
    if len(quiet) > 1:  # the pairs the hypervisor left alone
        on, off = [runs["on"][i] for i in quiet], [runs["off"][i] for i in quiet]
        result["quiet"] = _on_over_off(on, off)
        _say(f" with CPU steal <= {QUIET_STEAL:.0%} in both runs", result["quiet"])
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.handoff",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("--lengths", default="4096,32768",
                        help="prompt lengths of the bandwidth and latency runs (empty: "
                             "skip them)")  # fmt: skip
    parser.add_argument("--model", default="tiny-llama",
                        help="model of the bandwidth runs (a built-in name)")  # fmt: skip
    parser.add_argument("--stages", type=int, default=2, help="stages of the bandwidth runs")
    parser.add_argument("--budget", type=int, default=2048, help="wave budget of those runs")
    parser.add_argument("--samples", type=int, default=10,
                        help="samples per length (medians and min-max over them)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=8,
                        help="alternating on/off pairs of the default job (0: skip); on "
                             "a two-core machine one run's throughput can differ from "
                             "the next by half, so a few pairs cannot tell a 5%% cost: "
                             "the 95%% interval of the ratio says how far to trust it")  # fmt: skip
    parser.add_argument("--json", help="write the record here")
    args = parser.parse_args(argv)
    try:
        args.lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--lengths {args.lengths!r}: prompt lengths, comma-separated")
    if any(n < 2 for n in args.lengths):
        parser.error(f"--lengths {args.lengths}: 2 tokens or more each")
    if args.repeats < 0:
        parser.error(f"--repeats {args.repeats}: 0 or more")
    if args.samples < 1:
        parser.error(f"--samples {args.samples}: 1 or more")
    if not args.lengths and not args.repeats:
        parser.error("nothing to measure: --lengths is empty and --repeats is 0")
    from wavepp.model import BUILTIN
    from wavepp.runtime.handoff import model_hf_config

    if args.model not in BUILTIN or model_hf_config(args.model, BUILTIN[args.model]) is None:
        raise SystemExit(f"--model {args.model!r}: a built-in attention-only or Kimi model")
    config = model_hf_config(args.model, BUILTIN[args.model])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="wavepp-handoff-") as tmp:
        rows = bandwidth(args, config, Path(tmp)) if args.lengths else []
        record = {"machine": f"{os.cpu_count()} cores", "model": args.model,
                  "stages": args.stages, "bandwidth": rows,
                  "note": "wire_s: a stage's sender thread, connect to ack; setup_s: the "
                          "rest of seconds (last chunk to ack handled)"}  # fmt: skip
        if args.json:  # kept should the throughput runs fail
            Path(args.json).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        if args.repeats:
            record["throughput_default_job"] = throughput(args, Path(tmp))
    emit(record, args.json)


if __name__ == "__main__":
    main()
