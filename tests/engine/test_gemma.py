"""Gemma 2 and Gemma 3 (text) against Hugging Face transformers.

Each test builds a small random-weight checkpoint with transformers itself
(4 layers so sliding and global layers both occur, an 8-token window, prompts
several windows long), saves it with the built-in tokenizer, and compares in
float32 with transformers' eager attention: logits of every prompt position
within 1e-4, and 16 greedy tokens (decode steps far past the window) through
`LLMEngine`, each transformers' argmax given the tokens before it, with each
step's top logprobs within 1e-4. The
disaggregated path (prefill engine + per-layer KV capture, decode engine +
inject) must give the colocated output. Each architecture runs at head_dim
64 and at the released checkpoints' 256 (Gemma 2 2B/9B, Gemma 3 1B).
Variants the engine does not run are refused by name at load time.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from engine.config import EngineConfig
from engine.errors import UnsupportedModelError
from engine.llm_engine import LLMEngine
from engine.loader import load_model
from engine.make_model import BOS_TOKEN, END_OF_TEXT_TOKEN, build_tokenizer
from engine.model_config import ModelConfig
from engine.models.gemma import GemmaForCausalLM
from engine.reference import reference_logits
from engine.sampling_params import SamplingParams
from tests.engine.test_remote import _disaggregated, _finish

pytestmark = pytest.mark.timeout(240)

WINDOW = 8
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              sliding_window=WINDOW, max_position_embeddings=256, rms_norm_eps=1e-6,
              query_pre_attn_scalar=48, pad_token_id=0, attn_implementation="eager")
# Gemma 2: alternating sliding/global layers, both soft-caps (small enough
# to bend most scores of this model).
GEMMA2 = dict(attn_logit_softcapping=2.0, final_logit_softcapping=10.0,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
# Gemma 3: q/k norms, global every 2nd layer, a different RoPE base locally.
GEMMA3 = dict(sliding_window_pattern=2, final_logit_softcapping=10.0,
              rope_parameters={
                  "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                  "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
# The released 2B/9B and 1B checkpoints' head_dim (Gemma 3 1B: 4 query
# heads over 1 KV head) and its query_pre_attn_scalar.
HEAD_DIM_256 = dict(head_dim=256, query_pre_attn_scalar=256)
VARIANTS = {
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, GEMMA2),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, GEMMA3),
    "gemma2_head_dim_256": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
                            {**GEMMA2, **HEAD_DIM_256}),
    "gemma3_head_dim_256": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
                            {**GEMMA3, **HEAD_DIM_256, "num_key_value_heads": 1}),
}


def _fields(variant: str) -> dict:
    """The variant's config fields: COMMON with its own on top."""
    return {**COMMON, **VARIANTS[variant][2]}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights giving peaked logits (clear greedy winners): norm offsets
    around 0 (Gemma scales by 1 + weight), unit embeddings, projections with
    unit gain on fan-in."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                std = 0.1
            elif name == "model.embed_tokens.weight":
                std = 1.0
            else:
                std = param.shape[1] ** -0.5
            param.copy_(torch.randn(param.shape, generator=gen) * std)


def _make_checkpoint(root: Path, variant: str, seed: int = 0) -> tuple[Path, torch.nn.Module]:
    config_class, model_class, _ = VARIANTS[variant]
    tokenizer = build_tokenizer()
    vocab = tokenizer.get_vocab()
    config = config_class(vocab_size=len(vocab), bos_token_id=vocab[BOS_TOKEN],
                          eos_token_id=vocab[END_OF_TEXT_TOKEN], **_fields(variant))
    torch.manual_seed(seed)
    hf_model = model_class(config).float().eval()
    _randomize(hf_model, seed)
    out = root / variant
    hf_model.save_pretrained(out)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": BOS_TOKEN, "eos_token": END_OF_TEXT_TOKEN, "add_bos_token": True,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    return out, hf_model


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory) -> tuple[str, Path, torch.nn.Module]:
    path, hf_model = _make_checkpoint(tmp_path_factory.mktemp("gemma"), request.param)
    return request.param, path, hf_model


def _prompt(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 1090, (length,), generator=g).tolist()


