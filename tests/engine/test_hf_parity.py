"""Qwen3, Phi-3 and Mixtral against Hugging Face transformers, in float32.

Each variant is a tiny random-weight transformers model (2 layers, made
here with transformers' own config and model classes, saved with
`save_pretrained`, plus the built-in tokenizer), loaded by the engine's
loader like any downloaded checkpoint. Checked: the logits of every prompt
position within 1e-4 of transformers'; 16 greedy tokens through `LLMEngine`
equal to transformers' greedy continuation; the decode-pod path (prefill
engine with the KV hook, reserve/inject/commit on a second engine) equal to
the colocated engine.

Weights are re-drawn with the make-model scales (unit-gain projections,
logits of std ~2) rather than transformers' 0.02 init, so greedy choices
and Mixtral's expert choices have clear winners and are not decided by
rounding.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import load_model
from engine.make_model import build_tokenizer, write_tokenizer
from engine.reference import reference_logits
from engine.sampling_params import SamplingParams
from tests.engine.test_remote import _disaggregated, _finish

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(300)

# head_dim 64 (hidden / heads) unless a variant says otherwise; the Phi-3
# variants of head_dim 96 are Phi-3-mini's and Phi-3.5-mini's (3072 / 32).
_COMMON = dict(num_hidden_layers=2, num_key_value_heads=2, intermediate_size=128,
               max_position_embeddings=1024, bos_token_id=0, eos_token_id=1, pad_token_id=None)
VARIANTS: dict[str, tuple[str, dict]] = {
    "qwen3": ("Qwen3", dict(hidden_size=64, num_attention_heads=4, head_dim=64,
                            tie_word_embeddings=True)),
    "phi3": ("Phi3", dict(hidden_size=128, num_attention_heads=2, sliding_window=24)),
    # Phi-4-mini style: a quarter of each head passes through, LongRoPE.
    "phi3_partial_longrope": ("Phi3", dict(
        hidden_size=128, num_attention_heads=2, partial_rotary_factor=0.75,
        original_max_position_embeddings=256,
        rope_scaling={"rope_type": "longrope",
                      "short_factor": [1.0 + 0.1 * i for i in range(24)],
                      "long_factor": [2.0 + 0.5 * i for i in range(24)]})),
    # Phi-3-mini-4k style: head_dim 96 (192 / 2), a window on every layer.
    "phi3_head_dim_96": ("Phi3", dict(hidden_size=192, num_attention_heads=2, sliding_window=24)),
    # Phi-3.5-mini style: head_dim 96 with LongRoPE (48 factors per list).
    "phi3_head_dim_96_longrope": ("Phi3", dict(
        hidden_size=192, num_attention_heads=2, original_max_position_embeddings=256,
        rope_scaling={"rope_type": "longrope",
                      "short_factor": [1.0 + 0.05 * i for i in range(48)],
                      "long_factor": [2.0 + 0.25 * i for i in range(48)]})),
    "mixtral": ("Mixtral", dict(hidden_size=64, num_attention_heads=4, head_dim=64,
                                num_local_experts=4, num_experts_per_tok=2)),
}


def _redraw(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.dim() == 1:  # norm weights: near 1, not exactly
                p.copy_(1 + 0.1 * noise)
            elif name.endswith("embed_tokens.weight"):
                p.copy_(noise)
            elif name == "lm_head.weight":
                p.copy_(noise * 2 / p.shape[-1] ** 0.5)
            else:  # projections, experts (3-D), router: unit gain on fan-in
                p.copy_(noise * p.shape[-1] ** -0.5)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def hf_checkpoint(request, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    return _checkpoint(request.param, tmp_path_factory)


def _checkpoint(variant: str, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    family, fields = VARIANTS[variant]
    tokenizer = build_tokenizer()
    vocab_size = tokenizer.get_vocab_size()
    config = getattr(transformers, f"{family}Config")(vocab_size=vocab_size,
                                                      **_COMMON, **fields)
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config).float().eval()
    _redraw(model, seed=sorted(VARIANTS).index(variant))
    path = tmp_path_factory.mktemp("hf") / variant
    model.save_pretrained(path)
    write_tokenizer(path, tokenizer, config.max_position_embeddings)
    return path, model


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(10, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def _hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_logits_match_transformers(hf_checkpoint):
    path, hf_model = hf_checkpoint
    ours, _ = load_model(path, dtype="float32")
    prompt = _prompt(40, seed=1)
    with torch.inference_mode():
        expected = hf_model(torch.tensor([prompt])).logits[0]
    got = reference_logits(ours, prompt)
    assert expected.std() > 1.0  # peaked, so the comparison means something
    assert (got - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("kernel_backend", ["auto", "torch"])  # native C on CPU; references
def test_engine_greedy_matches_transformers(hf_checkpoint, kernel_backend):
    path, hf_model = hf_checkpoint
    engine = LLMEngine(EngineConfig(model_dir=str(path), dtype="float32", num_blocks=32,
                                    max_num_batched_tokens=24,  # two prefill chunks
                                    kernel_backend=kernel_backend))
    prompts = [_prompt(30, seed=2), _prompt(7, seed=3)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    results = engine.generate(prompts, params)
    for prompt, result in zip(prompts, results, strict=True):
        assert list(result.token_ids) == _hf_greedy(hf_model, prompt, 16)


def test_engine_greedy_with_triton_kernels_at_head_dim_96(tmp_path_factory):
    """The Triton kernels (interpreted on CPU) in the engine at head_dim 96,
    the one that runs in padded, masked tiles: fewer tokens to stay fast."""
    pytest.importorskip("triton")
    path, hf_model = _checkpoint("phi3_head_dim_96", tmp_path_factory)
    engine = LLMEngine(EngineConfig(model_dir=str(path), dtype="float32", num_blocks=32,
                                    max_num_batched_tokens=24, kernel_backend="triton"))
    prompts = [_prompt(30, seed=2), _prompt(7, seed=3)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for prompt, result in zip(prompts, engine.generate(prompts, params), strict=True):
        assert list(result.token_ids) == _hf_greedy(hf_model, prompt, 6)


def test_disaggregated_equals_colocated(hf_checkpoint):
    path, _ = hf_checkpoint

    def make_engine(**overrides) -> LLMEngine:
        fields = {"model_dir": str(path), "dtype": "float32", "num_blocks": 64, **overrides}
        hook = fields.pop("layer_kv_hook", None)
        return LLMEngine(EngineConfig(**fields), layer_kv_hook=hook)

    prompt = _prompt(75, seed=4)
    for params in (SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                   SamplingParams(temperature=0.8, top_k=50, seed=3, max_tokens=10,
                                  ignore_eos=True)):
        colocated = make_engine()
        colocated.add_request("q", prompt, params)
        expected = _finish(colocated, "q")
        assert len(expected[0]) == 10
        assert _disaggregated(make_engine, prompt, params) == expected
