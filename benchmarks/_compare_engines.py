"""The two engines of ``benchmarks.vllm_compare``, each run in its own processes.

WavePP: one ``torchrun`` of ``wavepp.main`` per call (P ranks), the row's seeds and warm-up
as untimed warm-up requests, then the measured prompts closed-loop, all at once.
vLLM: never imported here; a driver script runs in vLLM's own virtual environment, one
engine per setting, asked for one call at a time over stdin (a job file's path), and
answers one line. Each call resets vLLM's prefix cache, writes the seeds, runs the
warm-up, then times the measured prompts.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from benchmarks._compare_rows import ModelShape, Prompts

_MARK = "@@wavepp "  # the driver's answer lines, apart from vLLM's own output

# The driver: its own process, vLLM's venv. Steal is read around the timed part only.
_VLLM_DRIVER = """
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

MARK = "@@wavepp "


def cpu():
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def main():
    job = json.load(open(sys.argv[1]))
    llm = LLM(model=job["model"], dtype=job["dtype"], block_size=job["block_size"],
              enable_prefix_caching=True, enable_chunked_prefill=True,
              max_num_batched_tokens=job["max_num_batched_tokens"],
              skip_tokenizer_init=True, max_model_len=job["max_len"], seed=0)
    import torch
    import vllm
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(getattr(torch, job["dtype"]), job["block_size"], job["head_dim"])
    print(MARK + json.dumps({"ready": True, "vllm": vllm.__version__, "torch": torch.__version__,
                             "attention_isa": isa,
                             "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}),
          flush=True)
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, logprobs=2)

    def run(lists):
        return llm.generate([TokensPrompt(prompt_token_ids=p) for p in lists], params,
                            use_tqdm=False) if lists else []

    for line in sys.stdin:  # one job file a line, until EOF
        call = json.load(open(line.strip()))
        llm.reset_prefix_cache()  # each call starts from an empty cache, as WavePP's do
        run(call["seeds"])
        run(call["warmup"])
        before, t0 = cpu(), time.perf_counter()
        outs = run(call["prompts"])
        seconds, after = time.perf_counter() - t0, cpu()
        spent = [b - a for a, b in zip(before, after)]
        gaps = []  # top logprob minus the second: how near a tie the first token was
        for o in outs:
            top = sorted((lp.logprob for lp in o.outputs[0].logprobs[0].values()), reverse=True)
            gaps.append(top[0] - top[1] if len(top) > 1 else None)
        tokens = sum(len(p) for p in call["prompts"])
        print(MARK + json.dumps({
            "tok_s": tokens / seconds, "seconds": seconds, "input_tokens": tokens,
            "first_tokens": [o.outputs[0].token_ids[0] for o in outs],
            "cached_tokens": [o.num_cached_tokens or 0 for o in outs], "top2_gaps": gaps,
            "cpu_steal_share": spent[7] / sum(spent[:8]) if sum(spent[:8]) else None,
        }), flush=True)


if __name__ == "__main__":  # vLLM starts its engine in a spawned process
    main()
"""

# vLLM's CPU guide: TCMalloc and Intel OpenMP preloaded. Where each is looked for.
_TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
             "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4")  # fmt: skip


def vllm_preloads(vllm_python: str) -> dict[str, str | None]:
    """The libraries vLLM's CPU guide preloads, as found here: TCMalloc (Debian's
    ``libtcmalloc-minimal4``) and Intel OpenMP (pip ``intel-openmp``, in vLLM's venv)."""
    venv = Path(vllm_python).parent.parent
    iomp = sorted(glob.glob(str(venv / "lib" / "libiomp5.so")))
    return {"tcmalloc": next((p for p in _TCMALLOC if Path(p).exists()), None),
            "iomp": iomp[0] if iomp else None}  # fmt: skip


# vLLM log lines worth keeping in the record: its backend, ISA and preload warnings
_LOG_KEEP = re.compile(r"attention|backend|ISA|LD_PRELOAD|OMP|OpenMP|threads|core ids|KV cache|"
                       r"compil|non-default args")
# lines that only say where vLLM put a file or socket (a record names nothing outside the
# repository), besides noise
_LOG_DROP = re.compile(r"Triton|FutureWarning|Traceback|Attempted to load weight|"
                       r"distributed_init_method|saved AOT compiled|Warming up model")


def kept_log_lines(lines: list[str]) -> list[str]:
    """The first 40 of ``lines`` worth keeping (``_LOG_KEEP``, not ``_LOG_DROP``), trimmed."""
    return [line.strip()[:300] for line in lines
            if _LOG_KEEP.search(line) and not _LOG_DROP.search(line)][:40]  # fmt: skip


class VllmEngine:
    """vLLM CPU with one setting (block size, max_num_batched_tokens), alive for many
    calls. Its start-up takes a minute or more."""

    def __init__(self, vllm_python: str, ckpt: Path, shape: ModelShape, dtype: str,
                 setting: dict, max_len: int, cpus: str, kv_gib: int, preloads: dict,
                 tmp: Path) -> None:  # fmt: skip
        self.tmp, self.setting, self.calls = tmp, setting, 0
        tag = f"b{setting['block_size']}-t{setting['max_num_batched_tokens']}"
        job = tmp / f"vllm-job-{tag}.json"
        job.write_text(json.dumps({"model": str(ckpt), "dtype": dtype, "max_len": max_len,
                                   "head_dim": shape.head_dim, **setting}))  # fmt: skip
        driver = tmp / "vllm_driver.py"
        driver.write_text(_VLLM_DRIVER)
        preload = ":".join(p for p in (preloads.get("tcmalloc"), preloads.get("iomp")) if p)
        self.env = {"VLLM_CPU_OMP_THREADS_BIND": cpus, "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
                    **({"LD_PRELOAD": preload} if preload else {})}  # fmt: skip
        self.log_path = tmp / f"vllm-{tag}.log"
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [vllm_python, str(driver), str(job)], env={**os.environ, **self.env}, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
        )  # fmt: skip
        self.ready = self._reply()

    def _reply(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(_MARK):
                return json.loads(line[len(_MARK) :])
            self.log.write(line)  # vLLM logs to stdout
        self.log.flush()
        raise RuntimeError(f"vLLM exited with {self.proc.wait()}: "
                           f"{self.log_path.read_text()[-3000:]}")  # fmt: skip

    def run(self, job: Prompts) -> dict:
        assert self.proc.stdin is not None
        self.calls += 1
        path = self.tmp / f"vllm-call-{self.calls}.json"
        path.write_text(json.dumps(job.as_job()))
        self.proc.stdin.write(f"{path}\n")
        self.proc.stdin.flush()
        out = self._reply()
        path.unlink()
        return out

    def cpu_seconds(self) -> float:
        """CPU seconds used so far by the driver and every process under it."""
        return tree_cpu_seconds(self.proc.pid)

    def log_lines(self) -> list[str]:
        """vLLM's log lines about its attention backend, ISA, threads and preloads."""
        self.log.flush()
        return kept_log_lines(self.log_path.read_text(errors="replace").splitlines())

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of ``root`` and its descendants (Linux ``/proc``)."""
    parents, ticks = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        pid = int(stat.parent.name)
        parents[pid], ticks[pid] = int(fields[1]), int(fields[11]) + int(fields[12])
    tree, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in tree:
                tree.add(child)
                frontier.append(child)
    return sum(ticks.get(pid, 0) for pid in tree) / os.sysconf("SC_CLK_TCK")


def run_wavepp(ckpt: Path, job: Prompts, stages: int, threads: int, dtype: str, budget: int,
               full_last_layer: bool, block_size: int, tmp: Path, tag: str) -> dict:  # fmt: skip
    """One ``torchrun`` of ``wavepp.main``: the seeds and the warm-up as untimed warm-up
    requests, then the measured prompts all at once; ``threads`` a rank (WavePP's default
    is the cores over the ranks), no pinning, no preload. The pool holds every prompt of
    the call (nothing evicted)."""
    requests = tmp / f"wavepp-{tag}.jsonl"
    lines = [{"id": f"seed-{i}", "tokens": t, "warmup": True} for i, t in enumerate(job.seeds)]
    lines += [{"id": f"warm-{i}", "tokens": t, "warmup": True} for i, t in enumerate(job.warmup)]
    lines += [{"id": f"p{i}", "tokens": t} for i, t in enumerate(job.measured)]
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    blocks = sum(-(-len(line["tokens"]) // block_size) for line in lines) + 64
    out = tmp / f"wavepp-{tag}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={stages}", "-m", "wavepp.main", "--model", str(ckpt),
           "--requests-file", str(requests), "--concurrency", str(len(job.measured)),
           "--no-progress", "--json", str(out), "--dtype", dtype, "--budget", str(budget),
           "--block-size", str(block_size), "--capacity-blocks", str(blocks),
           "--threads", str(threads),
           "--full-last-layer" if full_last_layer else "--no-full-last-layer"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=7200)
    if done.returncode != 0:
        raise RuntimeError(f"WavePP exited with {done.returncode}: {done.stderr[-3000:]}")
    record = json.loads(out.read_text())
    by_id = {r["id"]: r for r in record["requests"]}
    measured = [by_id[f"p{i}"] for i in range(len(job.measured))]
    kernel = sorted({m.group(1) for m in re.finditer(r"attention by (.+)", done.stderr)})
    return {
        "tok_s": record["throughput_tok_s"], "seconds": record["makespan_s"],
        "input_tokens": record["input_tokens"],
        "first_tokens": [r["first_token"] for r in measured],
        "cached_tokens": [r["cached_tokens"] for r in measured],
        "cpu_steal_share": record["cpu_steal_share"],
        "stage_utilization": record["stage_utilization"], "attention_kernel": kernel,
        "failed": record["failed_requests"] + record["rejected_requests"]
        + record["unfinished_requests"],
    }  # fmt: skip
