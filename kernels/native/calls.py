"""How the native kernels' Python wrappers call C (kernels/native): the
dtype codes the C functions take, their error codes raised as
`NativeKernelError`, a profiler label per call, and the row layout most
of them accept.
"""

from __future__ import annotations

import contextlib

import torch

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Nonzero return codes of the C functions.
_ERRORS = {1: "out of memory", 2: "unsupported shape or dtype",
           3: "a context length, block id or position is out of range"}


class NativeKernelError(RuntimeError):
    """A native kernel refused its arguments or failed; the message says why."""


def check(code: int, what: str) -> None:
    if code:
        raise NativeKernelError(f"{what} failed: {_ERRORS.get(code, f'error {code}')}")


_NO_LABEL = contextlib.nullcontext()


def profiled(name: str) -> contextlib.AbstractContextManager:
    """A profiler label for a ctypes call (the step breakdown of `pdserve
    bench engine` cannot see inside one) when a profiler is on: entering
    `record_function` costs microseconds per call even with none running."""
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else _NO_LABEL


def rows_ok(t: torch.Tensor) -> bool:
    """CPU, a native dtype, and each row's trailing dims contiguous (rows may
    be strided): [N, H] with unit stride, or [N, heads, D] with heads D apart."""
    if t.device.type != "cpu" or t.dtype not in DTYPE_CODES or t.stride(-1) != 1:
        return False
    return t.dim() == 2 or (t.dim() == 3 and (t.shape[1] == 1 or t.stride(1) == t.shape[2]))
