"""Backend selection and argument checks of kernels.dispatch (the engine's entry point)."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import Backend, dispatch
from tests.kernels.cases import generator, make_paged_case, randn


def test_parse_backend_names_and_rejects_unknown():
    assert Backend.parse(" Triton ") is Backend.TRITON
    assert Backend.parse("auto") is Backend.AUTO
    with pytest.raises(ValueError, match="auto\\|triton\\|torch"):
        Backend.parse("cuda")


def test_use_backend_restores_previous():
    before = kernels.get_backend()
    with kernels.use_backend("torch") as chosen:
        assert chosen is Backend.TORCH
        assert kernels.get_backend() is Backend.TORCH
    assert kernels.get_backend() is before


def test_auto_picks_reference_on_cpu(monkeypatch):
    called = []
    monkeypatch.setattr(
        dispatch.reference, "rms_norm_reference", lambda *a: called.append(a) or a[0]
    )
    x = randn((3, 64), torch.float32, generator(0))
    with kernels.use_backend("auto"):
        kernels.rms_norm(x, torch.ones(64), 1e-6)
    assert len(called) == 1


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = randn((3, 64), torch.float32, generator(0))
    with kernels.use_backend("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernels.rms_norm(x, torch.ones(64), 1e-6)


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
