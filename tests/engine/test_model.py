"""LlamaForCausalLM against an independent naive implementation.

The naive model below reads the raw HF tensors (unmerged q/k/v and
gate/up), applies RoPE by rotating pairs with explicit sin/cos per position
and frequency, and runs attention one query token at a time with python
loops over heads. It shares no code with engine.model, engine.reference or
kernels, so agreement checks the merge, the norms, RoPE and GQA wiring.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.loader import load_model
from engine.make_model import make_model
from engine.model_config import ModelConfig
from engine.reference import DenseCausalContext, reference_logits

PROMPT = [0, 17, 230, 5, 901, 44, 44, 610, 3, 777, 12, 250]


def _naive_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean() + eps) * w


def _naive_inv_freq(cfg: ModelConfig) -> list[float]:
    dim = cfg.head_dim
    freqs = [cfg.rope_theta ** (-(2 * i) / dim) for i in range(dim // 2)]
    s = cfg.rope_scaling
    if s is None:
        return freqs
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < s.original_max_position_embeddings / s.high_freq_factor:
            out.append(f)
        elif wavelen > s.original_max_position_embeddings / s.low_freq_factor:
            out.append(f / s.factor)
        else:
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor)
            out.append((1 - smooth) * f / s.factor + smooth * f)
    return out


def _naive_rope(vec: torch.Tensor, pos: int, inv_freq: list[float]) -> torch.Tensor:
    half = len(inv_freq)
    out = vec.clone()
    for i, f in enumerate(inv_freq):
        c, s = math.cos(pos * f), math.sin(pos * f)
        a, b = vec[i].item(), vec[i + half].item()
        out[i] = a * c - b * s
        out[i + half] = b * c + a * s
    return out


def naive_logits(model_dir: Path, cfg: ModelConfig, ids: list[int]) -> torch.Tensor:
    w = {k: v.double() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    n, hq, hkv, d = len(ids), cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    inv_freq = _naive_inv_freq(cfg)
    x = w["model.embed_tokens.weight"][ids]  # [n, hidden]
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        h = torch.stack([_naive_rms(x[t], w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
                         for t in range(n)])
        proj = {}
        for name in "qkv":
            y = h @ w[p + f"self_attn.{name}_proj.weight"].T
            if cfg.attention_bias:
                y = y + w[p + f"self_attn.{name}_proj.bias"]
            proj[name] = y.view(n, -1, d)
        q = torch.stack([torch.stack([_naive_rope(proj["q"][t, j], t, inv_freq)
                                      for j in range(hq)]) for t in range(n)])
        k = torch.stack([torch.stack([_naive_rope(proj["k"][t, j], t, inv_freq)
                                      for j in range(hkv)]) for t in range(n)])
        attn = torch.zeros(n, hq, d, dtype=torch.float64)
        for t in range(n):
            first = 0 if cfg.sliding_window is None else max(0, t - cfg.sliding_window + 1)
            for j in range(hq):
                kv_head = j // (hq // hkv)
                scores = torch.tensor([float(q[t, j] @ k[s, kv_head]) / math.sqrt(d)
                                       for s in range(first, t + 1)], dtype=torch.float64)
                probs = torch.exp(scores - scores.max())
                probs = probs / probs.sum()
                attn[t, j] = probs @ proj["v"][first:t + 1, kv_head]
        x = x + attn.view(n, -1) @ w[p + "self_attn.o_proj.weight"].T
        h = torch.stack([_naive_rms(x[t], w[p + "post_attention_layernorm.weight"],
                                    cfg.rms_norm_eps) for t in range(n)])
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        up = h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate * torch.sigmoid(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    x = torch.stack([_naive_rms(x[t], w["model.norm.weight"], cfg.rms_norm_eps) for t in range(n)])
    head = w["model.embed_tokens.weight"] if cfg.tie_word_embeddings else w["lm_head.weight"]
    return x @ head.T


VARIANTS = {
    "llama": {},
    "qwen2_bias_tied": {"architecture": "Qwen2ForCausalLM", "tie_word_embeddings": True},
    "mistral_window": {"architecture": "MistralForCausalLM", "sliding_window": 5},
    "llama3_scaling": {"llama3_rope_scaling": True},
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_naive_implementation(tmp_path: Path, variant: str) -> None:
    model_dir = make_model(tmp_path / variant, size="tiny", seed=3, **VARIANTS[variant])
    model, cfg = load_model(model_dir, dtype="float32")
    got = reference_logits(model, PROMPT)
    want = naive_logits(model_dir, cfg, PROMPT).float()
    assert got.dtype == torch.float32
    assert got.shape == (len(PROMPT), cfg.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_prefix_logits_equal_first_rows_of_full_sequence(tiny_model_dir: Path) -> None:
    model, _ = load_model(tiny_model_dir, dtype="float32")
    full = reference_logits(model, PROMPT)
    prefix = reference_logits(model, PROMPT[:5])
    torch.testing.assert_close(prefix, full[:5], rtol=1e-5, atol=1e-5)


def test_forward_rejects_mismatched_positions(tiny_model_dir: Path) -> None:
    model, _ = load_model(tiny_model_dir)
    ids = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match=r"equal length, got \(3,\) and \(2,\)"):
        model(ids, torch.arange(2), DenseCausalContext.for_model(model))


def test_tied_lm_head_is_the_embedding(tmp_path: Path) -> None:
    model_dir = make_model(tmp_path / "tied", tie_word_embeddings=True)
    model, cfg = load_model(model_dir)
    assert cfg.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_bfloat16_model_runs_with_float32_logits(tiny_model_dir: Path) -> None:
    model, _ = load_model(tiny_model_dir, dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    logits = reference_logits(model, PROMPT)
    assert logits.dtype == torch.float32
    ref32 = reference_logits(load_model(tiny_model_dir, dtype="float32")[0], PROMPT)
    # bf16 keeps the winner on these peaked logits
    assert logits[-1].argmax().item() == ref32[-1].argmax().item()


@pytest.mark.timeout(120)
def test_triton_backend_matches_torch_backend(tiny_model_dir: Path) -> None:
    import kernels

    if not kernels.triton_available():
        pytest.skip("triton is not installed")
    model, _ = load_model(tiny_model_dir, dtype="float32")
    torch_logits = reference_logits(model, PROMPT)
    # on CPU this runs the Triton kernels through TRITON_INTERPRET=1 (set in conftest)
    triton_model, _ = load_model(tiny_model_dir, dtype="float32", kernel_backend="triton")
    triton_logits = reference_logits(triton_model, PROMPT)
    torch.testing.assert_close(triton_logits, torch_logits, rtol=1e-4, atol=1e-4)
