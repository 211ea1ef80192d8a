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

Building (kernels/native/loader.py): ~0.3 s with `cc -O3 -march=native` (the
CPU the pod runs on), cached by content; no compiler or a failed build means
`library()` is None, one WARNING, and the torch paths. Nothing here reads the
environment.

The C functions are called through ctypes, which releases the GIL for the
call, so other Python threads (gRPC, the KV injector) run meanwhile.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from kernels import huge_pages
from kernels.native.loader import build, default_cache_dir, library

__all__ = ["NativeKernelError", "DecodeQKVCall", "PANEL", "build", "default_cache_dir",
           "gemm_available", "gemm_bf16_available", "gemm_bf16_pairs", "gemm_panels",
           "gemm_panels_bf16",
           "inject_kv", "library", "pack_panels", "pack_panels_bf16",
           "paged_decode_attention", "prefill_attention", "prefill_attention_available",
           "rms_norm", "rotary_embedding", "silu_and_mul", "supports", "supports_inject",
           "supports_prefill_attention", "supports_qkv", "supports_rms_norm", "supports_rotary"]

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
PROFILER_NAME = "pdserve_native::paged_decode_attention"
GEMM_PROFILER_NAME = "pdserve_native::gemm_panels"
PREFILL_PROFILER_NAME = "pdserve_native::prefill_attention"
PREFILL_HEAD_DIMS = range(16, 257, 16)  # what prefill_attention.c takes
# Nonzero return codes of the C functions.
_ERRORS = {1: "out of memory", 2: "unsupported shape or dtype",
           3: "a context length, block id or position is out of range"}


class NativeKernelError(RuntimeError):
    """A native kernel refused its arguments or failed; the message says why."""


def _check(code: int, what: str) -> None:
    if code:
        raise NativeKernelError(f"{what} failed: {_ERRORS.get(code, f'error {code}')}")


_NO_LABEL = contextlib.nullcontext()


def _profiled(name: str) -> contextlib.AbstractContextManager:
    """A profiler label for a ctypes call (the step breakdown of `pdserve
    bench engine` cannot see inside one) when a profiler is on: entering
    `record_function` costs microseconds per call even with none running."""
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else _NO_LABEL


def _rows_ok(t: torch.Tensor) -> bool:
    """CPU, a native dtype, and each row's trailing dims contiguous (rows may
    be strided): [N, H] with unit stride, or [N, heads, D] with heads D apart."""
    if t.device.type != "cpu" or t.dtype not in DTYPE_CODES or t.stride(-1) != 1:
        return False
    return t.dim() == 2 or (t.dim() == 3 and (t.shape[1] == 1 or t.stride(1) == t.shape[2]))


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
    if not _rows_ok(q):
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
    with _profiled(PROFILER_NAME):
        code = lib.pdserve_paged_decode_attention(
            q.data_ptr(), q.stride(0), kv_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
            out.data_ptr(), DTYPE_CODES[q.dtype], batch, num_q_heads, num_kv_heads, head_dim,
            num_blocks, block_size, tables.shape[1], tables.stride(0), sliding_window or 0, scale,
            softcap or 0.0, num_threads or torch.get_num_threads())
    _check(code, "paged decode attention")
    return out


