"""WavePP's own CPU attention kernel (``cpu_attention.c``), built on first use.

One call per layer runs paged causal attention for every chunk of a wave, fp32 or
bf16, with AVX-512: each new token attends to positions ``0..its own`` read through its
block table, in one online-softmax pass (no log-sum-exp merge of parts, no work above
the diagonal beyond one tile). :func:`wavepp.model.attention.paged_attention` calls it
for the CPU waves it fits (q and pools all fp32 or all bf16) and runs the portable
PyTorch path otherwise.

bf16 pools and queries are read as they are, every sum in fp32, by one of three paths
(:func:`bf16_path`): ``amx``, the AMX tiles (``tdpbf16ps``), where the build has them
and Linux lends them to the process; ``dot``, AVX-512 BF16 (``vdpbf16ps``); both round
P to bf16 for the second product, as FlashAttention does; ``convert``, what the kernel
packs converted to fp32 and the fp32 products. ``WAVEPP_CPU_BF16`` (``auto``, the
default, or ``amx``, ``dot``, ``convert``) picks the first of that one and those after
it in this order that the machine has: the tests force each so that every path is
checked where it exists, ``convert`` on any AVX-512 CPU.

The source is compiled once per machine with the system C compiler (``cc -O3
-march=native -fopenmp``) into ``$WAVEPP_CACHE`` (default ``~/.cache/wavepp``), named
by a hash of the source, the compiler and the flags; ranks that start together each
write their own file and rename it into place. It runs on the OpenMP threads torch
itself uses (torch loads its ``libgomp`` first, and the library shares it), with
``torch.get_num_threads()`` of them.

Where it cannot be had (no compiler, no AVX-512, a build error) the reason is logged
once and the PyTorch path serves. ``WAVEPP_CPU_KERNEL=0`` turns it off (benchmarks
compare the two that way).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_attention.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_LOADED: list[ctypes.CDLL | None] = []
_REASON: list[str] = []
_OFF: list[bool] = []  # set inside :func:`off`


_DTYPES = (torch.float32, torch.bfloat16)  # the element types the kernel serves
BF16_PATHS = ("amx", "dot", "convert")  # fastest first; the C side's AMX, DOT, CONVERT
_PATH_CODES = {"convert": 0, "dot": 1, "amx": 2}
_AMX: list[bool] = []  # whether Linux lent this process the AMX tiles (asked once)


def enabled() -> bool:
    if _OFF:
        return False
    return os.environ.get("WAVEPP_CPU_KERNEL", "1") not in ("0", "false", "off", "")


@contextlib.contextmanager
def off():
    """The PyTorch path inside this block (benchmarks compare the two in one process)."""
    _OFF.append(True)
    try:
        yield
    finally:
        _OFF.pop()


def _cache_dir() -> Path:
    root = os.environ.get("WAVEPP_CACHE") or Path.home() / ".cache" / "wavepp"
    return Path(root) / "kernels"


def _cpu_id() -> bytes:
    """This machine's CPU model and instruction-set flags (``-march=native`` builds for
    them, so a cache shared by other machines must not hand their builds to this one)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor().encode()
    wanted = [ln for ln in lines if ln.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(wanted)).encode()


def _first_error(output: str) -> str:
    lines = output.strip().splitlines()
    errors = [ln for ln in lines if "error" in ln]
    return (errors or lines or ["no output"])[0]


def _build() -> ctypes.CDLL:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    source = SOURCE.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(source + version.encode() + " ".join(FLAGS).encode() + _cpu_id())
    key = key.hexdigest()[:16]
    target = _cache_dir() / f"cpu_attention-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            done = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp],
                                  capture_output=True, text=True)  # fmt: skip
            if done.returncode:
                raise RuntimeError(f"{compiler} failed: {_first_error(done.stderr or done.stdout)}")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(target))
    fn = lib.wavepp_paged_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = (
        [ptr, ptr, ptr, ptr, ptr, i64, ptr] + [i64] * 9 + [ctypes.c_float] + [ctypes.c_int] * 3
    )
    fn.restype = ctypes.c_int
    for name in ("wavepp_bf16_paths", "wavepp_amx_init"):
        getattr(lib, name).argtypes = []
        getattr(lib, name).restype = ctypes.c_int
    return lib


def library() -> ctypes.CDLL | None:
    """The built kernel, or None (and :func:`unavailable` says why)."""
    if not _LOADED:
        try:
            _LOADED.append(_build())
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            _LOADED.append(None)
            _REASON.append(str(error))
            log.warning("CPU attention kernel unavailable (%s); using PyTorch's kernels", error)
    return _LOADED[0]


