"""kernels/native/prefill_attention.c (causal prefill attention, flash-style)
against a float64 torch reference on fresh random inputs."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import native

pytestmark = pytest.mark.skipif(
    not native.prefill_attention_available(),
    reason="native prefill attention unavailable (no compiler, or no AVX2 + FMA)")


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: int | None) -> torch.Tensor:
    """Scores, mask, softmax and weighted sum in float64: query i at position
    L - n + i sees keys j <= L - n + i (and j > L - n + i - window)."""
    n, num_q_heads, _ = q.shape
    length, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    queries = q.double().transpose(0, 1)                                     # [Hq, n, D]
    keys = k.double().repeat_interleave(group, dim=1).transpose(0, 1)         # [Hq, L, D]
    values = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = queries @ keys.transpose(1, 2) * scale
    query_pos = torch.arange(length - n, length)[:, None]
    key_pos = torch.arange(length)[None, :]
    visible = key_pos <= query_pos
    if window is not None:
        visible &= key_pos > query_pos - window
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return (probs @ values).transpose(0, 1)                                   # [n, Hq, D]


def _inputs(seed: int, n: int, length: int, num_kv_heads: int, group: int, head_dim: int,
            dtype: torch.dtype = torch.float32):
    """q, k, v as the engine has them: views into one wide [L, (Hq + 2 Hkv) D]
    projection output (rows strided), q being its last n rows."""
    g = torch.Generator().manual_seed(seed)
    num_q_heads = num_kv_heads * group
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(length, width, generator=g).to(dtype)
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    q = qkv[length - n:, :q_size].view(n, num_q_heads, head_dim)
    k = qkv[:, q_size:q_size + kv_size].view(length, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size:].view(length, num_kv_heads, head_dim)
    return q, k, v


# (n, L): n == L is a whole prompt, n < L a chunk after a cached prefix.
LENGTHS = [(1, 1), (2, 2), (7, 7), (64, 64), (129, 129), (300, 300),
           (1, 5), (2, 97), (7, 50), (64, 65), (129, 1000), (300, 301)]


@pytest.mark.parametrize("n,length", LENGTHS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_kv_heads,group", [(3, 1), (3, 3), (2, 4), (1, 8)])
def test_float32_matches_float64_reference(n, length, head_dim, num_kv_heads, group):
    q, k, v = _inputs(n * 7919 + length * 31 + head_dim + group, n, length, num_kv_heads,
                      group, head_dim)
    assert n == 1 or q.stride(0) > q.shape[1] * head_dim  # read in place, not copied
    scale = 1.0 / math.sqrt(head_dim)
    threads = 1 + (n + length) % 3
    got = native.prefill_attention(q, k, v, scale=scale, num_threads=threads)
    assert got.shape == q.shape and got.dtype == torch.float32 and got.is_contiguous()
    torch.testing.assert_close(got.double(), _reference(q, k, v, scale, None),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [1, 2, 7, 48, 49, 100, 1000])
@pytest.mark.parametrize("n,length", [(1, 300), (7, 7), (129, 129), (129, 400), (300, 301)])
def test_sliding_window(window, n, length):
    q, k, v = _inputs(window * 101 + n + length, n, length, 2, 4, 64)
    got = native.prefill_attention(q, k, v, scale=0.125, sliding_window=window, num_threads=2)
    torch.testing.assert_close(got.double(), _reference(q, k, v, 0.125, window),
                               rtol=1e-5, atol=1e-5)


def test_a_row_never_sees_nothing():
    """A query always sees its own key, so no row is all masked: with a
    window of 1 it sees exactly that one, with probability 1, and its
    output is that key's V row bit for bit (no NaN from an empty softmax)."""
    q, k, v = _inputs(5, 100, 260, 2, 4, 64)
    got = native.prefill_attention(q, k, v, scale=0.125, sliding_window=1, num_threads=3)
    expected = v[160:].repeat_interleave(4, dim=1)
    assert torch.equal(got, expected)


def test_sharp_softmax_and_large_scores():
    """Scores hundreds apart (exp underflows to 0 for all but the top keys) and
    a running max that jumps late (the rescale of everything before it)."""
    q, k, v = _inputs(6, 200, 200, 2, 4, 64)
    k = k.clone()
    k[150] *= 30.0
    got = native.prefill_attention(q, k, v, scale=1.0, num_threads=2)
    torch.testing.assert_close(got.double(), _reference(q, k, v, 1.0, None),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [16, 80, 96, 256])
