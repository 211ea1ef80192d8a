"""Native CPU kernels: C sources built with the host's C compiler at first use.

Why C: at decode batch sizes a CPU step pays for work torch ops cannot
avoid. Decode attention through torch must first gather each sequence's
scattered blocks into a contiguous copy, then read it again in SDPA
(`kernels.cpu_attention`); `paged_decode.c` reads every K/V row once, in
place, in the cache's own dtype. `prefill_attention.c` is a prompt's causal
attention, flash-style, 1.4-2.3x torch's CPU flash SDPA, reading q inside
the qkv projection's rows instead of transposed copies. `gemm.c` is every
dense projection of a float32 model (weights packed in 16-column panels):
decode rows, which oneDNN's small-batch kernel leaves at half the read
bandwidth, and prefill rows on 6-row tiles (`pack_panels`, `gemm_panels`);
`gemm_bf16.c` the same from bfloat16 panels, widened in registers, for CPUs
where oneDNN has no bfloat16 linear, or k in pairs with AVX512-BF16
(`pack_panels_bf16`, `gemm_panels_bf16`). RMSNorm and RoPE are 8-10 small
torch ops each, whose dispatch costs more than their arithmetic, and the
KV inject's skip of padding slots is a boolean-mask gather and scatter;
`elementwise.c` does each in one call. `fused.c` goes further for the decode step: SwiGLU's
split/silu/multiply in one call, and split + RoPE + KV write + decode
attention from the qkv projection's output in one (`kernels.fused`). Same
contracts as the `kernels.dispatch` / `kernels.fused` ops, which pick these
for CPU tensors under backend ``auto`` when `supports_*` says so.

The Python side: this package wraps the attention, norm, RoPE, inject and
fused calls; `gemm.py` the GEMM's packing and calls; `calls.py` what every
wrapper shares (dtype and error codes, profiler labels); `loader.py` builds
the library. Callers use the names re-exported here.

Building (kernels/native/loader.py): ~0.3 s with `cc -O3 -march=native` (the
CPU the pod runs on), cached by content; no compiler or a failed build means
`library()` is None, one WARNING, and the torch paths. Nothing here reads the
environment.

The C functions are called through ctypes, which releases the GIL for the
call, so other Python threads (gRPC, the KV injector) run meanwhile.
"""

from __future__ import annotations

import functools

import torch

from kernels.native.calls import DTYPE_CODES, NativeKernelError, check, profiled, rows_ok
from kernels.native.gemm import (
    PANEL,
    gemm_available,
    gemm_bf16_available,
    gemm_bf16_pairs,
    gemm_panels,
    gemm_panels_bf16,
    pack_panels,
    pack_panels_bf16,
)
from kernels.native.loader import build, default_cache_dir, library
from kernels.native.sampling import logit_stats, supports_logit_stats

__all__ = ["NativeKernelError", "DecodeQKVCall", "PANEL", "build", "default_cache_dir",
           "gemm_available", "gemm_bf16_available", "gemm_bf16_pairs", "gemm_panels",
           "gemm_panels_bf16",
           "inject_kv", "library", "logit_stats", "pack_panels", "pack_panels_bf16",
           "paged_decode_attention", "prefill_attention", "prefill_attention_available",
           "rms_norm", "rotary_embedding", "silu_and_mul", "supports", "supports_inject",
           "supports_logit_stats",
           "supports_prefill_attention", "supports_qkv", "supports_rms_norm", "supports_rotary"]

PROFILER_NAME = "pdserve_native::paged_decode_attention"
PREFILL_PROFILER_NAME = "pdserve_native::prefill_attention"
PREFILL_HEAD_DIMS = range(16, 257, 16)  # what prefill_attention.c takes


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
                           softcap: float | None = None,
                           num_threads: int | None = None) -> torch.Tensor:
    """Same contract as `kernels.dispatch.paged_decode_attention`, for tensors
    `supports()` accepts; `num_threads` (OpenMP threads of torch's own pool)
    defaults to torch's intra-op threads.
    Raises NativeKernelError (never reads out of bounds) when a context length
    exceeds its block table or a used block id is out of range."""
    lib = library()
    if lib is None:
        raise NativeKernelError("native CPU kernels are unavailable (see the log)")
    if not rows_ok(q):
        q = q.contiguous()
    # The runner's tables are views of wider persistent rows: passed with
    # their row stride, not copied once per layer.
    tables = block_tables.to(torch.int32)
    if tables.shape[1] > 1 and tables.stride(1) != 1:
        tables = tables.contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty(q.shape, dtype=q.dtype)
    batch, num_q_heads, head_dim = q.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    if batch == 0:
        return out
    # Named for torch.profiler (the step breakdown of `pdserve bench engine`),
    # which cannot see inside a ctypes call.
    with profiled(PROFILER_NAME):
        code = lib.pdserve_paged_decode_attention(
            q.data_ptr(), q.stride(0), kv_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
            out.data_ptr(), DTYPE_CODES[q.dtype], batch, num_q_heads, num_kv_heads, head_dim,
            num_blocks, block_size, tables.shape[1], tables.stride(0), sliding_window or 0, scale,
            softcap or 0.0, num_threads or torch.get_num_threads())
    check(code, "paged decode attention")
    return out