def unavailable() -> str | None:
    """Why the kernel could not be built, or None when it is available (or untried)."""
    return _REASON[0] if _REASON else None


def _has(path: str) -> bool:
    """Whether the built kernel can run bf16 by ``path`` in this process."""
    lib = library()
    if lib is None:
        return False
    if path == "convert":
        return True
    if not lib.wavepp_bf16_paths() >> _PATH_CODES[path] & 1:
        return False
    if path == "amx":
        if not _AMX:
            _AMX.append(lib.wavepp_amx_init() == 0)
        return _AMX[0]
    return True


def bf16_path() -> str:
    """How bf16 waves are multiplied here: the path ``WAVEPP_CPU_BF16`` asks for (default
    ``auto``: the fastest), or the first after it in :data:`BF16_PATHS` this machine has."""
    wanted = os.environ.get("WAVEPP_CPU_BF16", "auto") or "auto"
    if wanted != "auto" and wanted not in BF16_PATHS:
        raise ValueError(f"WAVEPP_CPU_BF16={wanted!r}; choose auto, {', '.join(BF16_PATHS)}")
    start = 0 if wanted == "auto" else BF16_PATHS.index(wanted)
    return next(p for p in BF16_PATHS[start:] if _has(p))


_BF16_LABELS = {"amx": "AMX tiles, fp32 sums", "dot": "vdpbf16ps, fp32 sums",
                "convert": "converted to fp32"}  # fmt: skip


def describe(device: torch.device, dtype: torch.dtype) -> str:
    """Which kernel serves paged attention for pools on ``device`` in ``dtype`` (built
    here if it is to be)."""
    if device.type != "cpu":
        return "FlashInfer, or PyTorch where it is not installed"
    if dtype not in _DTYPES:
        return f"PyTorch's (WavePP's CPU kernel is fp32 or bf16, the pools are {dtype})"
    if not enabled():
        return "PyTorch's (WAVEPP_CPU_KERNEL=0)"
    if library() is None:
        return f"PyTorch's (WavePP's CPU kernel unavailable: {unavailable()})"
    if dtype == torch.bfloat16:
        return f"WavePP's CPU kernel (AVX-512, bf16: {_BF16_LABELS[bf16_path()]})"
    return "WavePP's CPU kernel (AVX-512, fp32)"


def fits(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """Whether the kernel serves these tensors (else the caller takes the PyTorch path)."""
    return (
        q.device.type == "cpu"
        and q.dtype == k_pool.dtype == v_pool.dtype
        and q.dtype in _DTYPES
        and k_pool.stride(-1) == 1
        and v_pool.stride(-1) == 1
        and v_pool.shape[-1] % 16 == 0
        and k_pool.shape[-1] <= 1024
        and v_pool.shape[-1] <= 1024
        and enabled()
        and library() is not None
    )


def wave_metadata(starts, spans, tables) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence ``[q_offset, num_new, start, table_at]`` and the flat block tables."""
    seqs, flat = [], []
    for (a, b), start, table in zip(spans, starts, tables, strict=True):
        seqs.append([a, b - a, start, len(flat)])
        flat.extend(table)
    return (torch.tensor(seqs, dtype=torch.int64).reshape(-1, 4),
            torch.tensor(flat or [0], dtype=torch.int64))  # fmt: skip


def paged_attention(q, k_pool, v_pool, seqs, tables, block_size: int, scale: float,
                    path: str | None = None):  # fmt: skip
    """q [T, H, D]; pools [rows, KV, D] / [rows, KV, Dv] -> [T, H, Dv] (see the module),
    in q's dtype. ``path``: how bf16 is multiplied (None: :func:`bf16_path`); one this
    machine lacks falls back to ``convert``."""
    slots = k_pool.shape[0] // block_size
    if int(tables.max()) >= slots or int(tables.min()) < 0:
        raise ValueError(f"a block table names a slot outside the pool of {slots} slots")
    q = q.contiguous()
    heads, kv_heads, d_k, d_v = q.shape[1], k_pool.shape[1], k_pool.shape[-1], v_pool.shape[-1]
    out = q.new_empty(q.shape[0], heads, d_v)
    if q.shape[0] == 0:
        return out
    bf16 = q.dtype == torch.bfloat16
    path = (path or bf16_path()) if bf16 else "convert"
    code = _PATH_CODES[path] if _has(path) else 0
    status = library().wavepp_paged_attention(
        q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), out.data_ptr(),
        seqs.data_ptr(), seqs.shape[0], tables.data_ptr(), block_size, heads, kv_heads,
        d_k, d_v, k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        scale, torch.get_num_threads(), int(bf16), code,
    )  # fmt: skip
    if status:
        raise MemoryError("CPU attention kernel could not allocate its scratch memory")
    return out
