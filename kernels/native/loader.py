"""Building and loading the native CPU kernels (see kernels/native/__init__.py).

`library()` compiles every `*.c` source of this directory with the host's
`cc` into one shared library under `<tmp>/pdserve-native-<uid>/` (named by a
hash of the sources, flags, compiler and CPU; written aside and renamed into
place), loads it with ctypes and declares the C signatures. None, with one
WARNING, when there is no compiler or the build or load fails.
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

log = logging.getLogger(__name__)

SOURCES = tuple(sorted(Path(__file__).parent.glob("*.c")))
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))
# Reassociation lets gcc vectorise the dot products and sums; no
# -ffinite-math-only, so the -inf of an empty max and NaNs keep their meaning.
CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math",
          "-fno-signed-zeros", "-fassociative-math", "-fPIC", "-shared", "-fopenmp")
BUILD_TIMEOUT_S = 120

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
# name: argument types (every function returns an int status, 0 = success).
SIGNATURES = {
    "pdserve_paged_decode_attention": [_P, _L, _P, _P, _P, _P] + [_I] * 8
    + [_L, _I, _F, _F, _I],
    "pdserve_rms_norm": [_P, _L, _P, _L, _P, _P, _P, _L, _L, _F, _I, _I],
    "pdserve_rotary_embedding": [_P, _P, _L, _P, _L, _P, _P, _L, _L, _L, _L, _P, _L, _I, _I],
    "pdserve_inject_kv": [_P, _P, _L, _L, _P, _L, _L, _L],
    "pdserve_silu_and_mul": [_P, _L, _P, _L, _L, _I, _I],
    "pdserve_decode_qkv_attention": [_P, _L, _P, _P, _P, _P, _L, _P, _P, _P] + [_I] * 8
    + [_L, _I, _F, _F, _I],
    "pdserve_gemm_available": [],
    "pdserve_gemm_panels": [_P, _L, _L, _P, _L, _L, _P, _P, _L, _I],
    "pdserve_gemm_bf16_available": [],
    "pdserve_gemm_bf16_pairs": [],
    "pdserve_gemm_panels_bf16": [_P, _L, _L, _P, _L, _L, _P, _P, _L, _I],
    "pdserve_prefill_attention_available": [],
    "pdserve_prefill_attention": [_P, _L, _P, _L, _P, _L, _P, _L] + [_I] * 7 + [_F, _I],
    "pdserve_logit_stats": [_P, _L, _L, _L, _P, _P, _P, _I],
    "pdserve_decode_layer": [_P, _P, _F, _F, _F],
}


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
    for part in (*(p.read_bytes() for p in SOURCES + HEADERS), " ".join(CFLAGS).encode(),
                 version.encode(), _cpu_signature().encode(), platform.machine().encode()):
        key.update(part)
        key.update(b"\0")
    cache_dir = cache_dir or default_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / f"pdserve-native-{key.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    fd, scratch = tempfile.mkstemp(suffix=".so", dir=cache_dir)
    os.close(fd)
    try:
        result = subprocess.run([compiler, *CFLAGS, *map(str, SOURCES), "-o", scratch, "-lm"],
                                capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed on kernels/native: "
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
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = argtypes
    return lib
