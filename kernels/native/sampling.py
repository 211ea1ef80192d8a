"""The sampler's per-row reductions of logits (`sampling.c`): argmax, max
and log-sum-exp of float32 rows in one call."""

from __future__ import annotations

import torch

from kernels.native.calls import check, profiled
from kernels.native.loader import library

PROFILER_NAME = "pdserve_native::logit_stats"


def supports_logit_stats(x: torch.Tensor) -> bool:
    """CPU float32 [n, V] rows, each contiguous, and a library that built."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2
            and x.shape[1] > 0 and (x.shape[0] <= 1 or x.stride(0) >= x.shape[1])
            and x.stride(1) == 1 and library() is not None)


def logit_stats(x: torch.Tensor, *, logsum: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Same contract as `kernels.dispatch.logit_stats`, for `supports_logit_stats` rows."""
    rows, vocab = x.shape
    argmax = torch.empty(rows, dtype=torch.int64)
    top = torch.empty(rows, dtype=torch.float32)
    sums = torch.empty(rows, dtype=torch.float32) if logsum else None
    if rows:
        with profiled(PROFILER_NAME):
            code = library().pdserve_logit_stats(
                x.data_ptr(), x.stride(0) if rows > 1 else vocab, rows, vocab,
                argmax.data_ptr(), top.data_ptr(), None if sums is None else sums.data_ptr(),
                torch.get_num_threads())
        check(code, "logit_stats")
    return argmax, top, sums
