"""Segments on vs --no-handoff-segments, with wavepp.bench.handoff's own pieces.

Runs at 7fed678 (before segments were removed), from a checkout's root:
``python docs/results/handoff-segments-vs-socket.py [bands|default|both]``; the record
goes to ``$OUT`` (``handoff-segments-vs-socket.json`` here). Its output at 7fed678 is
``docs/results/handoff-segments-vs-socket.json`` (docs/benchmarks.md).

Protocol (fixed before running):
- large bands: two servers (tiny-llama, P = 2, as the driver's bandwidth runs), ON
  (default) and OFF (--no-handoff-segments), both up for the whole run, each handing
  off to a lending receiver process of its own. Both warmed: WARM handoffs per length
  each, not counted. Then ROUNDS rounds; a round takes, per length, SAMPLES fresh
  prompts on ON and SAMPLES on OFF, ON first in even rounds and OFF first in odd ones.
  Per sample: the mean over stages of band bytes / wire_s (GB/s) and the latency from
  the last chunk to the cache held. Per (round, mode, length): the mean of its samples.
  Per length: mean ON / mean OFF over the rounds (pairs), with a 95% paired bootstrap
  interval (wavepp.bench._stats.ratio_of_means_interval: 10,000 resamples, seed 0).
  Each round records the load average and the machine's CPU steal share (/proc/stat)
  while each mode measured.
- default job: PAIRS alternating pairs of the default job (torchrun 4 ranks,
  wavepp.main --handoff-all --handoff-to a fresh lending receiver), ON and OFF; the
  ratio of mean throughputs with the same interval; each run's cpu_steal_share.
- Decision: keep segments only if the 32,768-token bandwidth interval lies above 1.0.
"""

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np

from wavepp.bench._stats import ratio_of_means_interval
from wavepp.bench.handoff import BLOCK, LISTENING, RECEIVER, _child, _handoff_sample, _torchrun
from wavepp.model import BUILTIN, hf_config
from wavepp.runtime.handoff import model_hf_config

LENGTHS = [int(x) for x in os.environ.get("LENGTHS", "4096,32768").split(",") if x]
ROUNDS = int(os.environ.get("ROUNDS", "8"))
SAMPLES = int(os.environ.get("SAMPLES", "2"))
WARM = int(os.environ.get("WARM", "3"))
PAIRS = int(os.environ.get("PAIRS", "6"))
OUT = Path(os.environ.get("OUT", "handoff-segments-vs-socket.json"))


def cpu_times():
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return fields


def steal_share(a, b):
    d = [y - x for x, y in zip(a, b, strict=True)]
    total = sum(d[:8])
    return d[7] / total if total else 0.0


