"""``python -m wavepp.bench.handoff``: what handing caches on costs (``docs/handoff.md``).

Three measurements, each a ratio or a time from this invocation's own runs:

- **bandwidth**: one prompt per length (default 4,096 and 32,768 tokens) prefilled at
  ``--stages`` stages and handed to a receiver in this process (``wavepp.handoff``'s
  ``Receiver``, checking every band); each stage's bytes over its time from the
  request's last chunk there to the acknowledgement, against a plain Unix-socket copy
  of the same number of bytes between two processes on this machine (``sendall`` of one
  buffer into ``recv_into``), right after;
- **latency**: from the request's last chunk (on the last stage) to the receiver
  holding every band (the last acknowledgement);
- **throughput**: the default job (``wavepp.main`` with no options but ``--json``)
  with every request handing its cache to a receiver (``--handoff-all``) against the
  same job without, ``--repeats`` alternating pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
import anyio.from_thread
import numpy as np

from wavepp.bench._stats import emit

COPIER = """
import socket, sys
size = int(sys.argv[2])
data = bytearray(b"\x01") * size  # touched: real pages, as a cache is
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.sendall(data)
s.recv(1)
"""


def _torchrun(stages: int, args: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={stages}", "-m", "wavepp.main", "--no-progress", *args]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


class _Receiver:
    """A ``wavepp.handoff`` receiver for ``config`` on a Unix socket, in a thread."""

    def __init__(self, config: dict, path: Path) -> None:
        from wavepp.handoff.receive import Receiver

        self.address = f"unix:{path}"
        self.receiver = Receiver(config, "float32", on_complete=lambda h: None)

    def __enter__(self):
        self._cm = anyio.from_thread.start_blocking_portal()
        portal = self._cm.__enter__()
        self._future, _ = portal.start_task(self.receiver.serve, self.address)
        return self

    def __exit__(self, *exc) -> None:
        self._future.cancel()
        self._cm.__exit__(None, None, None)


def plain_copy_s(num_bytes: int, tmp: Path) -> float:
    """Seconds to move ``num_bytes`` over a Unix socket from another process."""
    path = tmp / "copy.sock"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(path))
        listener.listen(1)
        child = subprocess.Popen([sys.executable, "-c", COPIER, str(path), str(num_bytes)])
        conn, _ = listener.accept()
        with conn:
            start = time.perf_counter()
            buffer = bytearray(num_bytes)  # fresh memory, as a receiver holding a cache needs
            view, got = memoryview(buffer), 0
            while got < num_bytes:
                n = conn.recv_into(view[got:])
                if not n:
                    raise RuntimeError("the copier hung up")
                got += n
            seconds = time.perf_counter() - start
            conn.sendall(b"k")
        child.wait(60)
    path.unlink()
    return seconds


def bandwidth(args, model_config: dict, tmp: Path) -> list[dict]:
    rows = []
    rng = np.random.default_rng(0)
    for length in args.lengths:
        requests, out = tmp / f"len-{length}.jsonl", tmp / f"len-{length}.json"
        with open(requests, "w") as f:
            for k in range(args.samples):
                tokens = rng.integers(3, model_config["vocab_size"], length).tolist()
                f.write(json.dumps({"id": f"p{length}-{k}", "tokens": tokens,
                                    "handoff": True}) + "\n")  # fmt: skip
        with _Receiver(model_config, tmp / "rx.sock") as rx:
            _torchrun(args.stages, ["--model", args.model, "--requests-file", str(requests),
                                    "--budget", str(args.budget), "--concurrency", "1",
                                    "--handoff-to", rx.address, "--json", str(out)])  # fmt: skip
        latencies, per_stage = [], [[] for _ in range(args.stages)]
        for request in json.loads(out.read_text())["requests"]:
            stages = request["handoff"]["stages"]
            if not all(s["ok"] for s in stages):
                raise SystemExit(f"handoff of {length} tokens failed: {request['handoff']}")
            last = stages[-1]["ended_at"]
            latencies.append(max(s["ended_at"] + s["seconds"] for s in stages) - last)
            for s in stages:
                per_stage[s["stage"]].append((s["bytes"], s["seconds"]))
        row = {"tokens": length, "samples": args.samples,
               "latency_s": statistics.median(latencies), "stages": []}  # fmt: skip
        for stage, samples in enumerate(per_stage):
            num_bytes = samples[0][0]
            seconds = statistics.median(s for _, s in samples)
            plain = statistics.median(plain_copy_s(num_bytes, tmp) for _ in range(args.samples))
            row["stages"].append({
                "stage": stage, "bytes": num_bytes, "seconds": seconds,
                "gb_s": num_bytes / seconds / 1e9, "plain_copy_s": plain,
                "plain_copy_gb_s": num_bytes / plain / 1e9, "ratio": plain / seconds,
            })  # fmt: skip
        rows.append(row)
        print(f"{length:>7,} tokens: cache held {row['latency_s'] * 1e3:.1f} ms after the "
              "last chunk (median); " + "; ".join(
                  f"stage {s['stage']} {s['bytes'] / 2**20:.1f} MiB at {s['gb_s']:.2f} GB/s = "
                  f"{s['ratio']:.2f}x a plain copy ({s['plain_copy_gb_s']:.2f} GB/s)"
                  for s in row["stages"]), flush=True)  # fmt: skip
    return rows


def throughput(args, tmp: Path) -> dict:
    from wavepp.model import BUILTIN, hf_config

    runs: dict[str, list[float]] = {"off": [], "on": []}
    for repeat in range(args.repeats):
        order = ("off", "on") if repeat % 2 == 0 else ("on", "off")
        for mode in order:
            out = tmp / f"default-{mode}-{repeat}.json"
            if mode == "on":
                with _Receiver(hf_config(BUILTIN["tiny-kimi"]), tmp / "rx.sock") as rx:
                    _torchrun(4, ["--handoff-all", "--handoff-to", rx.address,
                                  "--json", str(out)])  # fmt: skip
                record = json.loads(out.read_text())
                if record["handoff"].get("done") != sum(1 for _ in record["requests"]):
                    raise SystemExit(f"not every handoff was done: {record['handoff']}")
            else:
                _torchrun(4, ["--json", str(out)])
                record = json.loads(out.read_text())
            runs[mode].append(record["throughput_tok_s"])
            print(f"default job, handoff {mode}: {record['throughput_tok_s']:,.0f} tok/s",
                  flush=True)  # fmt: skip
    ratios = [on / off for on, off in zip(runs["on"], runs["off"], strict=True)]
    return {"tok_s_off": runs["off"], "tok_s_on": runs["on"], "ratios": ratios,
            "median_ratio": statistics.median(ratios)}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m wavepp.bench.handoff",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("--lengths", default="4096,32768",
                        help="prompt lengths of the bandwidth and latency runs")  # fmt: skip
    parser.add_argument("--model", default="tiny-llama",
                        help="model of the bandwidth runs (a built-in name)")  # fmt: skip
    parser.add_argument("--stages", type=int, default=2, help="stages of the bandwidth runs")
    parser.add_argument("--budget", type=int, default=2048, help="wave budget of those runs")
    parser.add_argument("--samples", type=int, default=3,
                        help="prompts per length (medians over them)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=2,
                        help="alternating on/off pairs of the default job (0: skip)")
    parser.add_argument("--json", help="write the record here")
    args = parser.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",") if x]
    from wavepp.model import BUILTIN
    from wavepp.runtime.handoff import model_hf_config

    if args.model not in BUILTIN or model_hf_config(args.model, BUILTIN[args.model]) is None:
        raise SystemExit(f"--model {args.model!r}: a built-in attention-only or Kimi model")
    config = model_hf_config(args.model, BUILTIN[args.model])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="wavepp-handoff-") as tmp:
        rows = bandwidth(args, config, Path(tmp))
        record = {"machine": f"{os.cpu_count()} cores", "model": args.model,
                  "stages": args.stages, "bandwidth": rows}
        if args.repeats:
            record["throughput_default_job"] = throughput(args, Path(tmp))
    emit(record, args.json)


if __name__ == "__main__":
    main()
