"""Makes Triton's CPU interpreter round like the GPU for the kernel tests.

Triton 3.9's interpreter converts fp32 -> bf16 by truncating the mantissa
(round toward zero), where compiled kernels round to nearest even; a bf16
kernel output would then differ from the (correctly rounded) reference by up
to one ulp per cast for reasons that have nothing to do with the kernel.
This conftest replaces that one conversion with round-to-nearest-even; every
other conversion still goes through the interpreter's own code. The tests
import triton only after tests/conftest.py has set TRITON_INTERPRET=1.
"""

from __future__ import annotations

import pytest


def _install_bf16_rounding() -> None:
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # no triton or numpy: the interpreter tests skip themselves
        return
    original = interpreter._convert_float
    if getattr(original, "_pdserve_rne", False):
        return

    def convert_float(values, input_dtype, output_dtype, rounding_mode):
        if input_dtype != tl.float32 or output_dtype != tl.bfloat16:
            return original(values, input_dtype, output_dtype, rounding_mode)
        bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return np.where(np.isnan(values), np.uint16(0x7FC0), rounded)

    convert_float._pdserve_rne = True
    interpreter._convert_float = convert_float


_install_bf16_rounding()


@pytest.fixture(autouse=True)
def _seeded_torch():
    """Cases draw from their own generators; this only pins anything left on the global one."""
    import torch

    torch.manual_seed(0)
