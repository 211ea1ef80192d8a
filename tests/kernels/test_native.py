"""kernels/native (C decode attention, RMSNorm and RoPE for CPU pods) against the torch references,
its bounds checks, its build cache, and the dispatch that picks it."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import native, reference
from kernels.native import loader
from tests.kernels.cases import DTYPE_IDS, DTYPES, assert_close, generator, make_paged_case, randn

pytestmark = pytest.mark.skipif(native.library() is None,
                                reason="no C compiler: native kernels unavailable")

CASES = {
    # name: (block_size, head_dim, kv_heads, group, context_lens, window)
    "one_token": (16, 64, 1, 1, [1], None),
    "many_short": (16, 128, 2, 4, [3, 1, 17, 16, 33, 9, 2, 5], None),
    "one_long_split_heads": (256, 64, 4, 8, [700], None),
    "window": (32, 128, 2, 2, [100, 5, 64], 40),
    "padding_row": (64, 64, 1, 16, [130, 0], None),
    "wide_group_window": (128, 128, 1, 20, [129, 1], 128),
    "head_dim_80": (16, 80, 2, 3, [47, 16, 1], None),
    "head_dim_96": (16, 96, 2, 3, [47, 16, 1, 0], None),  # Phi-3-mini
    "head_dim_96_window": (32, 96, 4, 8, [300, 33], 100),
    "head_dim_256": (16, 256, 2, 2, [70, 1, 33], None),  # Gemma 2 2B/9B, Gemma 3 1B
    "head_dim_256_window": (64, 256, 1, 4, [300, 5], 50),
}


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name, dtype, threads):
    block_size, head_dim, kv_heads, group, lens, window = CASES[name]
    case = make_paged_case(11 * len(lens) + len(name) + threads, lens, dtype=dtype,
                           num_kv_heads=kv_heads, group=group, head_dim=head_dim,
                           block_size=block_size)
    assert native.supports(case.q, case.kv_cache)
    expected = reference.paged_decode_attention_reference(
        case.q, case.kv_cache, case.block_tables, case.context_lens,
        scale=case.scale, sliding_window=window)
    got = native.paged_decode_attention(case.q, case.kv_cache, case.block_tables,
                                        case.context_lens, scale=case.scale,
                                        sliding_window=window, num_threads=threads)
    assert got.dtype == dtype and got.shape == case.q.shape
    assert_close(got, expected)


# The kernel scores TILE = 8 (AVX2) or 16 (AVX-512) tokens at a time, takes
# CHUNK = 32 per step and runs the softmax 8 or 16 lanes at a time
# (paged_decode_simd.h): lengths around and between those, chunks that cross
# blocks of 16 and 128, windows starting off both grids.
TILING_LENS = [1, 7, 8, 9, 15, 16, 17, 31, 33, 300, 1025]
TILING_VARIANTS = {
    # name: (sliding_window, softcap, scale factor, threads)
    "full": (None, None, 1.0, 1),
    # starts at len - 37: 263 for 300, 988 for 1025 (neither a multiple of 8)
    "window": (37, None, 1.0, 2),
    # softcap 2 puts scores on both sides of tanh's |x| = 0.625 branch; the
    # larger scale gives peaked softmaxes (exp far below 0)
    "window_softcap_sharp": (100, 2.0, 6.0, 3),
}


@pytest.mark.parametrize("variant", list(TILING_VARIANTS))
@pytest.mark.parametrize("group", [1, 3, 4, 8])  # 3: SmolLM2-135M's 9 / 3 heads
@pytest.mark.parametrize("head_dim", [64, 96, 256])
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_tiling_matches_reference(dtype, block_size, head_dim, group, variant):
    window, softcap, sharpen, threads = TILING_VARIANTS[variant]
    case = make_paged_case(block_size + head_dim + 7 * group + len(variant), TILING_LENS,
                           dtype=dtype, num_kv_heads=2, group=group, head_dim=head_dim,
                           block_size=block_size)
    scale = case.scale * sharpen
    expected = reference.paged_decode_attention_reference(
        case.q, case.kv_cache, case.block_tables, case.context_lens, scale=scale,
        sliding_window=window, softcap=softcap)
    got = native.paged_decode_attention(case.q, case.kv_cache, case.block_tables,
                                        case.context_lens, scale=scale, sliding_window=window,
                                        softcap=softcap, num_threads=threads)
    assert_close(got, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("length", [9, 1025])
def test_one_sequence_split_over_threads_by_kv_head_matches_reference(dtype, length):
    # batch 1 on 4 threads: each thread takes one of the 4 KV heads
    case = make_paged_case(length, [length], dtype=dtype, num_kv_heads=4, group=4,
                           head_dim=64, block_size=16)
    expected = reference.paged_decode_attention_reference(
        case.q, case.kv_cache, case.block_tables, case.context_lens, scale=case.scale,
        sliding_window=length - 5)
    got = native.paged_decode_attention(case.q, case.kv_cache, case.block_tables,
                                        case.context_lens, scale=case.scale,
                                        sliding_window=length - 5, num_threads=4)
    assert_close(got, expected)


def test_rows_of_length_zero_are_zeros_even_with_a_garbage_table_row():
    case = make_paged_case(3, [0, 20], dtype=torch.float32, num_kv_heads=2, group=2,
                           head_dim=64, block_size=16)
    tables = case.block_tables.clone()
    tables[0, :] = -5  # a zero-length row reads nothing, so its table is never checked
    got = native.paged_decode_attention(case.q, case.kv_cache, tables, case.context_lens,
                                        scale=case.scale)
    assert torch.equal(got[0], torch.zeros_like(got[0]))


@pytest.mark.parametrize("bad", ["block_id", "negative_block_id", "context_len"])
def test_out_of_range_arguments_raise_instead_of_reading_out_of_bounds(bad):
    case = make_paged_case(4, [20, 40], dtype=torch.float32, num_kv_heads=1, group=2,
                           head_dim=64, block_size=16)
    tables, lens = case.block_tables.clone(), case.context_lens.clone()
    if bad == "block_id":
        tables[1, 1] = case.kv_cache.shape[1]  # one past the last block, and used
    elif bad == "negative_block_id":
        tables[0, 0] = -1
    else:
        lens[0] = tables.shape[1] * 16 + 1  # longer than its table can map
    with pytest.raises(native.NativeKernelError, match="out of range"):
        native.paged_decode_attention(case.q, case.kv_cache, tables, lens, scale=case.scale)


def test_unsupported_inputs_are_declined():
    case = make_paged_case(6, [5], dtype=torch.float32, num_kv_heads=1, group=1,
                           head_dim=64, block_size=16)
    assert not native.supports(case.q.to(torch.bfloat16), case.kv_cache)  # mixed dtypes
    odd = make_paged_case(6, [5], dtype=torch.float32, num_kv_heads=1, group=1,
                          head_dim=24, block_size=16)
    assert not native.supports(odd.q, odd.kv_cache)  # head_dim not a multiple of 16


def test_build_is_cached_by_content_and_atomic(tmp_path):
    first = native.build(tmp_path)
    assert first.is_file() and first.parent == tmp_path
    mtime = first.stat().st_mtime_ns
    assert native.build(tmp_path) == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no scratch files left


def test_build_without_a_compiler_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(loader.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="no C compiler"):
        native.build(tmp_path)


def test_dispatch_auto_on_cpu_takes_the_native_kernel(monkeypatch):
    case = make_paged_case(9, [5], dtype=torch.float32, num_kv_heads=1, group=1,
                           head_dim=64, block_size=16)
    called = []
    monkeypatch.setattr(kernels.dispatch.native, "paged_decode_attention",
                        lambda *a, **k: called.append("native") or case.q)
    monkeypatch.setattr(kernels.dispatch.reference, "paged_decode_attention_reference",
                        lambda *a, **k: called.append("reference") or case.q)
    args = (case.q, case.kv_cache, case.block_tables, case.context_lens)
    kernels.paged_decode_attention(*args, scale=case.scale)
    kernels.paged_decode_attention(*args, scale=case.scale, backend="torch")
    assert called == ["native", "reference"]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (8, 1024), (37, 96), (300, 576)])
def test_rms_norm_matches_reference(rows, hidden, with_residual, dtype):
    gen = generator(rows * hidden + with_residual)
    wide = randn((rows, hidden + 32), dtype, gen)
    x = wide[:, 16 : 16 + hidden]  # strided rows, as a split of a wider output is
    weight = randn((hidden,), dtype, gen)
    residual = randn((rows, hidden), dtype, gen) if with_residual else None
    assert native.supports_rms_norm(x, weight, residual)
    before = x.clone(), None if residual is None else residual.clone()
    expected = reference.rms_norm_reference(x, weight, 1e-5, residual)
    got = native.rms_norm(x, weight, 1e-5, residual)
    if with_residual:
        assert_close(got[0], expected[0])
        assert torch.equal(got[1], expected[1])  # the rounded sum is exact in every dtype
        assert torch.equal(residual, before[1])
    else:
        assert_close(got, expected)
    assert torch.equal(x, before[0])  # inputs untouched


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("q_heads,k_heads,head_dim",
                         [(4, 1, 64), (16, 4, 128), (6, 2, 80), (8, 2, 96), (4, 1, 256)])
def test_rotary_matches_reference_on_split_views(q_heads, k_heads, head_dim, dtype):
    gen = generator(q_heads * head_dim)
    rows, max_pos = 13, 512
    qkv = randn((rows, (q_heads + 2 * k_heads) * head_dim), dtype, gen)
    q, k, _ = qkv.split([q_heads * head_dim, k_heads * head_dim, k_heads * head_dim], dim=-1)
    q, k = q.reshape(rows, q_heads, head_dim), k.reshape(rows, k_heads, head_dim)
    cache = torch.randn((max_pos, head_dim), generator=gen)
    positions = torch.randint(0, max_pos, (rows,), generator=gen)
    assert native.supports_rotary(positions, q, k, cache)
    expected = reference.rotary_embedding_reference(positions, q, k, cache)
    got = native.rotary_embedding(positions, q, k, cache)
    assert_close(got[0], expected[0])
    assert_close(got[1], expected[1])


def test_prompt_rows_shared_among_threads_give_what_one_thread_gives():
    """From 64 rows RMSNorm and RoPE share rows among torch's threads
    (elementwise.c): each row is computed alone, so the result is the same
    bits whatever the threads, and both still match the torch reference."""
    gen = generator(4242)
    rows, hidden, heads, head_dim, max_pos = 300, 576, 9, 64, 4096
    x = randn((rows, hidden), torch.bfloat16, gen)
    residual = randn((rows, hidden), torch.bfloat16, gen)
    weight = randn((hidden,), torch.bfloat16, gen)
    q = randn((rows, heads, head_dim), torch.float32, gen)
    k = randn((rows, 3, head_dim), torch.float32, gen)
    cache = torch.randn((max_pos, head_dim), generator=gen)
    positions = torch.randint(0, max_pos, (rows,), generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.rms_norm(x, weight, 1e-5, residual), native.rotary_embedding(
            positions, q, k, cache)
        torch.set_num_threads(max(threads, 2))
        shared = native.rms_norm(x, weight, 1e-5, residual), native.rotary_embedding(
            positions, q, k, cache)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip((*one[0], *one[1]), (*shared[0], *shared[1]), strict=True):
        assert torch.equal(a, b)
    expected = reference.rotary_embedding_reference(positions, q, k, cache)
    assert_close(shared[1][0], expected[0])
    assert_close(shared[1][1], expected[1])


def test_rotary_position_outside_the_cache_raises():
    q, k = torch.randn(2, 2, 64), torch.randn(2, 1, 64)
    cache = torch.randn(16, 64)
    with pytest.raises(native.NativeKernelError, match="out of range"):
        native.rotary_embedding(torch.tensor([3, 16]), q, k, cache)


def test_dispatch_auto_on_cpu_takes_native_norm_and_rotary(monkeypatch):
    called = []
    monkeypatch.setattr(kernels.dispatch.native, "rms_norm",
                        lambda *a, **k: called.append("norm"))
    monkeypatch.setattr(kernels.dispatch.native, "rotary_embedding",
                        lambda *a, **k: called.append("rotary"))
    x, w = torch.randn(2, 64), torch.randn(64)
    kernels.rms_norm(x, w, 1e-6)
    kernels.rms_norm(x, w, 1e-6, backend="torch")
    q, k, cache = torch.randn(2, 2, 64), torch.randn(2, 1, 64), torch.randn(16, 64)
    kernels.rotary_embedding(torch.tensor([0, 1]), q, k, cache)
    kernels.rotary_embedding(torch.tensor([0, 1]), q, k, cache, backend="torch")
    assert called == ["norm", "rotary"]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [64, 96, 256])
def test_inject_kv_matches_reference_with_padding_and_strided_rows(head_dim, dtype):
    gen = generator(17 + head_dim)
    cache = randn((2, 6, 16, 2, head_dim), dtype, gen)
    expected = cache.clone()
    # src as the attention context builds it: K and V rows of a qkv split, stacked
    k, v = randn((9, 2, head_dim), dtype, gen), randn((9, 2, head_dim), dtype, gen)
    src = torch.stack((k, v))
    slots = torch.tensor([5, -1, 17, 95, 0, -3, 40, 41, 64])
    reference.inject_kv_reference(expected, src, slots)
    assert native.supports_inject(cache, src, slots)
    native.inject_kv(cache, src, slots)
    assert torch.equal(cache, expected)
    # rows strided, head rows not adjacent
    wide = randn((2, 9, 2, 2 * head_dim), dtype, gen)[..., :head_dim]
    assert not native.supports_inject(cache, wide, slots)


def test_inject_kv_slot_past_the_cache_raises_and_writes_nothing():
    cache = torch.zeros(2, 2, 16, 1, 64)
    src = torch.ones(2, 3, 1, 64)
    with pytest.raises(native.NativeKernelError, match="out of range"):
        native.inject_kv(cache, src, torch.tensor([0, 1, 32]))
    assert not cache.any()
