"""kernels/fused.py (SwiGLU's activation; a decode step's attention from its qkv
projection) and RMSNorm into preallocated / in-place outputs: every backend
against the torch composition of the same steps, on fresh random inputs of
several shapes, odd sizes included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import native, reference
from tests.kernels.cases import (
    DTYPE_IDS,
    DTYPES,
    assert_close,
    generator,
    make_paged_case,
    randn,
    rope_cache,
)

needs_native = pytest.mark.skipif(native.library() is None,
                                  reason="no C compiler: native kernels unavailable")
# float32 SiLU: the native exp is a polynomial, a few ulp from torch's.
SILU_FP32_TOL = 1e-6


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows,inter", [(1, 7), (3, 40), (8, 2816), (5, 33), (300, 2816)])
def test_silu_and_mul_matches_torch(rows, inter, dtype):
    gen = generator(rows * 7 + inter)
    wide = randn((rows, 2 * inter + 24), dtype, gen) * 4  # gate values well past +-8
    x = wide[:, 8 : 8 + 2 * inter]  # strided rows
    gate, up = x.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    got = kernels.silu_and_mul(x)
    assert got.shape == (rows, inter) and got.dtype == dtype and got.is_contiguous()
    if dtype is torch.float32:
        torch.testing.assert_close(got, expected, atol=SILU_FP32_TOL, rtol=SILU_FP32_TOL)
    else:
        assert_close(got, expected)
    assert torch.equal(kernels.silu_and_mul(x, backend="torch"), expected)


@needs_native
def test_silu_and_mul_far_tails_and_zero():
    x = torch.tensor([[-200.0, -88.0, -20.0, 0.0, 20.0, 88.0, 200.0, -1e-30] * 2
                      + [1.5] * 16])
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_and_mul(x), F.silu(gate) * up,
                               atol=SILU_FP32_TOL, rtol=SILU_FP32_TOL)


def test_silu_and_mul_refuses_bad_input():
    with pytest.raises(ValueError, match="must be even"):
        kernels.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="2-D"):
        kernels.silu_and_mul(torch.randn(2, 2, 8))
    with pytest.raises(ValueError, match="dtype"):
        kernels.silu_and_mul(torch.ones(2, 8, dtype=torch.int32))


# name: (block_size, head_dim, kv_heads, group, context_lens, window)
QKV_CASES = {
    "batch8": (16, 64, 4, 4, [300, 1, 17, 16, 33, 290, 2, 129], None),
    "one_row": (16, 128, 1, 1, [5], None),
    "padding_row": (16, 64, 2, 3, [40, 0, 7], None),
    "window_big_blocks": (128, 128, 2, 2, [300, 5, 129], 40),
    "odd_batch_group5": (32, 64, 1, 5, [3, 64, 65, 1, 31], None),
    "head_dim_96": (16, 96, 4, 3, [300, 1, 0, 40], None),  # Phi-3-mini: 32 / 32 heads of 96
    "head_dim_256_window": (32, 256, 1, 4, [129, 7, 300], 64),  # Gemma 3 1B: 4 / 1 of 256
}


def _decode_inputs(name: str, dtype: torch.dtype):
    block_size, head_dim, kv_heads, group, lens, window = QKV_CASES[name]
    case = make_paged_case(len(name) * 13 + len(lens), lens, dtype=dtype,
                           num_kv_heads=kv_heads, group=group, head_dim=head_dim,
                           block_size=block_size)
    gen = generator(len(name))
    batch, width = len(lens), (kv_heads * group + 2 * kv_heads) * head_dim
    qkv = randn((batch, width + 16), dtype, gen)[:, 8 : 8 + width]  # strided rows
    positions = torch.tensor([max(n - 1, 0) for n in lens])
    # Each row's new token goes to the slot of its last position; padding rows to -1.
    slots = torch.tensor([int(case.block_tables[b, (n - 1) // block_size]) * block_size
                          + (n - 1) % block_size if n else -1 for b, n in enumerate(lens)])
    return case, qkv, positions, slots, rope_cache(512, head_dim), window


def _split_path(case, qkv, positions, slots, cos_sin, window, cache, backend):
    """The unfused path the model takes outside pure-decode steps."""
    batch, kv_heads, head_dim = qkv.shape[0], cache.shape[3], cache.shape[4]
    q, k, v = qkv.split([qkv.shape[1] - 2 * kv_heads * head_dim, kv_heads * head_dim,
                         kv_heads * head_dim], dim=-1)
    q, k = kernels.rotary_embedding(positions, q.reshape(batch, -1, head_dim),
                                    k.reshape(batch, kv_heads, head_dim), cos_sin,
                                    backend=backend)
    kernels.inject_kv(cache, torch.stack((k, v.reshape(batch, kv_heads, head_dim))), slots,
                      backend=backend)
    return kernels.paged_decode_attention(q, cache, case.block_tables, case.context_lens,
                                          scale=case.scale, sliding_window=window,
                                          backend=backend)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", list(QKV_CASES))
def test_decode_qkv_attention_matches_the_split_path(name, dtype):
    case, qkv, positions, slots, cos_sin, window = _decode_inputs(name, dtype)
    expected_cache = case.kv_cache.clone()
    expected = _split_path(case, qkv.clone(), positions, slots, cos_sin, window,
                           expected_cache, "torch")
    for backend in ("auto", "torch"):
        cache = case.kv_cache.clone()
        got = kernels.decode_qkv_attention(
            qkv.clone(), positions, cos_sin, cache, slots, case.block_tables,
            case.context_lens, scale=case.scale, sliding_window=window, backend=backend)
        assert got.shape == (qkv.shape[0], case.q.shape[1], case.q.shape[2])
        assert_close(got, expected)
        assert_close(cache, expected_cache)  # RoPE'd K and copied V in their slots
        if backend == "torch":
            assert torch.equal(got, expected) and torch.equal(cache, expected_cache)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_native_fused_equals_native_split_bit_for_bit(dtype):
    case, qkv, positions, slots, cos_sin, window = _decode_inputs("batch8", dtype)
    split_cache, fused_cache = case.kv_cache.clone(), case.kv_cache.clone()
    split = _split_path(case, qkv.clone(), positions, slots, cos_sin, window, split_cache, "auto")
    fused = kernels.decode_qkv_attention(qkv.clone(), positions, cos_sin, fused_cache, slots,
                                         case.block_tables, case.context_lens, scale=case.scale)
    assert torch.equal(fused, split) and torch.equal(fused_cache, split_cache)


@needs_native
@pytest.mark.parametrize("bad", ["position", "slot"])
def test_decode_qkv_out_of_range_raises_and_writes_nothing(bad):
    case, qkv, positions, slots, cos_sin, _ = _decode_inputs("padding_row", torch.float32)
    if bad == "position":
        positions = positions.clone()
        positions[2] = cos_sin.shape[0]
    else:
        slots = slots.clone()
        slots[0] = case.kv_cache.shape[1] * case.kv_cache.shape[2]
    cache = case.kv_cache.clone()
    with pytest.raises(native.NativeKernelError, match="out of range"):
        kernels.decode_qkv_attention(qkv, positions, cos_sin, cache, slots, case.block_tables,
                                     case.context_lens, scale=case.scale)
    assert torch.equal(cache, case.kv_cache)


def test_decode_qkv_refuses_bad_arguments():
    case, qkv, positions, slots, cos_sin, _ = _decode_inputs("padding_row", torch.float32)
    args = (positions, cos_sin, case.kv_cache, slots, case.block_tables, case.context_lens)
    with pytest.raises(ValueError, match="qkv width"):
        kernels.decode_qkv_attention(qkv[:, :-8], *args, scale=case.scale)
    with pytest.raises(ValueError, match="dtype"):
        kernels.decode_qkv_attention(qkv.to(torch.bfloat16), *args, scale=case.scale)
    with pytest.raises(ValueError, match="slot_mapping has"):
        kernels.decode_qkv_attention(qkv, positions, cos_sin, case.kv_cache, slots[:2],
                                     case.block_tables, case.context_lens, scale=case.scale)
    with pytest.raises(ValueError, match="positions must be int64"):
        kernels.decode_qkv_attention(qkv, positions.int(), *args[1:], scale=case.scale)


def test_bound_decode_attention_checks_again_when_a_layer_differs():
    case, qkv, positions, slots, cos_sin, _ = _decode_inputs("padding_row", torch.float32)
    op = kernels.DecodeQKVAttention(positions, cos_sin, slots, case.block_tables,
                                    case.context_lens, scale=case.scale)
    first = op(qkv.clone(), case.kv_cache.clone())
    assert torch.equal(op(qkv.clone(), case.kv_cache.clone()), first)  # same layout: bound call
    with pytest.raises(ValueError, match="qkv width"):
        op(qkv[:, :-8], case.kv_cache)
    with pytest.raises(ValueError, match="dtype"):
        op(qkv, case.kv_cache.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (8, 1024), (37, 96)])
def test_rms_norm_in_place_equals_new_outputs(rows, hidden, backend, dtype):
    gen = generator(rows + hidden)
    x, residual = randn((rows, hidden), dtype, gen), randn((rows, hidden), dtype, gen)
    weight = randn((hidden,), dtype, gen)
    expected, expected_sum = kernels.rms_norm(x, weight, 1e-5, residual, backend=backend)
    assert_close(expected, reference.rms_norm_reference(x, weight, 1e-5, residual)[0])
    got = kernels.rms_norm(x, weight, 1e-5, residual, out=x, residual_out=residual,
                           backend=backend)
    assert got[0] is x and got[1] is residual
    assert torch.equal(x, expected) and torch.equal(residual, expected_sum)
    plain = kernels.rms_norm(expected_sum, weight, 1e-5, backend=backend)
    out = torch.empty_like(plain)
    assert kernels.rms_norm(expected_sum, weight, 1e-5, out=out, backend=backend) is out
    assert torch.equal(out, plain)


def test_rms_norm_refuses_bad_outputs():
    x, w, r = torch.randn(4, 64), torch.randn(64), torch.randn(4, 64)
    with pytest.raises(ValueError, match="out"):
        kernels.rms_norm(x, w, 1e-5, r, out=torch.empty(4, 32))
    with pytest.raises(ValueError, match="must be contiguous"):
        kernels.rms_norm(x, w, 1e-5, r, out=torch.empty(64, 4).t())
    with pytest.raises(ValueError, match="residual_out given without a residual"):
        kernels.rms_norm(x, w, 1e-5, residual_out=r)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", ["padding_row", "window_big_blocks"])
def test_decode_qkv_attention_triton_backend(name, dtype):
    """The composed path through the Triton kernels (interpreted here), as on CUDA."""
    pytest.importorskip("numpy")
    pytest.importorskip("triton")
    case, qkv, positions, slots, cos_sin, window = _decode_inputs(name, dtype)
    expected_cache = case.kv_cache.clone()
    expected = _split_path(case, qkv.clone(), positions, slots, cos_sin, window,
                           expected_cache, "torch")
    cache = case.kv_cache.clone()
    got = kernels.decode_qkv_attention(qkv.clone(), positions, cos_sin, cache, slots,
                                       case.block_tables, case.context_lens, scale=case.scale,
                                       sliding_window=window, backend="triton")
    assert_close(got, expected)
    assert_close(cache, expected_cache)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rms_norm_in_place_triton_backend(dtype):
    pytest.importorskip("numpy")
    pytest.importorskip("triton")
    gen = generator(5)
    x, residual = randn((5, 96), dtype, gen), randn((5, 96), dtype, gen)
    weight = randn((96,), dtype, gen)
    expected, expected_sum = reference.rms_norm_reference(x, weight, 1e-5, residual)
    kernels.rms_norm(x, weight, 1e-5, residual, out=x, residual_out=residual, backend="triton")
    assert_close(x, expected)
    assert torch.equal(residual, expected_sum)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_residual_rms_norm_equals_rms_norm_and_checks_new_layouts(backend, dtype):
    gen = generator(23)
    weight = randn((96,), dtype, gen)
    norm = kernels.ResidualRMSNorm(weight, 1e-5, backend=backend)
    for rows in (3, 3, 8):  # a repeated layout, then a new one
        x, residual = randn((rows, 96), dtype, gen), randn((rows, 96), dtype, gen)
        expected = kernels.rms_norm(x, weight, 1e-5, residual, backend=backend)
        got = norm(x, residual)
        assert got[0] is x and got[1] is residual
        assert torch.equal(x, expected[0]) and torch.equal(residual, expected[1])
    with pytest.raises(ValueError, match="residual"):
        norm(torch.randn(8, 96).to(dtype), torch.randn(8, 95).to(dtype))
    with pytest.raises(ValueError, match="weight shape"):
        norm(torch.randn(8, 64).to(dtype), torch.randn(8, 64).to(dtype))
