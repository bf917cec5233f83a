"""``python -m benchmarks.pd``: WavePP as the prefiller of vLLM's disaggregated serving,
measured on this host (``docs/handoff.md``, "Measured: vLLM decoding WavePP's prefill":
the protocol is written there, before any figure). One deployment for the whole run, as the
interop test builds it (``tests/helpers/vllm_pd.py``): a random Llama written with
``transformers`` (``--shape``, float32, a byte-level tokenizer), WavePP's server at P = 2
on it, ``vllm serve`` with ``WavePPConnector`` (vLLM CPU, ``VLLM_CPU_OMP_THREADS_BIND``
0-1) and ``python -m wavepp.route --replica ... --decoder ...``: P and D share the
machine's cores. Three measurements, each of pairs taken side by side, the arms'
order alternating from repeat to repeat, after one untimed warm-up pair:

- **(a) time to first token at the decoder**, per prompt length (``--lengths``): vLLM
  loading WavePP's cache (WavePP has prefilled the prompt, as a proxy's first leg does;
  then the clock runs from sending the request with WavePP's ``kv_transfer_params`` to
  vLLM until its answer of ``max_tokens`` 1) against vLLM computing a prompt of the same
  length itself. Fresh random prompts every time: no cache on either side holds them.
  Also the connector's load time (``vllm:wavepp_load_seconds``) and WavePP's prefill.
- **(b) bytes per second into vLLM's paged cache**: each (a) load's band bytes over its
  load time (the worker starting it to its last layer written), against a plain copy of
  the same number of bytes from this process into another over a Unix socket
  (``benchmarks.handoff``'s, timed connect to the receiver's answer), right after.
- **(c) a P/D run**: ``--prompts`` prompts, each one of ``--prefixes`` fresh shared
  prefixes and a fresh suffix, ``--decode-tokens`` greedy tokens each, ``--concurrency``
  at a time, streamed through the proxy, against the same prompts' kind (fresh ones) sent
  to vLLM alone (the same server, no ``kv_transfer_params``). Throughput (requests and
  generated tokens per second of the run's wall time) and TTFT p50 / p99 (to the first
  streamed token at the client).

Every ratio: of the means over the repeats, with its 95% paired-bootstrap interval
(``benchmarks._stats.ratio_of_means_interval``); a goal holds when the whole interval
clears it, fails when none of it does, and is undecided otherwise. ``--smoke``: small
sizes that prove the script works (about 2 minutes here); not a result.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np

from benchmarks._stats import emit, percentile, ratio_of_means_interval
from benchmarks.handoff import COPY_RECEIVER, plain_copy_s
from tests.helpers import vllm_pd as v

PROXY = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
         "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip
LISTENING = re.compile(r"listening on (http://\S+) \(pid")
GOALS = {"ttft_16k": 0.2, "bandwidth": 0.8}  # (a) at most, (b) at least
WAVEPP_BLOCK = 16


def _ids(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(3, 500, n).tolist()


@contextlib.contextmanager
def _wavepp(tmp: Path, model: Path, args) -> Iterator[str]:
    """WavePP's server at P = 2, blocks enough for the largest prompt and the P/D run."""
    most = max(max(args.lengths), args.prefixes * args.prefix_tokens
               + args.prompts * args.suffix_tokens)  # fmt: skip
    blocks = 2 * -(-most // WAVEPP_BLOCK) + 64
    cmd = [sys.executable, "-m", "wavepp.serve.launch", "--nproc-per-node", "2", "--host",
           "127.0.0.1", "--port", "0", "--model", str(model), "--block-size",
           str(WAVEPP_BLOCK), "--capacity-blocks", str(blocks), "--handoff-lease-s", "300",
           "--max-body-bytes", str(64 << 20), "--concurrency", str(args.concurrency),
           "--no-progress"]  # fmt: skip
    log = tmp / "wavepp.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 600
        while not (match := LISTENING.search(log.read_text())):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"WavePP's server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield match.group(1)
    finally:
        v.stop(proc, 300)


@contextlib.contextmanager
def _copy_receiver(tmp: Path) -> Iterator[Path]:
    path = tmp / "copy.sock"
    proc = subprocess.Popen([sys.executable, "-c", COPY_RECEIVER, str(path)],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        if proc.stdout.readline().strip() != "ready":
            raise SystemExit("the copy receiver did not start")
        yield path
    finally:
        proc.kill()
        proc.wait(30)


class Deployment:
    """The run's processes' addresses and the calls the measurements make."""

    def __init__(self, wavepp: str, vllm: str, router: str, copy: Path) -> None:
        self.wavepp, self.vllm, self.router, self.copy = wavepp, vllm, router, copy
        self.client = httpx.Client(timeout=3600)

    def prefill(self, ids: list[int], rid: str) -> tuple[dict, float]:
        """A proxy's first leg: WavePP's ``kv_transfer_params`` and the seconds it took."""
        t0 = time.perf_counter()
        reply = self.client.post(self.wavepp + "/v1/completions", headers={"X-Request-Id": rid},
                                 json={"model": "m", "prompt": ids, "max_tokens": 1,
                                       "stream": False, "kv_transfer_params": PROXY})  # fmt: skip
        seconds = time.perf_counter() - t0
        if reply.status_code != 200 or "kv_transfer_params" not in reply.json():
            raise SystemExit(f"WavePP's prefill failed: {reply.status_code} {reply.text[:500]}")
        return reply.json()["kv_transfer_params"], seconds

    def first_token_s(self, ids: list[int], params: dict | None) -> float:
        """vLLM's answer of one token to ``ids`` (with WavePP's parameters, or none)."""
        body = {"model": "tiny", "prompt": ids, "max_tokens": 1, "temperature": 0}
        if params is not None:
            body["kv_transfer_params"] = params
        t0 = time.perf_counter()
        reply = self.client.post(self.vllm + "/v1/completions", json=body)
        seconds = time.perf_counter() - t0
        if reply.status_code != 200:
            raise SystemExit(f"vLLM answered {reply.status_code}: {reply.text[:500]}")
        return seconds

    def connector(self) -> dict[str, float]:
        s = v.metrics(self.vllm)
        return {key: v.total(s, f"vllm:wavepp_{key}")
                for key in ("loads_total", "load_errors_total", "load_seconds_sum",
                            "received_bytes_total", "loaded_bytes_total")}  # fmt: skip


def ttft_pairs(dep: Deployment, args, rng: np.random.Generator) -> list[dict]:
    """(a) and (b): per length, a warm-up pair then ``repeats`` pairs."""
    rows = []
    for length in args.lengths:
        for r in range(-1, args.repeats):  # -1: the warm-up, not kept
            arms = ["load", "compute"] if r % 2 == 0 else ["compute", "load"]
            row: dict = {"length": length, "repeat": r}
            for arm in arms:
                ids = _ids(rng, length)
                if arm == "compute":
                    row["compute_s"] = dep.first_token_s(ids, None)
                    continue
                params, row["prefill_s"] = dep.prefill(ids, f"pd-{length}-{r}-{time.time_ns()}")
                before = dep.connector()
                row["load_ttft_s"] = dep.first_token_s(ids, params)
                after = _settled(dep, before)
                grew = {k: after[k] - before[k] for k in after}
                if grew["loads_total"] != 1 or grew["load_errors_total"]:
                    raise SystemExit(f"the connector did not load the {length}-token prompt "
                                     f"once ({grew}): see vllm.log")  # fmt: skip
                row["load_s"] = grew["load_seconds_sum"]
                row["band_bytes"] = int(grew["received_bytes_total"])
                row["loaded_bytes"] = int(grew["loaded_bytes_total"])
                row["copy_s"] = plain_copy_s(dep.copy, bytearray(row["band_bytes"]))
            if r >= 0:
                rows.append(row)
            print(f"pd: (a) {length} tokens, {'warm-up' if r < 0 else f'repeat {r}'}: load "
                  f"{row['load_ttft_s']:.3f} s, compute {row['compute_s']:.3f} s, band "
                  f"{row['band_bytes'] / row['load_s'] / 1e9:.2f} GB/s, copy "
                  f"{row['band_bytes'] / row['copy_s'] / 1e9:.2f} GB/s", flush=True)  # fmt: skip
    return rows


def _settled(dep: Deployment, before: dict[str, float]) -> dict[str, float]:
    """The connector's figures once the sample's load is counted (vLLM's front end counts
    it just after answering)."""
    deadline = time.monotonic() + 60
    while True:
        now = dep.connector()
        if now["loads_total"] + now["load_errors_total"] > (
                before["loads_total"] + before["load_errors_total"]):  # fmt: skip
            return now
        if time.monotonic() > deadline:
            raise SystemExit("vLLM's /metrics never counted the load")
        time.sleep(0.1)


def _stream(client: httpx.Client, url: str, body: dict) -> tuple[float, float, int]:
    """(seconds to the first streamed token, seconds to the end, tokens) of one request."""
    t0 = time.perf_counter()
    first, tokens = None, 0
    with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as reply:
        if reply.status_code != 200:
            raise SystemExit(f"{url} answered {reply.status_code}: {reply.read()[:500]!r}")
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            got = json.loads(line[6:])
            if "error" in got:
                raise SystemExit(f"{url}: {got['error']}")
            if got["choices"] and got["choices"][0].get("text") is not None:
                tokens += 1
                first = first if first is not None else time.perf_counter() - t0
    return first if first is not None else float("nan"), time.perf_counter() - t0, tokens


def run_pd(dep: Deployment, url: str, args, rng: np.random.Generator) -> dict:
    """One run of (c) against ``url`` (the proxy, or vLLM alone): fresh prefixes."""
    prefixes = [_ids(rng, args.prefix_tokens) for _ in range(args.prefixes)]
    bodies = [{"model": "tiny", "prompt": prefixes[i % args.prefixes]
               + _ids(rng, args.suffix_tokens), "max_tokens": args.decode_tokens,
               "temperature": 0, "ignore_eos": True} for i in range(args.prompts)]  # fmt: skip
    with contextlib.suppress(httpx.HTTPError):
        dep.client.post(dep.vllm + "/reset_prefix_cache")
    results: list[tuple[float, float, int]] = []
    lock = threading.Lock()
    queue = list(enumerate(bodies))

    def worker() -> None:
        with httpx.Client(timeout=3600) as client:
            while True:
                with lock:
                    if not queue:
                        return
                    _, body = queue.pop(0)
                got = _stream(client, url, body)
                with lock:
                    results.append(got)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttfts = [r[0] for r in results]
    return {"wall_s": wall, "requests_per_s": len(results) / wall,
            "tokens_per_s": sum(r[2] for r in results) / wall,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99)}  # fmt: skip


def pd_pairs(dep: Deployment, args, rng: np.random.Generator) -> list[dict]:
    rows = []
    for r in range(-1, args.repeats):
        arms = ["pd", "alone"] if r % 2 == 0 else ["alone", "pd"]
        row: dict = {"repeat": r}
        for arm in arms:
            row[arm] = run_pd(dep, dep.router if arm == "pd" else dep.vllm, args, rng)
        if r >= 0:
            rows.append(row)
        print(f"pd: (c) {'warm-up' if r < 0 else f'repeat {r}'}: "
              + ", ".join(f"{arm} {row[arm]['tokens_per_s']:.1f} tok/s p50 TTFT "
                          f"{row[arm]['ttft_p50_s']:.3f} s" for arm in ("pd", "alone")),
              flush=True)  # fmt: skip
    return rows


def _ratio(on: list[float], off: list[float], goal: float | None = None,
           at_most: bool = True) -> dict:  # fmt: skip
    ratio = statistics.fmean(on) / statistics.fmean(off)
    low, high = ratio_of_means_interval(on, off)
    out = {"ratio_of_means": ratio, "interval_95": [low, high], "pairs": len(on)}
    if goal is not None:
        good = high <= goal if at_most else low >= goal
        bad = low > goal if at_most else high < goal
        out.update(goal=goal, verdict="holds" if good else "fails" if bad else "undecided")
    return out


def summarize(ttft: list[dict], pd: list[dict], args) -> dict:
    out: dict = {"ttft": {}, "bandwidth": {}}
    for length in args.lengths:
        rows = [r for r in ttft if r["length"] == length]
        load = [r["load_ttft_s"] for r in rows]
        compute = [r["compute_s"] for r in rows]
        goal = GOALS["ttft_16k"] if length == 16384 else None
        out["ttft"][str(length)] = {
            "load_ttft_s_mean": statistics.fmean(load),
            "compute_ttft_s_mean": statistics.fmean(compute),
            "load_s_mean": statistics.fmean(r["load_s"] for r in rows),
            "prefill_s_mean": statistics.fmean(r["prefill_s"] for r in rows),
            "load_over_compute": _ratio(load, compute, goal)}  # fmt: skip
        gbps = [r["band_bytes"] / r["load_s"] / 1e9 for r in rows]
        copy = [r["band_bytes"] / r["copy_s"] / 1e9 for r in rows]
        out["bandwidth"][str(length)] = {
            "band_bytes": rows[0]["band_bytes"], "load_gbps_mean": statistics.fmean(gbps),
            "copy_gbps_mean": statistics.fmean(copy),
            "load_over_copy": _ratio(gbps, copy, GOALS["bandwidth"], at_most=False)}  # fmt: skip
    if pd:
        out["pd"] = {key: {"pd_mean": statistics.fmean(r["pd"][key] for r in pd),
                           "alone_mean": statistics.fmean(r["alone"][key] for r in pd),
                           "pd_over_alone": _ratio([r["pd"][key] for r in pd],
                                                   [r["alone"][key] for r in pd])}
                     for key in ("requests_per_s", "tokens_per_s", "ttft_p50_s",
                                 "ttft_p99_s")}  # fmt: skip
    return out


def _machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())  # fmt: skip
    versions = subprocess.run([v.VLLM_PYTHON, "-c", "import vllm, torch; print(vllm.__version__,"
                               " torch.__version__)"], capture_output=True, text=True)  # fmt: skip
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)),
            "vllm_torch": versions.stdout.strip(), "python": platform.python_version()}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pd",
                                description=__doc__.split("\n\n")[0])  # fmt: skip
    p.add_argument("--lengths", default="4096,16384,32768", help="(a), (b): prompt tokens")
    p.add_argument("--repeats", type=int, default=5, help="pairs per measurement (>= 2)")
    p.add_argument("--shape", default="4,512,8,2,64,1408",
                   help="the random Llama: layers,hidden,heads,kv heads,head dim,MLP")  # fmt: skip
    p.add_argument("--prompts", type=int, default=64, help="(c): prompts per run")
    p.add_argument("--prefixes", type=int, default=4, help="(c): shared prefixes per run")
    p.add_argument("--prefix-tokens", type=int, default=2048, help="(c)")
    p.add_argument("--suffix-tokens", type=int, default=256, help="(c)")
    p.add_argument("--decode-tokens", type=int, default=32, help="(c): greedy tokens each")
    p.add_argument("--concurrency", type=int, default=16, help="(c): requests at once")
    p.add_argument("--no-pd", action="store_true", help="skip (c)")
    p.add_argument("--smoke", action="store_true", help="small sizes: the script works; "
                   "not a result")  # fmt: skip
    p.add_argument("--vllm-python", default=None, help="the vLLM venv's python "
                   "[$WAVEPP_VLLM_PYTHON]")  # fmt: skip
    p.add_argument("--json", default=None, help="write the record here too")
    args = p.parse_args(argv)
    if args.smoke:
        args.lengths, args.repeats, args.shape = "512,1024", 2, "2,128,4,2,32,256"
        args.prompts, args.prefixes, args.prefix_tokens = 8, 2, 256
        args.suffix_tokens, args.decode_tokens, args.concurrency = 64, 8, 4
    args.lengths = [int(x) for x in args.lengths.split(",") if x]
    if args.repeats < 2:
        raise SystemExit("--repeats must be 2 or more (a paired bootstrap needs pairs)")
    if args.vllm_python:
        v.VLLM_PYTHON = args.vllm_python
    if not v.has_vllm():
        raise SystemExit(f"no vLLM venv with WavePP at {v.VLLM_PYTHON} (.ci/vllm-venv makes one; "
                         "--vllm-python or WAVEPP_VLLM_PYTHON names it)")  # fmt: skip
    layers, hidden, heads, kv_heads, head_dim, mlp = (int(x) for x in args.shape.split(","))
    longest = max(max(args.lengths), args.prefix_tokens + args.suffix_tokens) + 64
    max_len = -(-longest // 1024) * 1024
    rng = np.random.default_rng(0)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="wavepp-pd-") as name:
        tmp = Path(name)
        model = tmp / "llama"
        v.chat_llama(model, layers, hidden, heads, kv_heads, head_dim, mlp, max_len)
        # D's cache: the P/D run's prompts and decode, or the longest prompt, twice over
        per_token = layers * 2 * kv_heads * head_dim * 4
        need = 2 * max(longest, args.prompts * (args.prefix_tokens + args.suffix_tokens
                                                + args.decode_tokens)) * per_token  # fmt: skip
        gib = max(1, -(-need // (1 << 30)))
        vllm_proc, vllm = v.start_vllm(tmp, model, connector=v.connector_config(timeout_s=600),
                                       max_len=max_len, kv_space_gib=gib)  # fmt: skip
        try:
            with _wavepp(tmp, model, args) as wavepp, _copy_receiver(tmp) as copy:
                router_proc, router = v.start_router(tmp, wavepp, vllm)
                try:
                    dep = Deployment(wavepp, vllm, router, copy)
                    ttft = ttft_pairs(dep, args, rng)
                    pd = [] if args.no_pd else pd_pairs(dep, args, rng)
                finally:
                    v.stop(router_proc, 60)
        finally:
            v.stop(vllm_proc)
    record = {"benchmark": "pd", "smoke": args.smoke, "machine": _machine(),
              "args": {k: getattr(args, k) for k in vars(args) if k != "json"},
              "seconds": round(time.time() - started, 1), "ttft_pairs": ttft, "pd_pairs": pd,
              "summary": summarize(ttft, pd, args)}  # fmt: skip
    emit(record, args.json)


if __name__ == "__main__":
    main()
