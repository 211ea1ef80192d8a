"""Native CPU kernels: C sources built with the host's C compiler when first used.

Why C and not torch ops: a decode step's attention on CPU needs every
sequence's K/V, which the paged cache keeps in scattered blocks. Through
torch ops the blocks are first gathered into a contiguous copy, then read
again by SDPA (`kernels.cpu_attention`); `paged_decode.c` reads each K/V
row once, in place, and works in the cache's own dtype (bfloat16 and
float16 included, which torch's CPU SDPA runs slowly or upcasts).

Build: the first call of `library()` in a process compiles
`paged_decode.c` with `cc -O3 -march=native` (the pod's own CPU: an image
built elsewhere still gets code for the node it runs on) into
`<tmp>/pdserve-native-<uid>/`, named by a hash of the source, the flags, the
compiler and the CPU, so a rebuilt or moved pod never loads a stale or
foreign library; later processes load it from there (~0.3 s to build). The
file appears atomically (written aside, then renamed), so pods starting
together do not see a half-written library.

No compiler, a failed build or a library that does not load: `library()`
returns None once, logs why at WARNING, and callers use the torch path.
Nothing here reads the environment; the cache directory is a parameter of
`build()` for tests.

The C function is called through ctypes, which releases the GIL for the
call, so other Python threads (the pod's gRPC and injector threads) run
while it computes.
"""

from __future__ import annotations

import ctypes
import functools
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

SOURCE = Path(__file__).with_name("paged_decode.c")
# Reassociation lets gcc vectorise the dot products and sums; no
# -ffinite-math-only, so the -inf of an empty max and NaNs keep their meaning.
CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math",
          "-fno-signed-zeros", "-fassociative-math", "-fPIC", "-shared", "-pthread")
BUILD_TIMEOUT_S = 120
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Return codes of pdserve_paged_decode_attention (see paged_decode.c).
_ERRORS = {1: "out of memory", 2: "unsupported shape or dtype",
           3: "a context length or block id is out of range"}


class NativeKernelError(RuntimeError):
    """The native kernel refused its arguments or failed; the message says why."""


def default_cache_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"pdserve-native-{os.getuid()}"


def _compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


def _cpu_signature() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in text.splitlines()
             if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(lines)))


def build(cache_dir: Path | None = None) -> Path:
    """Compile the library if this source/compiler/CPU has none yet; its path.

    Raises RuntimeError naming the compiler's complaint when the build fails."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(CFLAGS).encode(), version.encode(),
                 _cpu_signature().encode(), platform.machine().encode()):
        key.update(part)
        key.update(b"\0")
    cache_dir = cache_dir or default_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / f"paged_decode-{key.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    fd, scratch = tempfile.mkstemp(suffix=".so", dir=cache_dir)
    os.close(fd)
    try:
        result = subprocess.run([compiler, *CFLAGS, str(SOURCE), "-o", scratch, "-lm"],
                                capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed on {SOURCE.name}: "
                               f"{result.stderr.strip()[-2000:]}")
        os.replace(scratch, target)
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, built on first use; None (logged once) if unavailable."""
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("native CPU kernels unavailable, using the torch path: %s", exc)
        return None
    fn = lib.pdserve_paged_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p] * 5 + [ctypes.c_int] * 9
                   + [ctypes.c_float, ctypes.c_int])
    return lib


def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether `paged_decode_attention` takes these: CPU tensors of one of the
    three float dtypes (both the same), head_dim a multiple of 16, a
    contiguous cache, and a library that built."""
    return (q.device.type == "cpu" and kv_cache.device.type == "cpu"
            and q.dtype == kv_cache.dtype and q.dtype in DTYPE_CODES
            and q.shape[-1] % 16 == 0 and q.shape[1] % kv_cache.shape[3] == 0
            and kv_cache.is_contiguous() and library() is not None)


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, *,
                           scale: float, sliding_window: int | None = None,
                           num_threads: int | None = None) -> torch.Tensor:
    """Same contract as `kernels.dispatch.paged_decode_attention`, for tensors
    `supports()` accepts; `num_threads` defaults to torch's intra-op threads.
    Raises NativeKernelError (never reads out of bounds) when a context length
    exceeds its block table or a used block id is out of range."""
    lib = library()
    if lib is None:
        raise NativeKernelError("native CPU kernels are unavailable (see the log)")
    q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    batch, num_q_heads, head_dim = q.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    if batch == 0:
        return out
    code = lib.pdserve_paged_decode_attention(
        q.data_ptr(), kv_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(), out.data_ptr(),
        DTYPE_CODES[q.dtype], batch, num_q_heads, num_kv_heads, head_dim, num_blocks,
        block_size, tables.shape[1], sliding_window or 0, scale,
        num_threads or torch.get_num_threads())
    if code:
        raise NativeKernelError(f"paged decode attention failed: "
                                f"{_ERRORS.get(code, f'error {code}')}")
    return out
