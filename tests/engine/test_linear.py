"""engine/layers/linear.py: prepacked oneDNN and native-GEMM linears against
F.linear on fresh random inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.layers.linear import (
    DecodeMatmul,
    Linear,
    MatmulBackend,
    onednn_unsupported_reason,
    prepack,
    resolve_backend,
    resolve_decode_matmul,
)
from kernels import native

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                  reason="torch built without oneDNN")
needs_native_gemm = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available() or not native.gemm_available(),
    reason="no oneDNN, or no native GEMM (no compiler, or no AVX2 + FMA)")
CPU = torch.device("cpu")

# float32: a different summation order only; bfloat16: the output is rounded
# to 8 mantissa bits, so one ulp of a value ~32 is 0.25.
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-4),
             torch.bfloat16: dict(rtol=1.6e-2, atol=0.5)}


def _linear(in_f: int, out_f: int, bias: bool, dtype: torch.dtype, seed: int) -> Linear:
    g = torch.Generator().manual_seed(seed)
    layer = Linear(in_f, out_f, bias=bias, dtype=dtype, device="cpu")
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_f, in_f, generator=g).to(dtype))
        if bias:
            layer.bias.copy_(torch.randn(out_f, generator=g).to(dtype))
    return layer


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 3, 8, 67])
@pytest.mark.parametrize("shape,bias", [((64, 96), False), ((130, 33), True), ((256, 512), False)])
def test_prepacked_matches_f_linear(dtype, rows, shape, bias):
    in_f, out_f = shape
    layer = _linear(in_f, out_f, bias, dtype, seed=rows + in_f)
    weight = layer.weight.detach().clone()
    b = layer.bias.detach().clone() if bias else None
    x = torch.randn(rows, in_f, generator=torch.Generator().manual_seed(rows)).to(dtype)
    expected = F.linear(x.float(), weight.float(), None if b is None else b.float())
    assert prepack(layer, MatmulBackend.ONEDNN) == 1
    assert layer.prepacked
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, out_f)
    torch.testing.assert_close(got.float(), expected, **TOLERANCE[dtype])


@needs_onednn
def test_prepacked_rows_do_not_depend_on_the_batch():
    layer = _linear(128, 200, False, torch.float32, seed=1)
    prepack(layer, MatmulBackend.ONEDNN)
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(2))
    together = layer(x)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(8)])
    assert torch.equal(together, alone)


def test_torch_backend_leaves_weights_plain():
    layer = _linear(16, 8, True, torch.float32, seed=3)
    assert prepack(layer, MatmulBackend.TORCH) == 0
    assert not layer.prepacked
    x = torch.randn(2, 16)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


def test_shared_weight_is_the_same_parameter_and_shape_checked():
    embedding = torch.nn.Parameter(torch.randn(10, 4), requires_grad=False)
    layer = Linear(4, 10, bias=False, dtype=torch.float32, device="cpu", shared_weight=embedding)
    assert layer.weight is embedding
    with pytest.raises(ValueError, match=r"shared weight shape \(10, 4\) is not \(4, 10\)"):
        Linear(10, 4, bias=False, dtype=torch.float32, device="cpu", shared_weight=embedding)


def test_resolve_backend():
    assert MatmulBackend.parse(" OneDNN ") is MatmulBackend.ONEDNN
    with pytest.raises(ValueError, match="auto\\|onednn\\|torch"):
        MatmulBackend.parse("mkl")
    assert resolve_backend("torch", torch.float32, CPU) is MatmulBackend.TORCH
    assert resolve_backend("auto", torch.float32, torch.device("cuda")) is MatmulBackend.TORCH
    with pytest.raises(ValueError, match="CPU path; the model is on cuda"):
        resolve_backend("onednn", torch.float32, torch.device("cuda"))
    assert "float16" in onednn_unsupported_reason(torch.float16, CPU)
    assert resolve_backend("auto", torch.float16, CPU) is MatmulBackend.TORCH
    if torch.backends.mkldnn.is_available():
        assert resolve_backend("auto", torch.bfloat16, CPU) is MatmulBackend.ONEDNN


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_without_onednns_bf16_linear_is_a_float32_gemm_of_the_same_values(
        monkeypatch, bias):
    """Where oneDNN has no bfloat16 linear (AVX2-only CPUs) a bfloat16 layer is
    packed as float32: exactly the float32 layer of the same (bfloat16) values,
    rounded back to bfloat16, and within bfloat16's tolerance of F.linear."""
    import engine.layers.linear as linear

    monkeypatch.setattr(linear, "upcasts_bfloat16", lambda: True)
    layer = _linear(256, 200, bias, torch.bfloat16, seed=5)
    as_float = _linear(256, 200, bias, torch.float32, seed=5)
    with torch.no_grad():  # the same bfloat16 values, held in float32
        as_float.weight.copy_(layer.weight.float())
        if bias:
            as_float.bias.copy_(layer.bias.float())
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(6)).bfloat16()
    expected = F.linear(x.float(), layer.weight.float(),
                        None if not bias else layer.bias.float())
    prepack(layer, MatmulBackend.ONEDNN)
    prepack(as_float, MatmulBackend.ONEDNN)
    assert layer.upcast and layer.weight.dtype == torch.float32
    got = layer(x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, as_float(x.float()).bfloat16())
    torch.testing.assert_close(got.float(), expected, **TOLERANCE[torch.bfloat16])


