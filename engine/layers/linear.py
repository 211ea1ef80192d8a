"""`Linear` and the matmul backends the engine can run it on.

Decoding reads every weight once per step for a handful of rows, so a step
is bounded by how fast the weights stream from memory. torch's default CPU
path (`F.linear`) does not get close to that bound at decode shapes: at
[8, 1024] x [1024, 2816] it ran at ~45 % of the read bandwidth here, because
it re-lays the weight out for every call. oneDNN can lay the weight out once
(`mkldnn._reorder_linear_weight`) and reuse that blocked copy in every call
(`mkldnn._linear_pointwise`), which reaches ~90 % (docs/benchmarks.md,
"Engine step"). vLLM's CPU build prepacks its dense projections the same way.

`MatmulBackend`:

- ``auto`` (default): oneDNN prepacked weights on CPU for float32 (unless
  the native GEMM takes them, below) and bfloat16 when torch was built
  with oneDNN (bfloat16 packed as float32
  where the CPU lacks oneDNN's bfloat16 linear: `Linear.prepack_onednn`);
  `F.linear` otherwise (CUDA, float16, a torch without oneDNN).
- ``onednn``: prepacked, or a ValueError naming why it cannot be.
- ``torch``: always `F.linear` (the reference path).

`prepack(module, backend, native_gemm)` is called once by `LLMEngine` after
the weights are loaded and before the first step. A prepacked `Linear`
drops its plain weight (the blocked copy replaces it, so memory does not
double, except for a bfloat16 weight packed as float32); its `weight`
attribute then holds the blocked tensor, which only
`mkldnn._linear_pointwise` can read. float32 results differ from `F.linear`
by rounding only (a different summation order): ~1e-6 relative, and they do
not depend on the number of rows in the batch.

The native GEMM (`DecodeMatmul`, the `decode_matmul` setting; the name is
from when only decode rows took it): oneDNN's small-batch kernel computes
no faster than the weights arrive and does not overlap the two, so a
float32 decode step at batch 8 read its weights at ~8 GB/s here. Under
``auto`` a float32 model on a CPU with AVX2 and FMA keeps each weight in
the native kernel's 16-column panels instead of oneDNN's copy
(`Linear.pack_native`, `kernels.native.gemm_panels`), and every row of
every input goes through it: 1.4x faster than oneDNN at 8 rows, and
faster from 32 rows to 2,048 with the 6-row tiles of its prefill path
(docs/benchmarks.md, "Decode GEMM" and "Prefill GEMM"). One copy of the
weights, as with oneDNN alone. Decode and prefill rows take the same
kernel and a row's result does not depend on the rows beside it, so a
decode token computes the same whether its step also holds a prefill
chunk or not, on a colocated pod as on a decode pod. A bfloat16 model on a
CPU whose oneDNN has no bfloat16 linear (`upcasts_bfloat16`) keeps its
weights as bfloat16 panels the same way (`kernels.native.gemm_panels_bf16`,
widened in registers): half the bytes of the float32 copy oneDNN would
multiply there, and one copy of the weights instead of two. On a CPU with
AVX512-BF16 (where oneDNN does multiply bfloat16) the panels hold k in
pairs for `vdpbf16ps`, and `auto` takes them unless the CPU has AMX: the
projections of a decode batch in 0.5-0.6x oneDNN's time, a prefill
chunk's in the same (docs/benchmarks.md, "bfloat16 pairs at prefill
sizes"). On plain AVX-512 oneDNN emulates bfloat16, and `auto` takes the
widening panels there too, 1.2-3.6x faster (`resolve_decode_matmul`).
"""

from __future__ import annotations

import enum

import torch
import torch.nn.functional as F
from torch import nn


def _parse_choice(cls: type[enum.Enum], value: object, what: str) -> enum.Enum:
    """A member of `cls` from itself or its value (case and spaces ignored);
    ValueError naming `what` and the allowed values otherwise."""
    if isinstance(value, cls):
        return value
    try:
        return cls(str(value).strip().lower())
    except ValueError:
        allowed = "|".join(m.value for m in cls)
        raise ValueError(f"{what} {value!r} unknown; expected {allowed}") from None


class MatmulBackend(enum.Enum):
    AUTO = "auto"
    ONEDNN = "onednn"
    TORCH = "torch"

    @classmethod
    def parse(cls, value: str | MatmulBackend) -> MatmulBackend:
        return _parse_choice(cls, value, "matmul backend")


