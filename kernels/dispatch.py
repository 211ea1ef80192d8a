"""The engine's only entry to kernels: validate once, then pick a backend per call.

Every op takes a keyword `backend` (a `Backend` or its name):

- ``auto`` (default): the Triton kernel when the tensors are on CUDA; on CPU
  the native C kernels (`kernels.native`: decode attention, RMSNorm, RoPE,
  KV inject)
  when they built, else the torch reference (`kernels.reference`) or, for
  decode attention, the faster torch path `kernels.cpu_attention`.
- ``triton``: always the Triton kernel. On CPU that needs Triton's
  interpreter (``TRITON_INTERPRET=1`` set before Triton is imported); without
  it the call raises RuntimeError saying so.
- ``torch``: always the reference.

The backend is configuration, not process state: the engine reads it from
`EngineConfig.kernel_backend` and passes it down (the model, the attention
context, the KV injector and extractor); the CLI turns the flag (or the
`PDSERVE_KERNEL_BACKEND` environment variable) into that config. This module
reads no environment of its own except Triton's `TRITON_INTERPRET`, to say
why the Triton path cannot run on a CPU tensor. The functions hold no state,
so they are safe to call from any thread (the engine loop thread and the
KV injector / extractor threads).

Triton modules are imported lazily on the first Triton call, so `import
kernels` works on machines without Triton.
"""

from __future__ import annotations

import enum
import os

import torch

from kernels import checks, native, reference
from kernels.cpu_attention import paged_decode_attention_cpu


class Backend(enum.Enum):
    AUTO = "auto"
    TRITON = "triton"
    TORCH = "torch"

    @classmethod
    def parse(cls, value: str | Backend) -> Backend:
        if isinstance(value, cls):
            return value
        try:
            return cls(value.strip().lower())
        except ValueError:
            allowed = "|".join(b.value for b in cls)
            raise ValueError(f"kernel backend {value!r} unknown; expected {allowed}") from None


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _use_triton(device: torch.device, backend: Backend | str) -> bool:
    backend = Backend.parse(backend)
    if backend is Backend.TORCH:
        return False
    if backend is Backend.AUTO:
        return device.type == "cuda" and triton_available()
    if not triton_available():
        raise RuntimeError("kernel backend 'triton' but triton is not installed")
    if device.type != "cuda" and not _interpreter_enabled():
        raise RuntimeError(
            f"backend 'triton' on a {device.type} tensor needs TRITON_INTERPRET=1 "
            "(set before triton is imported); use backend 'torch' or 'auto' off CUDA"
        )
    return True