def supports_rms_norm(x: torch.Tensor, weight: torch.Tensor,
                      residual: torch.Tensor | None) -> bool:
    return (rows_ok(x) and weight.dtype == x.dtype and weight.is_contiguous()
            and (residual is None or (rows_ok(residual) and residual.dtype == x.dtype))
            and library() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
             residual_out: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `kernels.dispatch.rms_norm` (arguments already
    checked; `out` / `residual_out` contiguous, and may be x / residual)."""
    rows, hidden = x.shape
    if out is None:
        out = torch.empty((rows, hidden), dtype=x.dtype)
    if residual is not None and residual_out is None:
        residual_out = torch.empty((rows, hidden), dtype=x.dtype)
    if rows:
        check(library().pdserve_rms_norm(
            x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
            0 if residual is None else residual.stride(0), weight.data_ptr(), out.data_ptr(),
            None if residual is None else residual_out.data_ptr(), rows, hidden, eps,
            DTYPE_CODES[x.dtype], torch.get_num_threads()), "rms_norm")
    return out if residual is None else (out, residual_out)


def supports_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                    cos_sin_cache: torch.Tensor) -> bool:
    return (rows_ok(q) and rows_ok(k) and k.dtype == q.dtype
            and positions.dtype == torch.int64 and positions.device.type == "cpu"
            and cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous()
            and library() is not None)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `kernels.dispatch.rotary_embedding` (arguments already
    checked); a position outside the cache raises NativeKernelError."""
    lib = library()
    positions = positions.contiguous()
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
    rows, q_heads, head_dim = q.shape
    if rows:
        check(lib.pdserve_rotary_embedding(
            positions.data_ptr(), q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0),
            q_out.data_ptr(), k_out.data_ptr(), rows, q_heads, k.shape[1], head_dim,
            cos_sin_cache.data_ptr(), cos_sin_cache.shape[0], DTYPE_CODES[q.dtype],
            torch.get_num_threads()), "rotary_embedding")
    return q_out, k_out