class DecodeMatmul(enum.Enum):
    """Who multiplies a float32 (or bfloat16, see `resolve_decode_matmul`)
    model's rows on CPU, decode and prefill rows alike: ``auto`` (the native
    panel GEMM where `native_unsupported_reason` is None, else the matmul
    backend), ``native`` (that, or a ValueError naming why not), ``off``
    (the matmul backend)."""

    AUTO = "auto"
    NATIVE = "native"
    OFF = "off"

    @classmethod
    def parse(cls, value: str | DecodeMatmul) -> DecodeMatmul:
        return _parse_choice(cls, value, "decode matmul")


def native_unsupported_reason(dtype: torch.dtype, device: torch.device,
                              backend: MatmulBackend) -> str | None:
    """Why the projections cannot take the native panel GEMM, or None if they can."""
    from kernels import native

    if backend is not MatmulBackend.ONEDNN:
        return f"the dense projections run on {backend.value}, not oneDNN"
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return (f"the native GEMM is for float32 and bfloat16 on CPU, not {dtype} on "
                f"{device.type}")
    available = native.gemm_available() if dtype == torch.float32 else (
        native.gemm_bf16_available())
    if not available:
        return "the native kernels did not build, or this CPU lacks AVX2 and FMA"
    return None


def resolve_decode_matmul(value: DecodeMatmul | str, dtype: torch.dtype, device: torch.device,
                          backend: MatmulBackend) -> bool:
    """Whether the projections take the native GEMM; ``native`` where it cannot ->
    ValueError."""
    value = DecodeMatmul.parse(value)
    if value is DecodeMatmul.OFF:
        return False
    reason = native_unsupported_reason(dtype, device, backend)
    if value is DecodeMatmul.NATIVE and reason:
        raise ValueError(f"decode matmul 'native' unavailable: {reason}")
    if reason is None and dtype == torch.bfloat16 and not upcasts_bfloat16():
        # oneDNN multiplies bfloat16 on this CPU: natively with AVX512-BF16
        # or AMX, emulated on plain AVX-512 (widening in its own kernels).
        # The panels beat it in both cases measured: in pairs (`vdpbf16ps`,
        # AVX512-BF16) a decode batch's projections in 0.5-0.6x its time and
        # a prefill chunk's in the same; widened in registers (AVX-512
        # without AVX512-BF16) 1.2-3.6x faster at 1-16 rows and 2.3-2.6x at
        # 64-1,024 (docs/benchmarks.md, "Prefill GEMM"). AMX's tile kernels
        # were never measured against them: oneDNN keeps those unless `native`.
        return value is DecodeMatmul.NATIVE or not has_amx()
    return reason is None


def has_amx() -> bool:
    """Whether the CPU has AMX tiles (oneDNN's bfloat16 GEMM then runs on them)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else False


def onednn_unsupported_reason(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why prepacked oneDNN weights cannot serve this dtype/device, or None if they can."""
    if device.type != "cpu":
        return f"oneDNN prepacking is a CPU path; the model is on {device.type}"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    if dtype not in (torch.float32, torch.bfloat16):
        # float16 needs AVX512-FP16 / AVX-NE-CONVERT, which most CPUs lack.
        return f"oneDNN prepacking supports float32 and bfloat16, not {dtype}"
    return None


