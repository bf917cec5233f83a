"""WavePP's CPU attention kernel (``cpu_attention.cpp``) and fused token-wise ops
(``cpu_fused.cpp``), PyTorch ops built on first use.

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

The source is a C++ extension registering the op ``torch.ops.wavepp.paged_attention``
(with ``wavepp::bf16_paths`` and ``wavepp::amx_init``): its schema has torch check the
arguments' types, the kernel checks their shapes and the block tables, and its work
items run on torch's intra-op threads (``at::parallel_for``, ``torch.get_num_threads()``
of them). :class:`KernelBuild` compiles it once per machine with
``torch.utils.cpp_extension`` (ninja; ``-O3 -march=native -fopenmp``) into
``$WAVEPP_CACHE/kernels/<key>`` (default ``~/.cache/wavepp``), the key a hash of the
sources (and ``cpu_simd.h``, which they share), the compiler, the flags, torch's version
and the CPU:

- ranks that start together build once: the others wait on the build's lock
  (``cpu_kernel_build.py``);
- the build runs in a subprocess killed after ``WAVEPP_CPU_KERNEL_BUILD_TIMEOUT_S``
  (default 300 s), so a hung compiler cannot hang a rank;
- a failed build is remembered in ``<key>/FAILED`` and not retried by later starts
  (delete the file to try again); a library that does not load is rebuilt once;
- nothing is loaded from the cache unless the cache, its ``kernels`` directory, the
  build's directory and the library belong to this user and are writable by no one
  else.

The same library holds a layer's token-wise work, each op one pass over its rows
(``cpu_fused.cpp``): :func:`rms_norm`, :func:`rope_` (in place) and :func:`silu_mul`,
rounding where PyTorch's own sequence of kernels rounds. The layers call them for CPU
tensors in fp32 or bf16 (:func:`fused_fits`) and run their PyTorch forms otherwise.

Where it cannot be had (no compiler, no AVX-512, a build error or timeout, a cache
directory refused) the reason is logged once, in one line, and the PyTorch path serves.
``WAVEPP_CPU_KERNEL=0`` turns the attention kernel off, ``WAVEPP_CPU_FUSED=0`` the fused
ops (benchmarks compare each with PyTorch's that way).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import signal
import stat
import subprocess
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
# the library's sources: attention, and the fused token-wise ops; the header they share
SOURCES = (SOURCE, Path(__file__).with_name("cpu_fused.cpp"))
HEADERS = (Path(__file__).with_name("cpu_simd.h"),)
BUILDER = Path(__file__).with_name("cpu_kernel_build.py")
NAME = "wavepp_cpu_attention"  # the library's name, and the build's
# -fopenmp: at::parallel_for runs on torch's OpenMP threads only in code built with it
FLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)
BUILD_TIMEOUT_S = 300.0
_OFF: list[bool] = []  # set inside :func:`off`

_DTYPES = (torch.float32, torch.bfloat16)  # the element types the kernel serves
BF16_PATHS = ("amx", "dot", "convert")  # fastest first; the C++ side's AMX, DOT, CONVERT
_PATH_CODES = {"convert": 0, "dot": 1, "amx": 2}


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


_FUSED_OFF: list[bool] = []  # set inside :func:`fused_off`


@contextlib.contextmanager
def fused_off():
    """The layers' PyTorch forms instead of the fused ops inside this block."""
    _FUSED_OFF.append(True)
    try:
        yield
    finally:
        _FUSED_OFF.pop()


class KernelUnavailable(RuntimeError):
    """Why the kernel cannot serve in this process (the PyTorch path serves instead)."""