def supports_inject(kv_cache: torch.Tensor, src: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """CPU, one dtype, a contiguous cache, src [2, T, Hkv, D] with each row's
    Hkv * D elements contiguous, int64 slots."""
    return (kv_cache.device.type == "cpu" and kv_cache.is_contiguous()
            and src.dtype == kv_cache.dtype and src.device.type == "cpu"
            and src.stride(3) == 1 and src.stride(2) == src.shape[3]
            and slot_mapping.dtype == torch.int64 and slot_mapping.device.type == "cpu"
            and library() is not None)


def inject_kv(kv_cache: torch.Tensor, src: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Same contract as `kernels.dispatch.inject_kv` (arguments already
    checked); a slot past the cache raises NativeKernelError, writing nothing."""
    lib = library()
    slots = slot_mapping.contiguous()
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    size = src.element_size()
    check(lib.pdserve_inject_kv(
        kv_cache.data_ptr(), src.data_ptr(), src.stride(0) * size, src.stride(1) * size,
        slots.data_ptr(), slots.shape[0], num_kv_heads * head_dim * size,
        num_blocks * block_size), "inject_kv")


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `kernels.fused.silu_and_mul`, for `_rows_ok` 2-D x
    (arguments already checked); `out` contiguous [N, I] if given."""
    rows, width = x.shape
    if out is None:
        out = torch.empty((rows, width // 2), dtype=x.dtype)
    if rows:
        check(library().pdserve_silu_and_mul(
            x.data_ptr(), x.stride(0), out.data_ptr(), rows, width // 2, DTYPE_CODES[x.dtype],
            torch.get_num_threads()), "silu_and_mul")
    return out


def supports_qkv(qkv: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether `decode_qkv_attention` takes these: as `supports`, for the
    qkv rows [B, (Hq + 2 Hkv) * D] (each row contiguous)."""
    return (qkv.device.type == "cpu" and kv_cache.device.type == "cpu"
            and qkv.dtype == kv_cache.dtype and qkv.dtype in DTYPE_CODES
            and qkv.stride(-1) == 1 and kv_cache.shape[-1] % 16 == 0
            and kv_cache.is_contiguous() and library() is not None)


class DecodeQKVCall:
    """`kernels.fused.decode_qkv_attention` bound to one decode step's
    arguments (already checked, with `supports_qkv`): `call(qkv, kv_cache) ->
    out [B, Hq, D]` for qkv [B, (Hq + 2 Hkv) * D] and a cache of
    `kv_cache_shape`, both of `dtype`, which the caller has checked too.
    A call raises NativeKernelError, having written nothing, for a position
    outside the cos/sin cache or a slot past the cache, and (never reading out
    of bounds) for a context length above its table or a used block id out
    of range."""

    def __init__(self, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, *, num_q_heads: int,
                 kv_cache_shape: tuple[int, ...], dtype: torch.dtype, scale: float,
                 sliding_window: int | None = None, softcap: float | None = None,
                 num_threads: int | None = None) -> None:
        # Held so the pointers below stay valid while the call is bound.
        self._tensors = (positions.contiguous(), cos_sin_cache, slot_mapping.contiguous(),
                         block_tables, context_lens.contiguous())
        positions, cos_sin_cache, slots, tables, lens = self._tensors
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache_shape
        self._lib = library()
        self._dtype = dtype
        self._out_shape = (positions.shape[0], num_q_heads, head_dim)
        self._step_args = (
            positions.data_ptr(), cos_sin_cache.data_ptr(), cos_sin_cache.shape[0],
            slots.data_ptr(), tables.data_ptr(), lens.data_ptr(), DTYPE_CODES[dtype],
            positions.shape[0], num_q_heads, num_kv_heads, head_dim, num_blocks, block_size,
            tables.shape[1], tables.stride(0), sliding_window or 0, scale, softcap or 0.0,
            num_threads or torch.get_num_threads())

    def __call__(self, qkv: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self._out_shape, dtype=self._dtype)
        if self._out_shape[0]:
            with profiled(PROFILER_NAME):
                code = self._lib.pdserve_decode_qkv_attention(
                    qkv.data_ptr(), qkv.stride(0), kv_cache.data_ptr(), out.data_ptr(),
                    *self._step_args)
            check(code, "decode qkv attention")
        return out


@functools.cache
def prefill_attention_available() -> bool:
    """Whether `prefill_attention` runs here: the library built, for a CPU with AVX2 and FMA."""
    lib = library()
    return lib is not None and bool(lib.pdserve_prefill_attention_available())


def _heads_ok(t: torch.Tensor) -> bool:
    """[rows, heads, D] with each row's heads D apart and each head contiguous."""
    return t.dim() == 3 and t.stride(2) == 1 and (t.shape[1] == 1 or t.stride(1) == t.shape[2])


def supports_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `prefill_attention` takes these: CPU tensors of one native
    dtype, [n, Hq, D] and [L, Hkv, D] with L >= n, Hq a multiple of Hkv, D a
    multiple of 16 up to 256, each row's heads contiguous (rows may be
    strided), and a library that built for AVX2 + FMA."""
    return (q.device.type == "cpu" and k.device.type == "cpu" and v.device.type == "cpu"
            and q.dtype in DTYPE_CODES and k.dtype == q.dtype and v.dtype == q.dtype
            and _heads_ok(q) and _heads_ok(k) and _heads_ok(v) and k.shape == v.shape
            and q.shape[2] == k.shape[2] and q.shape[2] in PREFILL_HEAD_DIMS
            and k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0 and k.shape[0] >= q.shape[0]
            and prefill_attention_available())


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                      sliding_window: int | None = None, out: torch.Tensor | None = None,
                      num_threads: int | None = None) -> torch.Tensor:
    """Causal attention of the last n = len(q) of L = len(k) positions over
    all L keys: q [n, Hq, D], k and v [L, Hkv, D] -> [n, Hq, D] in q's dtype
    (float32 arithmetic), written to `out` when given. Query i sits at
    position L - n + i and sees keys j <= L - n + i (and j > L - n + i -
    sliding_window); query head h reads KV head h // (Hq // Hkv). Each row's
    result is bit-identical for any n, chunking or thread count.

    Raises ValueError for tensors `supports_prefill_attention` refuses, and
    NativeKernelError if the kernel does."""
    if not supports_prefill_attention(q, k, v):
        raise ValueError(
            f"prefill_attention does not take q {q.dtype} {tuple(q.shape)} {q.stride()}, "
            f"k {k.dtype} {tuple(k.shape)} {k.stride()}, v {v.dtype} {tuple(v.shape)} "
            f"{v.stride()} on {q.device} (see supports_prefill_attention)")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    num_new, num_q_heads, head_dim = q.shape
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype)
    elif out.shape != q.shape or out.dtype != q.dtype or not _heads_ok(out):
        raise ValueError(f"out must be {q.dtype} {tuple(q.shape)} with each row's heads "
                         f"contiguous, got {out.dtype} {tuple(out.shape)} {out.stride()}")
    if num_new == 0:
        return out
    with profiled(PREFILL_PROFILER_NAME):
        code = library().pdserve_prefill_attention(
            q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
            out.data_ptr(), out.stride(0), DTYPE_CODES[q.dtype], num_new, k.shape[0],
            num_q_heads, k.shape[1], head_dim, sliding_window or 0, scale,
            num_threads or torch.get_num_threads())
    check(code, "prefill attention")
    return out