@needs_onednn
def test_engine_matmul_backends_agree_token_for_token(make_engine):
    from engine.sampling_params import SamplingParams

    prompts = [[5, 9, 33, 2, 17, 80, 4], [7] * 21]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = []
    for backend in ("torch", "onednn"):
        engine = make_engine(matmul_backend=backend)
        assert engine.matmul_backend is MatmulBackend(backend)
        outputs.append([r.token_ids for r in engine.generate(prompts, params)])
    assert outputs[0] == outputs[1]


@needs_native_gemm
@pytest.mark.parametrize("bias", [False, True])
def test_native_gemm_takes_every_row_in_place_of_onednn(bias):
    """With the native GEMM a layer holds its panels only (no oneDNN copy, no
    plain weight), and decode-sized and prefill-sized inputs alike (and a
    3-d input) get exactly what gemm.c gives them."""
    layer = _linear(300, 70, bias, torch.float32, seed=7)
    weight = layer.weight.detach().clone()
    b = None if not bias else layer.bias.detach().clone()
    assert prepack(layer, MatmulBackend.ONEDNN, native_gemm=True) == 1
    assert layer.native and not layer.prepacked
    assert torch.equal(layer.weight, native.pack_panels(weight))  # the only copy
    panels = native.pack_panels(weight)
    for rows in (1, 4, 9, 40):  # the 4-row path, then the 6-row tiles from 24 rows
        x = torch.randn(rows, 300, generator=torch.Generator().manual_seed(rows))
        got = layer(x)
        assert torch.equal(got, native.gemm_panels(x, panels, 70, b))
        torch.testing.assert_close(got, F.linear(x, weight, b), **TOLERANCE[torch.float32])
    x = torch.randn(2, 20, 300, generator=torch.Generator().manual_seed(3))
    assert torch.equal(layer(x), native.gemm_panels(x.reshape(40, 300), panels, 70, b)
                       .view(2, 20, 70))
    prepack(layer, MatmulBackend.ONEDNN, native_gemm=True)  # once only
    layer.prepack_onednn()
    assert layer.native and not layer.prepacked