def test_other_head_dims(head_dim):
    q, k, v = _inputs(head_dim, 37, 90, 2, 3, head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    got = native.prefill_attention(q, k, v, scale=scale, sliding_window=40)
    torch.testing.assert_close(got.double(), _reference(q, k, v, scale, 40),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_kv_heads,group", [(1, 16), (1, 17), (2, 20), (1, 33), (1, 40)])
def test_groups_wider_than_a_sub_block(num_kv_heads, group):
    """Groups are split into slices of at most QROWS heads: 24 on AVX2, 32 on
    AVX-512 (prefill_attention.c)."""
    q, k, v = _inputs(group, 30, 61, num_kv_heads, group, 64)
    got = native.prefill_attention(q, k, v, scale=0.125, num_threads=2)
    torch.testing.assert_close(got.double(), _reference(q, k, v, 0.125, None),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,length,num_kv_heads,group,head_dim,window", [
    (129, 300, 2, 4, 64, 200), (300, 300, 3, 3, 64, None), (7, 500, 1, 8, 128, None),
    (64, 65, 2, 2, 80, None), (33, 33, 1, 40, 96, 20)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes(dtype, n, length, num_kv_heads, group, head_dim, window):
    """K/V (and q) of the half type (bfloat16 scores by vdpbf16ps on
    AVX512-BF16 hosts), the output rounded to dtype: within the dtype's
    rounding of the float64 result over the same inputs."""
    q, k, v = _inputs(11 + n, n, length, num_kv_heads, group, head_dim, dtype)
    scale = head_dim ** -0.5
    got = native.prefill_attention(q, k, v, scale=scale, sliding_window=window, num_threads=2)
    assert got.dtype == dtype
    torch.testing.assert_close(got, _reference(q, k, v, scale, window).to(dtype),
                               rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_does_not_depend_on_chunking_or_threads(dtype):
    """Key tiles sit on absolute positions and each row's arithmetic is its
    own: a chunk after a cached prefix gives its rows bit for bit what the
    whole prompt gives them, whatever the thread count (so a prefix-cache hit
    or a chunked prefill changes nothing)."""
    q, k, v = _inputs(12, 500, 500, 2, 4, 64, dtype)
    whole = native.prefill_attention(q, k, v, scale=0.125, num_threads=2)
    for threads in (1, 3):
        assert torch.equal(native.prefill_attention(q, k, v, scale=0.125, num_threads=threads),
                           whole)
    for start, stop in [(0, 1), (0, 77), (77, 78), (77, 300), (300, 500), (499, 500)]:
        chunk = native.prefill_attention(q[start:stop], k[:stop], v[:stop], scale=0.125,
                                         num_threads=1 + start % 3)
        assert torch.equal(chunk, whole[start:stop]), (start, stop)


def test_out_and_contiguous_inputs():
    q, k, v = _inputs(13, 40, 40, 2, 4, 64)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    wide = torch.full((40, 8 * 64 + 16), 7.0)
    out = wide[:, :512].view(40, 8, 64)
    result = native.prefill_attention(q, k, v, scale=0.125, out=out)
    assert result is out
    torch.testing.assert_close(out.double(), _reference(q, k, v, 0.125, None),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(wide[:, 512:], torch.full((40, 16), 7.0))  # nothing past the rows


def test_empty_query():
    q, k, v = _inputs(14, 1, 10, 2, 4, 64)
    assert native.prefill_attention(q[:0], k, v, scale=0.125).shape == (0, 8, 64)


def test_refuses_what_it_does_not_take():
    q, k, v = _inputs(15, 8, 8, 2, 4, 64)
    assert native.supports_prefill_attention(q, k, v)
    odd = torch.randn(8, 8, 72), torch.randn(8, 2, 72), torch.randn(8, 2, 72)
    assert not native.supports_prefill_attention(*odd)            # head_dim not a multiple of 16
    assert not native.supports_prefill_attention(q, k.double(), v)  # mixed dtypes
    assert not native.supports_prefill_attention(q[:, :5], k, v)  # Hq not a multiple of Hkv
    assert not native.supports_prefill_attention(q, k[:4], v[:4])  # fewer keys than queries
    strided_heads = torch.randn(8, 2, 128)[:, :, ::2]
    assert not native.supports_prefill_attention(q, strided_heads, strided_heads)
    with pytest.raises(ValueError, match="does not take"):
        native.prefill_attention(*odd, scale=0.1)
    with pytest.raises(ValueError, match="sliding_window"):
        native.prefill_attention(q, k, v, scale=0.1, sliding_window=0)