def cuda_graph_unsupported_reason(device: torch.device, backend: Backend | str) -> str | None:
    """Why the decode-step ops (`inject_kv`, `paged_decode_attention`,
    `rms_norm`, `rotary_embedding`) on `device` under `backend` cannot be
    captured in a CUDA graph, or None when they can.

    Captured work must not read device values on the host. The Triton
    launchers size their grids from tensor shapes only (decode attention
    from the block table's width, masking by `context_lens` on the device);
    the torch references do read them (`inject_kv`'s mask of negative
    slots, decode attention's longest context), and interpreted Triton runs
    on the host.
    """
    if device.type != "cuda":
        return f"the model is on {device.type}; CUDA graphs need a CUDA device"
    if not _use_triton(device, backend):
        return (f"kernel backend {Backend.parse(backend).value!r} runs the torch references, "
                "which read device values on the host")
    if _interpreter_enabled():
        return "TRITON_INTERPRET is set: interpreted Triton kernels run on the host"
    return None


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    backend: Backend | str = Backend.AUTO,
) -> torch.Tensor:
    """Decode attention over one layer's paged cache; returns [B, Hq, D] in q's dtype.

    q [B, Hq, D]; kv_cache [2, num_blocks, block_size, Hkv, D];
    block_tables [B, max_blocks_per_seq] int32; context_lens [B] int32 counts
    the tokens to attend to, including the current one (its K/V must already
    be in the cache). Contract (not checked, to avoid a device sync): each
    context_len <= max_blocks_per_seq * block_size and its blocks' ids are in
    range; rows with context_len 0 return zeros. sliding_window=W attends to
    the last W positions only; softcap=C soft-caps each scaled score s to
    C * tanh(s / C) before the softmax (None: off, today's kernels unchanged).
    """
    checks.check_decode_attention(q, kv_cache, block_tables, context_lens, scale, sliding_window,
                                  softcap)
    if _use_triton(q.device, backend):
        from kernels.paged_attention import paged_decode_attention_triton

        return paged_decode_attention_triton(
            q, kv_cache, block_tables, context_lens, scale=scale, sliding_window=sliding_window,
            softcap=softcap,
        )
    if Backend.parse(backend) is Backend.AUTO and q.device.type == "cpu":
        if native.supports(q, kv_cache):
            return native.paged_decode_attention(
                q, kv_cache, block_tables, context_lens, scale=scale,
                sliding_window=sliding_window, softcap=softcap)
        # SDPA has no soft-capping: a soft-capped call without the native
        # library takes the reference below.
        if softcap is None:
            return paged_decode_attention_cpu(
                q, kv_cache, block_tables, context_lens, scale=scale,
                sliding_window=sliding_window)
    return reference.paged_decode_attention_reference(
        q, kv_cache, block_tables, context_lens, scale=scale, sliding_window=sliding_window,
        softcap=softcap,
    )


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    backend: Backend | str = Backend.AUTO,
) -> torch.Tensor:
    """Causal attention of new tokens over their paged context; returns [T, Hq, D].

    q [T, Hq, D] holds the new tokens of S sequences back to back: sequence s
    owns rows [query_start_loc[s], query_start_loc[s+1]) (query_start_loc
    [S+1] int32, from 0 to T) and they are the last of its context_lens[s]
    positions. Their K/V must already be in the cache (inject first), so the
    cached prefix and the causal part are one walk over the block table
    [S, max_blocks] int32. Reads query_start_loc and context_lens on the host.
    sliding_window and softcap as for `paged_decode_attention`.
    """
    checks.check_prefill_attention(
        q, kv_cache, block_tables, query_start_loc, context_lens, scale, sliding_window, softcap
    )
    if _use_triton(q.device, backend):
        from kernels.prefill_attention import paged_prefill_attention_triton

        return paged_prefill_attention_triton(
            q, kv_cache, block_tables, query_start_loc, context_lens,
            scale=scale, sliding_window=sliding_window, softcap=softcap,
        )
    return reference.paged_prefill_attention_reference(
        q, kv_cache, block_tables, query_start_loc, context_lens,
        scale=scale, sliding_window=sliding_window, softcap=softcap,
    )


def inject_kv(kv_cache: torch.Tensor, src: torch.Tensor, slot_mapping: torch.Tensor, *,
              backend: Backend | str = Backend.AUTO) -> None:
    """Scatters src [2, T, Hkv, D] into the cache at slot_mapping [T] int64, in place.

    One call covers any number of requests (their slots concatenated).
    Negative slots are skipped (padding). Slots must be < num_blocks *
    block_size: the torch path raises IndexError on others, the native CPU
    kernel NativeKernelError (writing nothing), the Triton kernel skips them
    rather than write out of bounds.
    """
    num_tokens = checks.check_transfer_rows("src", src, kv_cache)
    checks.check_slot_mapping(slot_mapping, num_tokens)
    checks.check_last_dim_contiguous("src", src)
    checks.check_same_device(kv_cache=kv_cache, slot_mapping=slot_mapping)
    if num_tokens == 0:
        return
    if _use_triton(kv_cache.device, backend):
        from kernels.kv_copy import inject_kv_triton

        inject_kv_triton(kv_cache, src, slot_mapping)
        return
    if (Backend.parse(backend) is Backend.AUTO and kv_cache.device.type == "cpu"
            and native.supports_inject(kv_cache, src, slot_mapping)):
        native.inject_kv(kv_cache, src, slot_mapping)
        return
    reference.inject_kv_reference(kv_cache, src, slot_mapping)