def test_resolve_decode_matmul():
    assert DecodeMatmul.parse(" Native ") is DecodeMatmul.NATIVE
    with pytest.raises(ValueError, match="auto\\|native\\|off"):
        DecodeMatmul.parse("onednn")
    onednn, plain = MatmulBackend.ONEDNN, MatmulBackend.TORCH
    assert resolve_decode_matmul("off", torch.float32, CPU, onednn) is False
    assert resolve_decode_matmul("auto", torch.float32, CPU, plain) is False
    assert resolve_decode_matmul("auto", torch.float16, CPU, onednn) is False
    with pytest.raises(ValueError, match="projections run on torch, not oneDNN"):
        resolve_decode_matmul("native", torch.float32, CPU, plain)
    with pytest.raises(ValueError, match="float32 and bfloat16 on CPU, not torch.float16"):
        resolve_decode_matmul("native", torch.float16, CPU, onednn)
    assert resolve_decode_matmul("auto", torch.float32, CPU, onednn) is native.gemm_available()


@needs_native_gemm
def test_resolve_decode_matmul_bfloat16(monkeypatch):
    """bfloat16 takes the native GEMM under auto where oneDNN cannot
    multiply bfloat16 itself (it upcasts), and where it can on a CPU without
    AMX (the pairs kernel with AVX512-BF16, the widening one without);
    `native` forces it."""
    import engine.layers.linear as linear
    from kernels import native

    onednn = MatmulBackend.ONEDNN
    monkeypatch.setattr(linear, "upcasts_bfloat16", lambda: True)
    assert resolve_decode_matmul("auto", torch.bfloat16, CPU, onednn) is True
    monkeypatch.setattr(linear, "upcasts_bfloat16", lambda: False)
    for pairs, amx, auto in ((True, False, True), (True, True, False), (False, False, True),
                             (False, True, False)):
        monkeypatch.setattr(native, "gemm_bf16_pairs", lambda pairs=pairs: pairs)
        monkeypatch.setattr(linear, "has_amx", lambda amx=amx: amx)
        assert resolve_decode_matmul("auto", torch.bfloat16, CPU, onednn) is auto
        assert resolve_decode_matmul("native", torch.bfloat16, CPU, onednn) is True
        assert resolve_decode_matmul("off", torch.bfloat16, CPU, onednn) is False


@needs_native_gemm
@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_native_gemm_holds_bfloat16_panels_only(bias):
    """A bfloat16 layer on the native GEMM keeps its weight as bfloat16 panels
    only (half the bytes of the float32 copy oneDNN multiplies on an AVX2
    CPU): every row is gemm_panels_bf16's, within bfloat16's tolerance of
    F.linear."""
    layer = _linear(300, 70, bias, torch.bfloat16, seed=11)
    weight = layer.weight.detach().clone()
    b = None if not bias else layer.bias.detach().float()
    assert prepack(layer, MatmulBackend.ONEDNN, native_gemm=True) == 1
    assert layer.native and not layer.prepacked and not layer.upcast
    assert layer.weight.dtype == torch.bfloat16
    assert torch.equal(layer.weight, native.pack_panels_bf16(weight))  # the only copy
    for rows in (1, 9, 40):
        x = torch.randn(rows, 300, generator=torch.Generator().manual_seed(rows)).bfloat16()
        got = layer(x)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, native.gemm_panels_bf16(x, layer.weight, 70, b))
        torch.testing.assert_close(got.float(), F.linear(x.float(), weight.float(), b),
                                   **TOLERANCE[torch.bfloat16])


@needs_native_gemm
def test_engine_native_gemm_or_onednn_agree_token_for_token(make_engine):
    """A mixed batch (decode rows beside prefill chunks, chunked prefill)
    gives the same greedy tokens with every projection on the native GEMM as
    on oneDNN."""
    from engine.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(10, 1100, (n,), generator=g).tolist() for n in (3, 40, 17, 90)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = []
    for decode_matmul in ("off", "native"):
        engine = make_engine(decode_matmul=decode_matmul, max_num_batched_tokens=32)
        assert engine.native_gemm is (decode_matmul == "native")
        qkv = engine.model.model.layers[0].self_attn.qkv_proj
        assert (qkv.native, qkv.prepacked) == ((True, False) if engine.native_gemm
                                               else (False, True))
        outputs.append([r.token_ids for r in engine.generate(prompts, params)])
    assert outputs[0] == outputs[1]