@torch.inference_mode()
def _hf_logprobs(hf_model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' log-softmax at each of the output positions, from one
    forward pass over prompt + output: greedy decoding would produce `output`
    exactly when each output token is the argmax given the ones before it."""
    logits = hf_model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1]
    return logits.float().log_softmax(-1)


def test_config_parses_gemma_fields(checkpoint):
    variant, path, _ = checkpoint
    config = ModelConfig.from_pretrained(path)
    gemma, fields = config.gemma, _fields(variant)
    assert config.sliding_window is None and config.tie_word_embeddings
    assert (config.head_dim, config.num_key_value_heads) == (fields["head_dim"],
                                                             fields["num_key_value_heads"])
    assert gemma.layer_types == ("sliding_attention", "full_attention") * 2
    assert gemma.sliding_window == WINDOW
    assert gemma.query_pre_attn_scalar == fields["query_pre_attn_scalar"]
    assert gemma.final_logit_softcapping == 10.0
    if variant.startswith("gemma2"):
        assert gemma.attn_logit_softcapping == 2.0 and not gemma.qk_norm
        assert gemma.rope_theta == gemma.rope_local_theta == 10000.0
    else:
        assert gemma.attn_logit_softcapping is None and gemma.qk_norm
        assert (gemma.rope_theta, gemma.rope_local_theta) == (1_000_000.0, 10_000.0)


def test_logits_match_transformers(checkpoint):
    _, path, hf_model = checkpoint
    model, _ = load_model(path, dtype="float32")
    assert isinstance(model, GemmaForCausalLM)
    prompt = _prompt(1, 5 * WINDOW + 3)
    with torch.inference_mode():
        expected = hf_model(torch.tensor([prompt])).logits[0].float()
    got = reference_logits(model, prompt)
    assert (got - expected).abs().max().item() < 1e-4
    # Guard against a comparison that cannot fail: the logits are peaked.
    assert expected.std().item() > 1.0


@pytest.mark.parametrize("kernel_backend", ["auto", "torch"])
def test_greedy_generation_matches_transformers(checkpoint, kernel_backend):
    """Chunked prefill (8-token chunks over 16-token blocks, so chunks read
    their context back from the cache) and 16 decode steps past the window,
    through the native C kernels (auto on CPU) and the torch references.
    (Interpreted Triton is too slow for every variant here: see the next
    test; its soft-capped kernels are checked in
    tests/kernels/test_attention_softcap.py.)"""
    _, path, hf_model = checkpoint
    _check_greedy(path, hf_model, kernel_backend, max_tokens=16)


@pytest.mark.parametrize("variant", ["gemma2_head_dim_256", "gemma3_head_dim_256"])
def test_greedy_generation_with_triton_kernels_at_head_dim_256(tmp_path, variant):
    """The Triton kernels (interpreted on CPU) in the engine at head_dim
    256, where their tiles differ from 64/128's: RoPE, KV inject and
    soft-capped decode attention, fewer steps to stay fast."""
    pytest.importorskip("triton")
    path, hf_model = _make_checkpoint(tmp_path, variant)
    _check_greedy(path, hf_model, "triton", max_tokens=6)


def _check_greedy(path: Path, hf_model, kernel_backend: str, max_tokens: int) -> None:
    engine = LLMEngine(EngineConfig(model_dir=str(path), dtype="float32", num_blocks=32,
                                    max_num_batched_tokens=8, max_num_seqs=4,
                                    kernel_backend=kernel_backend))
    prompts = [_prompt(2, 3 * WINDOW + 5), _prompt(3, WINDOW - 3)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    results = engine.generate(prompts, params)
    for prompt, result in zip(prompts, results, strict=True):
        tokens = list(result.token_ids)
        assert len(tokens) == max_tokens
        want = _hf_logprobs(hf_model, prompt, tokens)
        assert tokens == want.argmax(-1).tolist()  # transformers' greedy choice at every step
        for step, got in enumerate(result.logprobs):
            top = want[step].topk(3)
            assert list(got.top_token_ids) == top.indices.tolist(), step
            assert max(abs(a - b) for a, b in zip(got.top_logprobs, top.values.tolist(),
                                                  strict=True)) < 1e-4


def test_disaggregated_equals_colocated(checkpoint):
    _, path, _ = checkpoint

    def make_engine(**overrides) -> LLMEngine:
        fields = {"model_dir": str(path), "dtype": "float32", "num_blocks": 64}
        fields.update(overrides)
        hook = fields.pop("layer_kv_hook", None)
        return LLMEngine(EngineConfig(**fields), layer_kv_hook=hook)

    prompt = _prompt(4, 75)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    colocated = make_engine()
    colocated.add_request("q", prompt, params)
    expected = _finish(colocated, "q")
    assert len(expected[0]) == 10
    assert _disaggregated(make_engine, prompt, params) == expected


@pytest.mark.parametrize(("variant", "change", "message"), [
    ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
    ("gemma2", {"attention_bias": True}, "attention_bias"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping 50.0"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma3", {"rope_scaling": {"rope_type": "linear", "factor": 8.0}}, "rope_scaling"),
    ("gemma3", {"rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "full_attention rope_type 'linear'"),
    ("gemma3", {"layer_types": ["chunked_attention"] * 4}, "layer_types\\[0\\]"),
    ("gemma3", {"layer_types": ["full_attention"]}, "layer_types has 1 entries"),
    ("gemma2", {"head_dim": 160}, "head_dim 160 is not supported"),
])
def test_unsupported_variants_are_refused_by_name(tmp_path, variant, change, message):
    config_class = VARIANTS[variant][0]
    raw = config_class(vocab_size=1100, **_fields(variant)).to_dict()
    raw["architectures"] = [VARIANTS[variant][1].__name__]
    raw.update(change)
    with pytest.raises((UnsupportedModelError, ValueError), match=message):
        ModelConfig.from_dict(raw, source="config.json")


def test_released_config_spelling(tmp_path):
    """The keys the released checkpoints use (rope_theta, rope_local_base_freq,
    sliding_window_pattern, no layer_types) give the same layout."""
    raw = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 1100, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
           "num_key_value_heads": 1, "head_dim": 64, "max_position_embeddings": 512,
           "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 64,
           "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": None,
           "sliding_window": 512, "sliding_window_pattern": 6,
           "final_logit_softcapping": None, "attn_logit_softcapping": None}
    gemma = ModelConfig.from_dict(raw).gemma
    assert gemma.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert (gemma.rope_theta, gemma.rope_local_theta) == (1e6, 1e4)
    raw2 = {**raw, "architectures": ["Gemma2ForCausalLM"], "num_hidden_layers": 3}
    for key in ("rope_local_base_freq", "sliding_window_pattern", "final_logit_softcapping",
                "attn_logit_softcapping"):
        raw2.pop(key)
    gemma2 = ModelConfig.from_dict(raw2).gemma
    assert gemma2.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    # Gemma 2's defaults where the config is silent, as transformers has them.
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (50.0, 30.0)