@contextmanager
def server(tmp: Path, name: str, extra: list[str]):
    blocks = -(-max(LENGTHS) // BLOCK) + 16
    cmd = [sys.executable, "-m", "wavepp.serve.launch", "--nproc-per-node", "2",
           "--host", "127.0.0.1", "--port", "0", "--model", "tiny-llama", "--budget", "2048",
           "--concurrency", "1", "--block-size", str(BLOCK), "--capacity-blocks", str(blocks),
           *extra]
    log = tmp / f"server-{name}.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 300
        while not (match := LISTENING.search(log.read_text())):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield match.group(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()


def sample(client, rx, tokens):
    h = _handoff_sample(client, rx, tokens)
    gb = statistics.mean(s["bytes"] / s["wire_s"] / 1e9 for s in h["stages"])
    lat = max(s["ended_at"] + s["seconds"] for s in h["stages"]) - h["stages"][-1]["ended_at"]
    return gb, lat, [(s["bytes"], s["wire_s"], s["seconds"]) for s in h["stages"]]


def interval(on, off):
    lo, hi = ratio_of_means_interval(on, off)
    return {"ratio_of_means": statistics.mean(on) / statistics.mean(off), "ci95": [lo, hi],
            "pair_ratios": [a / b for a, b in zip(on, off, strict=True)]}


def bands(tmp: Path, record: dict) -> None:
    config = model_hf_config("tiny-llama", BUILTIN["tiny-llama"])
    rng = np.random.default_rng(0)
    rx = {m: f"unix:{tmp / f'rx-{m}.sock'}" for m in ("on", "off")}
    with (_child(RECEIVER, rx["on"], json.dumps(config), "lend"),
          _child(RECEIVER, rx["off"], json.dumps(config), "lend"),
          server(tmp, "on", []) as url_on, server(tmp, "off", ["--no-handoff-segments"]) as url_off,
          httpx.Client(base_url=url_on, timeout=600) as c_on,
          httpx.Client(base_url=url_off, timeout=600) as c_off):
        client = {"on": c_on, "off": c_off}

        def draw(n):
            return rng.integers(3, config["vocab_size"], n).tolist()

        for length in LENGTHS:
            for _ in range(WARM):
                for m in ("on", "off"):
                    sample(client[m], rx[m], draw(length))
        rounds = []
        for r in range(ROUNDS):
            order = ("on", "off") if r % 2 == 0 else ("off", "on")
            got = {"round": r, "load": os.getloadavg()[0]}
            for length in LENGTHS:
                for m in order:
                    before = cpu_times()
                    xs = [sample(client[m], rx[m], draw(length)) for _ in range(SAMPLES)]
                    got[f"{m}-{length}"] = {
                        "gb_s": statistics.mean(x[0] for x in xs),
                        "latency_s": statistics.mean(x[1] for x in xs),
                        "steal": steal_share(before, cpu_times()),
                        "stages": [x[2] for x in xs]}
            rounds.append(got)
            print(json.dumps({k: (v if not isinstance(v, dict) else
                                  {kk: vv for kk, vv in v.items() if kk != "stages"})
                              for k, v in got.items()}), flush=True)
        record["rounds"] = rounds
        for length in LENGTHS:
            on = [g[f"on-{length}"] for g in rounds]
            off = [g[f"off-{length}"] for g in rounds]
            record[f"bandwidth_{length}"] = interval([x["gb_s"] for x in on],
                                                     [x["gb_s"] for x in off])
            # latency: lower is better; off/on so that > 1 favours segments
            record[f"latency_{length}_off_over_on"] = interval(
                [x["latency_s"] for x in off], [x["latency_s"] for x in on])
            record[f"gb_s_{length}"] = {"on": [x["gb_s"] for x in on],
                                        "off": [x["gb_s"] for x in off]}
            print(length, json.dumps(record[f"bandwidth_{length}"]),
                  json.dumps(record[f"latency_{length}_off_over_on"]), flush=True)


def default_job(tmp: Path, record: dict) -> None:
    config = json.dumps(hf_config(BUILTIN["tiny-kimi"]))
    runs = {"on": [], "off": []}
    for r in range(PAIRS):
        order = ("on", "off") if r % 2 == 0 else ("off", "on")
        for m in order:
            out = tmp / f"default-{m}-{r}.json"
            rx = f"unix:{tmp / f'rxd-{m}-{r}.sock'}"
            load = os.getloadavg()[0]
            extra = [] if m == "on" else ["--no-handoff-segments"]
            with _child(RECEIVER, rx, config, "lend"):
                _torchrun(4, ["--handoff-all", "--handoff-to", rx, "--json", str(out), *extra])
            rec = json.loads(out.read_text())
            assert rec["handoff"].get("done") == len(rec["requests"]), rec["handoff"]
            runs[m].append({"tok_s": rec["throughput_tok_s"], "steal": rec.get("cpu_steal_share"),
                            "load": load})
            print(f"default job {m} pair {r}: {rec['throughput_tok_s']:,.0f} tok/s, steal "
                  f"{rec.get('cpu_steal_share')}, load {load:.2f}", flush=True)
    record["default_job"] = {"runs": runs, **interval([x["tok_s"] for x in runs["on"]],
                                                      [x["tok_s"] for x in runs["off"]])}
    print("default job", json.dumps(record["default_job"]), flush=True)


def main():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    tmp = Path(tempfile.mkdtemp(prefix="wavepp-segments-"))
    record = {"lengths": LENGTHS, "rounds": ROUNDS, "samples": SAMPLES, "warm": WARM,
              "pairs": PAIRS, "cores": os.cpu_count()}
    what = sys.argv[1] if len(sys.argv) > 1 else "both"
    if what in ("both", "bands"):
        bands(tmp, record)
        OUT.write_text(json.dumps(record, indent=1))
    if what in ("both", "default"):
        default_job(tmp, record)
    OUT.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
