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

- ``auto`` (default): oneDNN prepacked weights on CPU for float32 and
  bfloat16 when torch was built with oneDNN (bfloat16 packed as float32
  where the CPU lacks oneDNN's bfloat16 linear: `Linear.prepack_onednn`);
  `F.linear` otherwise (CUDA, float16, a torch without oneDNN).
- ``onednn``: prepacked, or a ValueError naming why it cannot be.
- ``torch``: always `F.linear` (the reference path).

`prepack(module, backend)` is called once by `LLMEngine` after the weights
are loaded and before the first step. A prepacked `Linear` drops its plain
weight (the blocked copy replaces it, so memory does not double, except
for a bfloat16 weight packed as float32); its
`weight` attribute then holds the blocked tensor, which only
`mkldnn._linear_pointwise` can read. float32 results differ from `F.linear`
by rounding only (a different summation order): ~1e-6 relative, and they do
not depend on the number of rows in the batch.

Decode rows (`DecodeMatmul`): oneDNN's small-batch kernel computes no
faster than the weights arrive and does not overlap the two, so a float32
decode step at batch 8 read its weights at ~8 GB/s here. Under ``auto`` a
float32 model on a CPU with AVX2 and FMA also keeps each prepacked weight
in the native kernel's 16-column panels (`kernels.native.gemm_panels`,
twice the weight memory), and the leading decode rows of every dense input
(`DecodeRows`, set by the model runner for each forward) go through it:
1.4x faster than oneDNN at 8 rows (docs/benchmarks.md, "Decode GEMM").
Prefill rows stay on oneDNN, whose large-M kernel is the faster one. A
decode token thus takes the same path whether its step also holds a
prefill chunk or not, on a colocated pod as on a decode pod. A bfloat16
model on a CPU whose oneDNN has no bfloat16 linear (`upcasts_bfloat16`)
keeps bfloat16 panels for its decode rows (`kernels.native.gemm_panels_bf16`:
half the bytes of the float32 copy its prefill rows use).
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator

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
    """Who multiplies decode rows on CPU: ``auto`` (the native panel GEMM
    where `native_unsupported_reason` is None, else the prefill's backend),
    ``native`` (that, or a ValueError naming why not), ``off``."""

    AUTO = "auto"
    NATIVE = "native"
    OFF = "off"

    @classmethod
    def parse(cls, value: str | DecodeMatmul) -> DecodeMatmul:
        return _parse_choice(cls, value, "decode matmul")


class DecodeRows:
    """How many leading rows of the dense inputs of the current forward are
    decode rows: the model runner sets it around each forward and logits
    call (`leading`); 0 outside them. One per engine, shared by its `Linear`s."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0

    @contextlib.contextmanager
    def leading(self, count: int) -> Iterator[None]:
        previous, self.count = self.count, count
        try:
            yield
        finally:
            self.count = previous


def native_unsupported_reason(dtype: torch.dtype, device: torch.device,
                              backend: MatmulBackend) -> str | None:
    """Why decode rows cannot take the native panel GEMM, or None if they can."""
    from kernels import native

    if backend is not MatmulBackend.ONEDNN:
        return f"the dense projections run on {backend.value}, not oneDNN"
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return (f"the native decode GEMM is for float32 and bfloat16 on CPU, not {dtype} on "
                f"{device.type}")
    available = native.gemm_available() if dtype == torch.float32 else (
        native.gemm_bf16_available())
    if not available:
        return "the native kernels did not build, or this CPU lacks AVX2 and FMA"
    return None


def resolve_decode_matmul(value: DecodeMatmul | str, dtype: torch.dtype, device: torch.device,
                          backend: MatmulBackend) -> bool:
    """Whether decode rows take the native GEMM; ``native`` where it cannot -> ValueError."""
    value = DecodeMatmul.parse(value)
    if value is DecodeMatmul.OFF:
        return False
    reason = native_unsupported_reason(dtype, device, backend)
    if value is DecodeMatmul.NATIVE and reason:
        raise ValueError(f"decode matmul 'native' unavailable: {reason}")
    if reason is None and dtype == torch.bfloat16 and not upcasts_bfloat16():
        # oneDNN multiplies bfloat16 natively on this CPU (AVX512-BF16 or
        # AMX): the bfloat16 panels were measured only where it cannot.
        return value is DecodeMatmul.NATIVE
    return reason is None


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

    Plain until `prepack_onednn()`; after it, `weight` is oneDNN's blocked
    copy and `forward` calls oneDNN directly.
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
        self.prepacked = False
        self.upcast = False  # prepacked in float32 for a bfloat16 model (see prepack_onednn)
        # The native decode GEMM's copy of the weight and the rows it takes
        # (pack_native); None: every row goes the one path.
        self.panels: torch.Tensor | None = None
        self.decode_rows: DecodeRows | None = None

    def pack_native(self, decode_rows: DecodeRows) -> None:
        """Keep the weight in the native GEMM's panels as well, in its own
        dtype (float32 or bfloat16; before `prepack_onednn` replaces it); the
        leading `decode_rows.count` rows of each input then take that kernel."""
        from kernels import native

        weight = self.weight.detach()
        pack = native.pack_panels_bf16 if weight.dtype == torch.bfloat16 else native.pack_panels
        self.panels = pack(weight)
        self.decode_rows = decode_rows

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
        if self.prepacked:
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
        if self.panels is not None and self.decode_rows.count and x.dim() == 2:
            return self._decode_rows_native(x, self.decode_rows.count)
        return self._dense(x)

    def _decode_rows_native(self, x: torch.Tensor, count: int) -> torch.Tensor:
        from kernels import native

        gemm = native.gemm_panels_bf16 if x.dtype == torch.bfloat16 else native.gemm_panels
        if count >= x.shape[0]:
            return gemm(x, self.panels, self.out_features, self.bias)
        out = torch.empty((x.shape[0], self.out_features), dtype=x.dtype)
        gemm(x[:count], self.panels, self.out_features, self.bias, out=out[:count])
        out[count:] = self._dense(x[count:])
        return out

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        if self.upcast:
            out = torch.ops.mkldnn._linear_pointwise(x.float(), self.weight, self.bias,
                                                     "none", [], "")
            return out.to(x.dtype)
        if self.prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


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


def prepack(module: nn.Module, backend: MatmulBackend,
            decode_rows: DecodeRows | None = None) -> int:
    """Prepack every `Linear` under `module` for a resolved backend, and with
    `decode_rows` keep the native decode GEMM's panels too (float32,
    `resolve_decode_matmul` said yes); returns how many were prepacked."""
    if backend is not MatmulBackend.ONEDNN:
        return 0
    count = 0
    with torch.inference_mode():
        for layer in module.modules():
            if isinstance(layer, Linear):
                if decode_rows is not None:
                    layer.pack_native(decode_rows)
                layer.prepack_onednn()
                count += 1
    return count