def upcasts_bfloat16() -> bool:
    """True where oneDNN has no bfloat16 linear (it needs AVX512 BW/VL/DQ or
    AVX-NE-CONVERT; an AVX2-only CPU has neither): a prepacked bfloat16
    `Linear` then computes in float32 (see `Linear.prepack_onednn`)."""
    return not torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _empty(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    # Uninitialised on purpose: the loader overwrites every parameter.
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b); weight [out_features, in_features] like HF's.

    Plain until `prepack_onednn()` or `pack_native()`; after either, `weight`
    is that backend's copy of it and `forward` calls that backend directly.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool,
                 dtype: torch.dtype, device: torch.device | str,
                 shared_weight: nn.Parameter | None = None) -> None:
        """`shared_weight`: use this parameter (tied embeddings) instead of a new one."""
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        if shared_weight is not None and tuple(shared_weight.shape) != (out_features,
                                                                        in_features):
            raise ValueError(f"shared weight shape {tuple(shared_weight.shape)} is not "
                             f"({out_features}, {in_features})")
        self.weight = (shared_weight if shared_weight is not None
                       else _empty(out_features, in_features, dtype=dtype, device=device))
        self.bias = _empty(out_features, dtype=dtype, device=device) if bias else None
        self.prepacked = False  # weight: oneDNN's blocked copy (prepack_onednn)
        self.upcast = False  # prepacked in float32 for a bfloat16 model (see prepack_onednn)
        self.native = False  # weight: the native GEMM's panels (pack_native)

    def pack_native(self) -> None:
        """Replace the weight by the native GEMM's panels ([ceil(N / 16), K, 16]
        in the weight's dtype, `kernels.native.pack_panels` or
        `pack_panels_bf16`; once, engine loop thread): every row of every
        input then takes kernels/native/gemm.c or gemm_bf16.c."""
        from kernels import native

        if self.native or self.prepacked:
            return
        weight = self.weight.detach()
        pack = native.pack_panels_bf16 if weight.dtype == torch.bfloat16 else native.pack_panels
        panels = pack(weight)
        if self.bias is not None and weight.dtype == torch.bfloat16:
            # gemm_bf16.c adds a float32 bias (the exact values) to its float32 sums
            self.bias = nn.Parameter(self.bias.detach().float(), requires_grad=False)
        self.weight = nn.Parameter(panels, requires_grad=False)
        self.native = True

    def prepack_onednn(self) -> None:
        """Replace the weight by oneDNN's blocked layout (once; engine loop thread).

        A bfloat16 weight on a CPU without oneDNN's bfloat16 linear
        (`upcasts_bfloat16`) is packed as float32 instead, and `forward`
        converts the activations to float32 and the result back. That is a
        bfloat16 GEMM in all but speed: a product of two bfloat16 values is
        exact in float32 and oneDNN's bfloat16 GEMM accumulates in float32
        too, so only the summation order differs. On this project's AVX2
        EPYC it ran 2.2x faster than `F.linear` in bfloat16 (2.7 against
        5.9 ms at [8, 1024] x [1024, 5632], two threads), at twice the
        weight memory."""
        if self.prepacked or self.native:
            return
        weight = self.weight.detach()
        if weight.dtype == torch.bfloat16 and upcasts_bfloat16():
            weight = weight.float()
            if self.bias is not None:
                self.bias = nn.Parameter(self.bias.detach().float(), requires_grad=False)
            self.upcast = True
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.prepacked = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return self._native(x)
        if self.upcast:
            out = torch.ops.mkldnn._linear_pointwise(x.float(), self.weight, self.bias,
                                                     "none", [], "")
            return out.to(x.dtype)
        if self.prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def _native(self, x: torch.Tensor) -> torch.Tensor:
        from kernels import native

        gemm = native.gemm_panels_bf16 if x.dtype == torch.bfloat16 else native.gemm_panels
        out = gemm(x.reshape(-1, self.in_features), self.weight, self.out_features, self.bias)
        return out.view(*x.shape[:-1], self.out_features)


def resolve_backend(backend: MatmulBackend | str, dtype: torch.dtype,
                    device: torch.device) -> MatmulBackend:
    """AUTO -> ONEDNN or TORCH for this dtype/device; ONEDNN where impossible -> ValueError."""
    backend = MatmulBackend.parse(backend)
    reason = onednn_unsupported_reason(dtype, device)
    if backend is MatmulBackend.AUTO:
        return MatmulBackend.TORCH if reason else MatmulBackend.ONEDNN
    if backend is MatmulBackend.ONEDNN and reason:
        raise ValueError(f"matmul backend 'onednn' unavailable: {reason}")
    return backend


def prepack(module: nn.Module, backend: MatmulBackend, native_gemm: bool = False) -> int:
    """Pack every `Linear` under `module` for a resolved backend, once: oneDNN's
    blocked copy of each weight, or with `native_gemm` (`resolve_decode_matmul`
    said yes: float32, or bfloat16 where oneDNN upcasts it, on CPU) the native
    GEMM's panels instead.
    Returns how many were packed."""
    if backend is not MatmulBackend.ONEDNN:
        return 0
    count = 0
    with torch.inference_mode():
        for layer in module.modules():
            if isinstance(layer, Linear):
                if native_gemm:
                    layer.pack_native()
                else:
                    layer.prepack_onednn()
                count += 1
    return count