def extract_kv(
    kv_cache: torch.Tensor, slot_mapping: torch.Tensor, out: torch.Tensor | None = None, *,
    backend: Backend | str = Backend.AUTO,
) -> torch.Tensor:
    """Gathers the slots' K/V into a contiguous [2, T, Hkv, D] tensor (inverse of inject_kv).

    `out` may be a preallocated buffer on the cache's device or, for a
    device-to-host copy, a (pinned) CPU tensor; it must be contiguous. A copy
    into pinned memory is issued non-blocking on the current stream: the
    caller records an event before reading it. Rows of negative slots are 0.
    """
    _, _, num_kv_heads, head_dim = checks.check_kv_cache(kv_cache)
    checks.check_ndim("slot_mapping", slot_mapping, 1, "[num_tokens]")
    num_tokens = slot_mapping.shape[0]
    checks.check_slot_mapping(slot_mapping, num_tokens)
    checks.check_same_device(kv_cache=kv_cache, slot_mapping=slot_mapping)
    if out is not None:
        if tuple(out.shape) != (2, num_tokens, num_kv_heads, head_dim):
            raise ValueError(
                f"out shape {tuple(out.shape)} must be "
                f"[2, {num_tokens}, {num_kv_heads}, {head_dim}]"
            )
        if out.dtype != kv_cache.dtype:
            raise ValueError(f"out dtype {out.dtype} differs from kv_cache dtype {kv_cache.dtype}")
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
    if num_tokens == 0:
        return out if out is not None else reference.extract_kv_reference(kv_cache, slot_mapping)
    if _use_triton(kv_cache.device, backend):
        from kernels.kv_copy import extract_kv_triton

        if out is None or out.device == kv_cache.device:
            return extract_kv_triton(kv_cache, slot_mapping, out)
        out.copy_(extract_kv_triton(kv_cache, slot_mapping), non_blocking=out.is_pinned())
        return out
    return reference.extract_kv_reference(kv_cache, slot_mapping, out)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    backend: Backend | str = Backend.AUTO,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x [N, H] (fp32 math, result in x.dtype); inputs untouched
    unless they are also outputs.

    With residual: r = x + residual (rounded to x.dtype), returns (norm(r) * weight, r).
    Results go to new tensors, or to `out` / `residual_out` (contiguous, x's
    shape, dtype and device), which may be x / residual themselves: in place,
    `rms_norm(x, w, eps, r, out=x, residual_out=r)` is the engine's residual
    stream without an allocation.
    """
    checks.check_rms_norm(x, weight, eps, residual, out, residual_out)
    # The CPU decode step calls this twice per layer: its path is tested first.
    if (x.device.type == "cpu" and Backend.parse(backend) is Backend.AUTO
            and native.supports_rms_norm(x, weight, residual)):
        return native.rms_norm(x, weight, eps, residual, out=out, residual_out=residual_out)
    if _use_triton(x.device, backend):
        from kernels.norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual, out=out, residual_out=residual_out)
    result = reference.rms_norm_reference(x, weight, eps, residual)
    if out is None and residual_out is None:
        return result
    y, r = result if residual is not None else (result, None)
    if out is not None:
        y = out.copy_(y)
    if residual_out is not None:
        r = residual_out.copy_(r)
    return y if residual is None else (y, r)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    backend: Backend | str = Backend.AUTO,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style RoPE (rotate halves); returns new (q, k), inputs untouched.

    positions [N] int64 index cos_sin_cache [max_pos, D] float32 (cos in the
    first D/2 columns, sin in the rest; any scaling such as llama3's is
    already baked into the cache). q [N, Hq, D], k [N, Hkv, D].
    """
    checks.check_rotary(positions, q, k, cos_sin_cache)
    if _use_triton(q.device, backend):
        from kernels.rotary import rotary_embedding_triton

        return rotary_embedding_triton(positions, q, k, cos_sin_cache)
    if (Backend.parse(backend) is Backend.AUTO and q.device.type == "cpu"
            and native.supports_rotary(positions, q, k, cos_sin_cache)):
        return native.rotary_embedding(positions, q, k, cos_sin_cache)
    return reference.rotary_embedding_reference(positions, q, k, cos_sin_cache)


def logit_stats(x: torch.Tensor, *, logsum: bool = True, backend: Backend | str = Backend.AUTO
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(argmax, max, logsum) of each row of float32 logits x [n, V]: the first
    index of the row's maximum (the first NaN's when it has one), that
    maximum, and log(sum_j exp(x_j - max)) when `logsum` (else None), so the
    row's log-softmax is (x_j - max) - logsum. On x's device; the native
    kernel on CPU under ``auto``, the torch reference otherwise (and on
    CUDA, where torch's reductions are already one kernel each)."""
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"logit_stats takes float32 [n, V] logits, got {x.dtype} "
                         f"{tuple(x.shape)}")
    if (Backend.parse(backend) is Backend.AUTO and x.device.type == "cpu"
            and native.supports_logit_stats(x)):
        return native.logit_stats(x, logsum=logsum)
    return reference.logit_stats_reference(x, logsum=logsum)
