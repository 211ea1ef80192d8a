"""Backend selection and argument checks of kernels.dispatch (the engine's entry point)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import kernels
from kernels import Backend, dispatch
from tests.kernels.cases import assert_close, generator, make_paged_case, randn, rope_cache

# The Triton path on CPU runs Triton's interpreter, which is written on numpy.
needs_interpreter = pytest.mark.skipif(
    importlib.util.find_spec("numpy") is None, reason="Triton's interpreter needs numpy"
)


def test_parse_backend_names_and_rejects_unknown():
    assert Backend.parse(" Triton ") is Backend.TRITON
    assert Backend.parse("auto") is Backend.AUTO
    with pytest.raises(ValueError, match="auto\\|triton\\|torch"):
        Backend.parse("cuda")


def test_parse_accepts_a_backend_and_ops_accept_names():
    assert Backend.parse(Backend.TORCH) is Backend.TORCH
    x = randn((3, 64), torch.float32, generator(0))
    with pytest.raises(ValueError, match="kernel backend 'gpu' unknown"):
        kernels.rms_norm(x, torch.ones(64), 1e-6, backend="gpu")


def test_auto_picks_reference_on_cpu_without_native_kernels(monkeypatch):
    called = []
    monkeypatch.setattr(dispatch.native, "supports_rms_norm", lambda *a: False)
    monkeypatch.setattr(
        dispatch.reference, "rms_norm_reference", lambda *a: called.append(a) or a[0]
    )
    x = randn((3, 64), torch.float32, generator(0))
    kernels.rms_norm(x, torch.ones(64), 1e-6, backend="auto")
    kernels.rms_norm(x, torch.ones(64), 1e-6)  # auto is the default
    assert len(called) == 2


@needs_interpreter
def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = randn((3, 64), torch.float32, generator(0))
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernels.rms_norm(x, torch.ones(64), 1e-6, backend="triton")


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda c: {"q": c.q[:, :, :32].contiguous()}, "q head_dim 32 differs"),
        (lambda c: {"q": c.q.to(torch.float16)}, "q dtype torch.float16 differs"),
        (lambda c: {"q": c.q[:, :3]}, "num_q_heads 3 is not a multiple of num_kv_heads 2"),
        (lambda c: {"block_tables": c.block_tables.long()}, "block_tables must be int32"),
        (lambda c: {"context_lens": c.context_lens[:1]}, "batch mismatch"),
        (lambda c: {"kv_cache": c.kv_cache[:, :, :12].contiguous()}, "block_size 12"),
    ],
)
def test_decode_attention_rejects_bad_arguments(mutate, message):
    case = make_paged_case(
        1, [5, 9], dtype=torch.float32, num_kv_heads=2, group=2, head_dim=64, block_size=16
    )
    args = {
        "q": case.q, "kv_cache": case.kv_cache, "block_tables": case.block_tables,
        "context_lens": case.context_lens,
    }
    args.update(mutate(case))
    with pytest.raises(ValueError, match=message):
        kernels.paged_decode_attention(**args, scale=case.scale)


def test_inject_rejects_mismatched_layout():
    kv = randn((2, 4, 16, 2, 64), torch.float32, generator(2))
    src = randn((2, 3, 1, 64), torch.float32, generator(3))
    with pytest.raises(ValueError, match=r"does not match \[2, num_tokens, 2, 64\]"):
        kernels.inject_kv(kv, src, torch.arange(3))
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        kernels.inject_kv(kv, src.expand(2, 3, 2, 64).contiguous(), torch.arange(3).int())


def _both_backends(fn):
    return fn("torch"), fn("triton")


@needs_interpreter
@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backends_agree_through_the_engine_facing_api(dtype):
    case = make_paged_case(
        40, [37, 1, 150], dtype=dtype, num_kv_heads=2, group=4, head_dim=128, block_size=32
    )
    attn_torch, attn_triton = _both_backends(lambda b: kernels.paged_decode_attention(
        case.q, case.kv_cache, case.block_tables, case.context_lens,
        scale=case.scale, sliding_window=100, backend=b,
    ))
    assert_close(attn_triton, attn_torch)

    starts = torch.tensor([0, 30, 31, 31 + 150], dtype=torch.int32)
    prefill_q = randn((181, 8, 128), dtype, generator(39))
    prefill_torch, prefill_triton = _both_backends(lambda b: kernels.paged_prefill_attention(
        prefill_q, case.kv_cache, case.block_tables, starts, case.context_lens,
        scale=case.scale, sliding_window=100, backend=b,
    ))
    assert_close(prefill_triton, prefill_torch)

    slots = torch.tensor([5, 77, -1, 31, 32], dtype=torch.int64)
    src = randn((2, 5, 2, 128), dtype, generator(41))
    caches = []
    for backend in ("torch", "triton"):
        cache = case.kv_cache.clone()
        kernels.inject_kv(cache, src, slots, backend=backend)
        caches.append(cache)
    assert torch.equal(caches[0], caches[1])
    got_torch, got_triton = _both_backends(
        lambda b: kernels.extract_kv(caches[0], slots, backend=b))
    assert torch.equal(got_torch, got_triton)

    x, residual = randn((3, 320), dtype, generator(42)), randn((3, 320), dtype, generator(43))
    weight = randn((320,), dtype, generator(44))
    (y_torch, r_torch), (y_triton, r_triton) = _both_backends(
        lambda b: kernels.rms_norm(x, weight, 1e-6, residual, backend=b)
    )
    assert_close(y_triton, y_torch)
    assert torch.equal(r_triton, r_torch)

    positions = torch.tensor([0, 9, 4], dtype=torch.int64)
    cache = rope_cache(16, 128)
    (q_torch, k_torch), (q_triton, k_triton) = _both_backends(
        lambda b: kernels.rotary_embedding(positions, case.q, case.q[:, :2], cache, backend=b)
    )
    assert_close(q_triton, q_torch)
    assert_close(k_triton, k_torch)


_NO_TRITON = """
import sys
import torch
sys.modules["triton"] = None  # from here on, import triton raises ImportError
import kernels
assert not kernels.triton_available()
x = torch.ones(2, 64)
assert torch.allclose(kernels.rms_norm(x, torch.ones(64), 1e-6), x)
try:
    kernels.rms_norm(x, torch.ones(64), 1e-6, backend="triton")
except RuntimeError as exc:
    print(exc)
"""


@pytest.mark.timeout(120)
def test_kernels_import_and_run_without_triton():
    import subprocess
    import sys

    plain = subprocess.run(
        [sys.executable, "-c", "import sys, kernels; print('triton' in sys.modules)"],
        capture_output=True, text=True, check=True,
    )
    assert plain.stdout.strip() == "False"
    blocked = subprocess.run(
        [sys.executable, "-c", _NO_TRITON], capture_output=True, text=True, check=True
    )
    assert blocked.stdout.strip() == "kernel backend 'triton' but triton is not installed"