def _cpu_id() -> bytes:
    """This machine's CPU model and instruction-set flags (``-march=native`` builds for
    them, so a cache shared by other machines must not hand their builds to this one)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor().encode()
    wanted = [ln for ln in lines if ln.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(wanted)).encode()


def _check_private(path: Path) -> None:
    """Refuses ``path`` unless this user owns it and no one else may write it: a library
    loaded from a directory others can write runs their code in this process."""
    st = path.stat()
    if st.st_uid != os.getuid():
        raise KernelUnavailable(
            f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}); "
            "nothing is loaded from it"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise KernelUnavailable(
            f"{path} is writable by its group or others (mode {stat.filemode(st.st_mode)}); "
            f"nothing is loaded from it (chmod go-w {path})"
        )


class KernelBuild:
    """The kernel's library in a private cache directory, built there at most once for
    one source, compiler, set of flags, torch and CPU (see the module).

    ``cache``: the cache's root (``$WAVEPP_CACHE``); ``compiler``: the C++ compiler
    (``$CXX``, else ``c++``, as ``torch.utils.cpp_extension`` picks it)."""

    def __init__(self, cache: Path, compiler: str, cflags: tuple[str, ...] = FLAGS,
                 timeout_s: float = BUILD_TIMEOUT_S) -> None:  # fmt: skip
        self.cache = cache
        self.compiler = compiler
        self.cflags = tuple(cflags)
        self.timeout_s = timeout_s

    @classmethod
    def from_env(cls) -> KernelBuild:
        root = os.environ.get("WAVEPP_CACHE") or Path.home() / ".cache" / "wavepp"
        raw = os.environ.get("WAVEPP_CPU_KERNEL_BUILD_TIMEOUT_S") or str(BUILD_TIMEOUT_S)
        try:
            timeout_s = float(raw)
        except ValueError:
            raise ValueError(f"WAVEPP_CPU_KERNEL_BUILD_TIMEOUT_S={raw!r}: give seconds") from None
        return cls(Path(root), os.environ.get("CXX") or "c++", timeout_s=timeout_s)

    def directory(self) -> Path:
        """This build's directory, made private if new, refused if not private."""
        kernels = self.cache / "kernels"
        kernels.mkdir(mode=0o700, parents=True, exist_ok=True)
        for path in (self.cache, kernels):
            _check_private(path)
        directory = kernels / f"{NAME}-{self._key()}"
        directory.mkdir(mode=0o700, exist_ok=True)
        _check_private(directory)
        return directory

    def _key(self) -> str:
        try:
            version = subprocess.run([self.compiler, "--version"], capture_output=True,
                                     text=True, timeout=30).stdout  # fmt: skip
        except (OSError, subprocess.SubprocessError) as error:
            raise KernelUnavailable(f"no C++ compiler ({self.compiler}: {error})") from error
        parts = [*(f.read_bytes() for f in SOURCES + HEADERS), BUILDER.read_bytes(),
                 version.encode(),
                 " ".join(self.cflags + LDFLAGS).encode(), torch.__version__.encode(),
                 sys.implementation.cache_tag.encode(), _cpu_id()]  # fmt: skip
        return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]

    def library(self) -> Path:
        """The built library: found, or built now (waiting for a build already under way
        in another process). Raises :class:`KernelUnavailable`."""
        directory = self.directory()
        if failure := self._failure(directory):
            raise failure
        library = directory / f"{NAME}.so"
        if not library.exists() or (directory / "lock").exists():
            self._build(directory)
        _check_private(library)
        return library

    def _build(self, directory: Path) -> None:
        try:
            import ninja  # cpp_extension runs the ninja on PATH; this one is a dependency
        except ImportError as error:
            raise KernelUnavailable(f"ninja is not installed ({error})") from error
        spec = {"name": NAME, "sources": [str(s) for s in SOURCES], "directory": str(directory),
                "cflags": list(self.cflags), "ldflags": list(LDFLAGS)}  # fmt: skip
        env = {**os.environ, "CXX": self.compiler,
               "PATH": os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])}  # fmt: skip
        with subprocess.Popen([sys.executable, str(BUILDER), json.dumps(spec)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) as builder:  # fmt: skip
            try:
                output, _ = builder.communicate(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                _kill_tree(builder.pid)  # the builder, ninja, the compiler and its parts
                builder.communicate()
                took = f"{self.timeout_s:g} s (WAVEPP_CPU_KERNEL_BUILD_TIMEOUT_S)"
                raise self.remember(directory, f"the build took longer than {took}") from None
        if builder.returncode:
            failure = self._failure(directory)  # the builder's own account, if it could
            raise failure or self.remember(directory, f"the build failed: {output.strip()[-300:]}")

    def _failure(self, directory: Path) -> KernelUnavailable | None:
        failed = directory / "FAILED"
        if not failed.exists():
            return None
        return KernelUnavailable(f"{failed.read_text().strip()} (a failed build, remembered "
                                 f"in {failed}: delete it to try again)")  # fmt: skip

    def remember(self, directory: Path, reason: str) -> KernelUnavailable:
        """Records ``reason`` as the build's failure in ``directory`` (later starts do not
        retry it); the error to raise."""
        written = directory / f"FAILED.{os.getpid()}"
        written.write_text(reason + "\n")
        written.replace(directory / "FAILED")
        return self._failure(directory)

    def discard(self, library: Path, seen: os.stat_result) -> None:
        """Removes a build whose library (``seen`` when it would not load) did not load,
        so that the next :meth:`library` builds it afresh; unless another process is
        building it now, or has already replaced it."""
        directory = library.parent
        with open(directory / "build.flock", "a") as held:
            try:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return
            now = library.stat() if library.exists() else None
            if now is None or (now.st_ino, now.st_mtime_ns) != (seen.st_ino, seen.st_mtime_ns):
                return
            for entry in directory.iterdir():
                if entry.name != "build.flock":
                    entry.unlink()


def _children() -> dict[int, list[int]]:
    """Every process's children, by parent (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    return children


def _kill_tree(pid: int) -> None:
    """Kills ``pid`` and every process under it. Ninja runs each command in a process
    group of its own, so the builder's group alone would leave a hung compiler running:
    the tree is stopped first (nothing in it forks or is reparented meanwhile), then
    killed."""
    stopped: set[int] = set()
    frontier = {pid}
    while frontier:
        for p in frontier:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGSTOP)
        stopped |= frontier
        children = _children()
        frontier = {c for p in stopped for c in children.get(p, [])} - stopped
    for p in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def _load_ops(build: KernelBuild) -> None:
    """Loads the kernel's ops into this process (once: a library is never unloaded)."""
    library = build.library()
    try:
        torch.ops.load_library(str(library))
    except OSError as error:
        log.warning("CPU attention kernel %s does not load (%s); rebuilding it once",
                    library, error)  # fmt: skip
        build.discard(library, library.stat())
        library = build.library()
        try:
            torch.ops.load_library(str(library))
        except OSError as again:
            raise build.remember(
                library.parent, f"the rebuilt {library} does not load either: {again}"
            ) from again
    for op in ("paged_attention", "rms_norm", "rope_", "silu_mul", "silu_mul_"):
        if not hasattr(torch.ops.wavepp, op):  # loaded, so not rebuilt here
            build.discard(library, library.stat())  # built afresh once FAILED is deleted
            raise build.remember(library.parent, f"{library} does not register the op "
                                 f"wavepp::{op}")  # fmt: skip


@functools.cache
def unavailable() -> str | None:
    """Why the kernel cannot serve in this process, or None when it can (built and loaded
    here on the first call)."""
    try:
        _load_ops(KernelBuild.from_env())
    except (KernelUnavailable, OSError) as error:  # OSError: a cache it cannot write
        log.warning("CPU attention kernel unavailable (%s); using PyTorch's kernels", error)
        return str(error)
    return None


def available() -> bool:
    """Whether the kernel serves in this process (built and loaded on the first call)."""
    return unavailable() is None


@functools.cache
def _bf16_paths() -> int:
    """The bf16 paths the build has, a bit per path code."""
    return torch.ops.wavepp.bf16_paths()


@functools.cache
def _amx() -> bool:
    """Whether Linux lent this process the AMX tiles (asked once)."""
    return torch.ops.wavepp.amx_init()


def _has(path: str) -> bool:
    """Whether the built kernel can run bf16 by ``path`` in this process."""
    if not available():
        return False
    if path == "convert":
        return True
    if not _bf16_paths() >> _PATH_CODES[path] & 1:
        return False
    return path != "amx" or _amx()


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
    if not available():
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
        and available()
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
                    path: str | None = None) -> torch.Tensor:  # fmt: skip
    """q [T, H, D]; pools [rows, KV, D] / [rows, KV, Dv] -> [T, H, Dv] (see the module),
    in q's dtype, by the op ``wavepp::paged_attention`` (a block table naming a slot
    outside the pools raises ValueError). ``path``: how bf16 is multiplied (None:
    :func:`bf16_path`); one this machine lacks falls back to ``convert``."""
    bf16 = q.dtype == torch.bfloat16
    path = (path or bf16_path()) if bf16 else "convert"
    code = _PATH_CODES[path] if _has(path) else _PATH_CODES["convert"]
    return torch.ops.wavepp.paged_attention(q, k_pool, v_pool, seqs, tables, block_size, scale,
                                            code)  # fmt: skip


# -- the fused token-wise ops (cpu_fused.cpp) ----------------------------------------


def fused_fits(*tensors: torch.Tensor) -> bool:
    """Whether the fused ops serve these tensors: all on the CPU, all fp32 or all bf16,
    gradients off (the ops have no backward), unless ``WAVEPP_CPU_FUSED=0`` or inside
    :func:`fused_off` (else the caller runs its PyTorch form)."""
    first = tensors[0]
    return (
        not torch.is_grad_enabled()
        and not _FUSED_OFF
        and first.device.type == "cpu"
        and first.dtype in _DTYPES
        and all(t.device.type == "cpu" and t.dtype == first.dtype for t in tensors)
        and os.environ.get("WAVEPP_CPU_FUSED", "1") not in ("0", "false", "off", "")
        and available()
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    """x: [..., d] -> ``weight * x / rms(x)`` (``offset``: ``(1 + weight) * ...``) in one
    pass, as ``wavepp.model.common.RMSNorm`` computes it."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[-1] > 1 and rows.stride(-1) != 1:
        rows = rows.contiguous()
    return torch.ops.wavepp.rms_norm(rows, weight.contiguous(), eps, offset).view(x.shape)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of x: [tokens, heads, d] in place (its last dim
    contiguous); cos, sin: [tokens, 1, w] (``wavepp.model.common.rope_tables``). Returns x."""
    torch.ops.wavepp.rope_(x, cos[:, 0], sin[:, 0])
    return x


def silu_mul(gate_up: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """gate_up: [rows, 2 f], gate then up -> ``silu(gate) * up`` [rows, f] in one pass;
    ``in_place``: written over the gate half, and that view returned (rows strided)."""
    if in_place:
        torch.ops.wavepp.silu_mul_(gate_up)
        return gate_up[:, : gate_up.shape[1] // 2]
    return torch.ops.wavepp.silu_mul(gate_up)