def supports_rms_norm(x: torch.Tensor, weight: torch.Tensor,
                      residual: torch.Tensor | None) -> bool:
    return (_rows_ok(x) and weight.dtype == x.dtype and weight.is_contiguous()
            and (residual is None or (_rows_ok(residual) and residual.dtype == x.dtype))
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
        _check(library().pdserve_rms_norm(
            x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
            0 if residual is None else residual.stride(0), weight.data_ptr(), out.data_ptr(),
            None if residual is None else residual_out.data_ptr(), rows, hidden, eps,
            DTYPE_CODES[x.dtype]), "rms_norm")
    return out if residual is None else (out, residual_out)


def supports_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                    cos_sin_cache: torch.Tensor) -> bool:
    return (_rows_ok(q) and _rows_ok(k) and k.dtype == q.dtype
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
        _check(lib.pdserve_rotary_embedding(
            positions.data_ptr(), q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0),
            q_out.data_ptr(), k_out.data_ptr(), rows, q_heads, k.shape[1], head_dim,
            cos_sin_cache.data_ptr(), cos_sin_cache.shape[0], DTYPE_CODES[q.dtype]),
            "rotary_embedding")
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
    _check(lib.pdserve_inject_kv(
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
        _check(library().pdserve_silu_and_mul(
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
            with _profiled(PROFILER_NAME):
                code = self._lib.pdserve_decode_qkv_attention(
                    qkv.data_ptr(), qkv.stride(0), kv_cache.data_ptr(), out.data_ptr(),
                    *self._step_args)
            _check(code, "decode qkv attention")
        return out


PANEL = 16  # output columns per panel of a packed weight (gemm.c)


def gemm_available() -> bool:
    """Whether `gemm_panels` runs here: the library built, for a CPU with AVX2 and FMA."""
    lib = library()
    return lib is not None and bool(lib.pdserve_gemm_available())


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """A float32 weight [N, K] (F.linear's layout) as gemm.c's panels
    [ceil(N / 16), K, 16]: panel j holds output columns 16 j .. 16 j + 15,
    K-major, zero past N."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(f"pack_panels takes a float32 CPU weight [N, K], got "
                         f"{weight.dtype} {tuple(weight.shape)} on {weight.device}")
    return _panels(weight)


def _by_panel(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] as [ceil(N / 16), 16, K], zero past N."""
    n, k = weight.shape
    num_panels = -(-n // PANEL)
    padded = weight.new_zeros(num_panels * PANEL, k)
    padded[:n] = weight
    return padded.view(num_panels, PANEL, k)


def _panels(weight: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """weight [N, K] as [ceil(N / 16), K, 16], zero past N; `order`: the
    column each position of a panel row holds (natural order if None)."""
    panels = _by_panel(weight)
    if order is not None:
        panels = panels[:, torch.tensor(order)]
    # Streamed whole by every decode step: on huge pages (kernels/huge_pages.py).
    return huge_pages.copy_of(panels.transpose(1, 2))


def gemm_panels(x: torch.Tensor, panels: torch.Tensor, out_features: int,
                bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                num_threads: int | None = None) -> torch.Tensor:
    """x [M, K] float32 (rows may be strided) @ the packed weight's
    transpose (+ bias): [M, out_features], written to `out` (rows contiguous,
    may be strided apart) when given. Each output element is one
    multiply-add chain over K in order: a row's result does not depend on
    M or on the thread count."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"gemm_panels takes float32 CPU rows [M, K], got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, in_features = x.shape
    if panels.shape[1] != in_features or panels.shape[0] * PANEL < out_features:
        raise ValueError(f"x has {in_features} features; panels {tuple(panels.shape)} "
                         f"do not hold a [{out_features}, {in_features}] weight")
    if out is None:
        out = torch.empty((rows, out_features), dtype=torch.float32)
    elif out.shape != (rows, out_features) or out.stride(1) != 1:
        raise ValueError(f"out must be [{rows}, {out_features}] with contiguous rows")
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    with _profiled(GEMM_PROFILER_NAME):
        code = library().pdserve_gemm_panels(
            x.data_ptr(), x.stride(0), rows, panels.data_ptr(), in_features, out_features,
            None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
            num_threads or torch.get_num_threads())
    _check(code, "gemm_panels")
    return out


# Where pack_panels_bf16 puts column c of a panel row: the two unpacks of
# gemm_bf16.c against zero turn positions 0-3, 8-11 into columns 0-7 and
# positions 4-7, 12-15 into columns 8-15 (position p holds column _BF16_ORDER[p]).
_BF16_ORDER = (0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15)


def gemm_bf16_available() -> bool:
    """Whether `gemm_panels_bf16` runs here (the library built, AVX2 and FMA)."""
    lib = library()
    return lib is not None and bool(lib.pdserve_gemm_bf16_available())


@functools.cache
def gemm_bf16_pairs() -> bool:
    """Whether gemm_bf16.c multiplies k in pairs here (AVX512-BF16's
    `vdpbf16ps`), for weights whose K is even: their panels then hold each
    panel row pair's 16 columns interleaved (`pack_panels_bf16`)."""
    lib = library()
    return lib is not None and bool(lib.pdserve_gemm_bf16_pairs())


def pack_panels_bf16(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 weight [N, K] as gemm_bf16.c's panels [ceil(N / 16), K, 16]
    (bfloat16). Where `gemm_bf16_pairs()` and K is even, panel j's rows 2q
    and 2q + 1 hold (W[16 j + c][2 q], W[16 j + c][2 q + 1]) for c = 0 .. 15
    in turn; elsewhere each panel row's columns are in the order gemm_bf16.c
    unpacks."""
    if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        raise ValueError(f"pack_panels_bf16 takes a bfloat16 CPU weight [N, K], got "
                         f"{weight.dtype} {tuple(weight.shape)} on {weight.device}")
    k = weight.shape[1]
    if not (k % 2 == 0 and gemm_bf16_pairs()):
        return _panels(weight, _BF16_ORDER)
    panels = _by_panel(weight)
    # [P, 16 columns, K / 2 pairs, 2] -> [P, K / 2, 16, 2]: a pair row's columns in turn
    pairs = panels.view(panels.shape[0], PANEL, k // 2, 2).permute(0, 2, 1, 3)
    return huge_pages.copy_of(pairs).view(panels.shape[0], k, PANEL)


def gemm_panels_bf16(x: torch.Tensor, panels: torch.Tensor, out_features: int,
                     bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                     num_threads: int | None = None) -> torch.Tensor:
    """x [M, K] bfloat16 (rows may be strided) @ the packed bfloat16 weight's
    transpose (+ a float32 bias), accumulated in float32 and rounded once to
    bfloat16: [M, out_features] bfloat16, into `out` (contiguous rows) when
    given. A row's result does not depend on M or on the thread count."""
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.device.type != "cpu":
        raise ValueError(f"gemm_panels_bf16 takes bfloat16 CPU rows [M, K], got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, in_features = x.shape
    if (panels.dtype != torch.bfloat16 or panels.shape[1] != in_features
            or panels.shape[0] * PANEL < out_features):
        raise ValueError(f"x has {in_features} features; panels {panels.dtype} "
                         f"{tuple(panels.shape)} do not hold a [{out_features}, "
                         f"{in_features}] bfloat16 weight")
    if out is None:
        out = torch.empty((rows, out_features), dtype=torch.bfloat16)
    elif out.shape != (rows, out_features) or out.stride(1) != 1 or out.dtype != x.dtype:
        raise ValueError(f"out must be bfloat16 [{rows}, {out_features}] with contiguous rows")
    if bias is not None:
        bias = bias.float().contiguous()
    with _profiled(GEMM_PROFILER_NAME):
        code = library().pdserve_gemm_panels_bf16(
            x.data_ptr(), x.stride(0), rows, panels.data_ptr(), in_features, out_features,
            None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
            num_threads or torch.get_num_threads())
    _check(code, "gemm_panels_bf16")
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
    with _profiled(PREFILL_PROFILER_NAME):
        code = library().pdserve_prefill_attention(
            q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
            out.data_ptr(), out.stride(0), DTYPE_CODES[q.dtype], num_new, k.shape[0],
            num_q_heads, k.shape[1], head_dim, sliding_window or 0, scale,
            num_threads or torch.get_num_threads())
    _check(code, "prefill attention")
    return out
