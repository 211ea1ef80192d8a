"""The compiled Triton kernels on a real CUDA device against the torch references.

Skipped without CUDA; on a GPU machine the file re-runs itself with compiled
Triton kernels (tests/gpu_rerun.py).
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from tests.gpu_rerun import GPU_MARKS, compiled_only, needs_rerun, rerun_compiled
from tests.kernels.cases import DTYPE_IDS, DTYPES, assert_close, make_paged_case, rope_cache

pytestmark = GPU_MARKS


@pytest.mark.timeout(900)
@needs_rerun
def test_gpu_suite_compiled():
    rerun_compiled(__file__)


def _cuda(case):
    return [t.cuda() for t in (case.q, case.kv_cache, case.block_tables, case.context_lens)]


@compiled_only
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("block_size", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("head_dim,group", [(64, 1), (128, 4), (128, 8), (64, 40), (96, 3),
                                            (256, 2), (256, 40)])
@pytest.mark.parametrize("window", [None, 300])
def test_decode_attention_on_gpu(dtype, block_size, head_dim, group, window):
    from kernels.paged_attention import paged_decode_attention_triton

    case = make_paged_case(block_size + head_dim + group, [1, 17, 1000, 4097, 255, 0],
                           dtype=dtype, num_kv_heads=2, group=group, head_dim=head_dim,
                           block_size=block_size)
    q, kv, tables, lens = _cuda(case)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention_triton(q, kv, tables, lens, scale=case.scale,
                                  sliding_window=window, out=out)
    expected = reference.paged_decode_attention_reference(
        q, kv, tables, lens, scale=case.scale, sliding_window=window)
    assert_close(out, expected)


@compiled_only
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("block_size", [16, 128, 256])
@pytest.mark.parametrize("head_dim,group", [(64, 1), (128, 8), (128, 20), (96, 8), (256, 1),
                                            (256, 2), (256, 40)])
@pytest.mark.parametrize("window", [None, 300])
def test_prefill_attention_on_gpu(dtype, block_size, head_dim, group, window):
    from kernels.prefill_attention import paged_prefill_attention_triton

    lens, qlens = [1000, 513, 7, 2048], [200, 513, 1, 0]
    case = make_paged_case(block_size + group, lens, dtype=dtype, num_kv_heads=2, group=group,
                           head_dim=head_dim, block_size=block_size)
    _, kv, tables, context_lens = _cuda(case)
    gen = torch.Generator().manual_seed(group)
    q = torch.randn((sum(qlens), 2 * group, head_dim), generator=gen).to(dtype).cuda()
    starts = torch.tensor([0, 200, 713, 714, 714], dtype=torch.int32).cuda()
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention_triton(q, kv, tables, starts, context_lens, scale=case.scale,
                                   sliding_window=window, out=out)
    expected = reference.paged_prefill_attention_reference(
        q, kv, tables, starts, context_lens, scale=case.scale, sliding_window=window)
    assert_close(out, expected)


@compiled_only
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [96, 128, 256])
def test_kv_copy_on_gpu(dtype, head_dim):
    from kernels.kv_copy import extract_kv_triton, inject_kv_triton

    gen = torch.Generator().manual_seed(3)
    cache = torch.randn((2, 300, 128, 8, head_dim), generator=gen).to(dtype).cuda()
    slots = torch.randperm(300 * 128, generator=gen)[:5000].cuda()
    slots[::97] = -1
    src = torch.randn((2, 5000, 8, head_dim), generator=gen).to(dtype).cuda()
    expected = cache.clone()
    reference.inject_kv_reference(expected, src, slots)
    inject_kv_triton(cache, src, slots)
    assert torch.equal(cache, expected)
    out = torch.full_like(src, float("nan"))
    extract_kv_triton(cache, slots, out)
    assert torch.equal(out, reference.extract_kv_reference(cache, slots))


@compiled_only
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden", [4096, 5120, 16384])
def test_rms_norm_on_gpu(dtype, hidden):
    from kernels.norm import rms_norm_triton

    gen = torch.Generator().manual_seed(hidden)
    x, residual = (torch.randn((333, hidden), generator=gen).to(dtype).cuda() for _ in range(2))
    weight = torch.randn((hidden,), generator=gen).to(dtype).cuda()
    y, r = rms_norm_triton(x, weight, 1e-5, residual)
    want_y, want_r = reference.rms_norm_reference(x, weight, 1e-5, residual)
    assert_close(y, want_y)
    assert torch.equal(r, want_r)


@compiled_only
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_rotary_on_gpu(dtype, head_dim):
    from kernels.rotary import rotary_embedding_triton

    gen = torch.Generator().manual_seed(head_dim)
    positions = torch.randint(0, 8192, (777,), generator=gen).cuda()
    q = torch.randn((777, 32, head_dim), generator=gen).to(dtype).cuda()
    k = torch.randn((777, 8, head_dim), generator=gen).to(dtype).cuda()
    cache = rope_cache(8192, head_dim).cuda()
    got_q, got_k = rotary_embedding_triton(positions, q, k, cache)
    want_q, want_k = reference.rotary_embedding_reference(positions, q, k, cache)
    assert_close(got_q, want_q)
    assert_close(got_k, want_k)
