"""engine.decode_layers: a CPU decode step's layers in one native call each
give the same bits as the model's own layer-by-layer forward (tokens and
logprobs of whole generations, batch 5, ragged contexts), on Llama,
Qwen2's qkv bias with tied embeddings, and Mistral's sliding window, in
float32 and bfloat16; and it stays out of what it does not take."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import engine.decode_layers as decode_layers
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.make_model import make_model
from engine.model import LlamaAttention, LlamaDecoderLayer, LlamaMLP
from engine.sampling_params import SamplingParams
from kernels import native

pytestmark = pytest.mark.skipif(not native.gemm_available(),
                                reason="no native GEMM here (no C compiler, or no AVX2 + FMA)")

VARIANTS = {
    "llama": {},
    "qwen2_bias_tied": {"architecture": "Qwen2ForCausalLM", "tie_word_embeddings": True},
    "mistral_window": {"architecture": "MistralForCausalLM", "sliding_window": 24},
}


def _generate(model_dir: Path, dtype: str, monkeypatch: pytest.MonkeyPatch, *, fused: bool):
    """(tokens and logprobs per request, fused steps taken)."""
    taken = [0]
    run = decode_layers.DecodeLayers.run

    def counting_run(self, *args):
        out = run(self, *args)
        taken[0] += out is not None
        return out

    with monkeypatch.context() as patch:
        patch.setattr(decode_layers.DecodeLayers, "run", counting_run)
        if not fused:
            patch.setattr(decode_layers.DecodeLayers, "for_model",
                          staticmethod(lambda *args: None))
        engine = LLMEngine(EngineConfig(model_dir=str(model_dir), dtype=dtype, device="cpu",
                                        block_size=16, num_blocks=64, max_num_seqs=8,
                                        enable_prefix_caching=False))
        gen = torch.Generator().manual_seed(7)
        vocab = engine.model_config.vocab_size
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
        for i in range(5):
            prompt = torch.randint(3, vocab, (9 + 13 * i,), generator=gen).tolist()
            engine.add_request(f"r{i}", prompt, params)
        got: dict[str, list] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                got.setdefault(out.request_id, []).append((out.new_token_ids, out.new_logprobs))
    return got, taken[0]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_same_bits_as_the_layer_by_layer_forward(tmp_path: Path, variant: str, dtype: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = make_model(tmp_path / variant, size="tiny", seed=5, **VARIANTS[variant])
    fused, steps = _generate(model_dir, dtype, monkeypatch, fused=True)
    plain, plain_steps = _generate(model_dir, dtype, monkeypatch, fused=False)
    assert steps >= 20 and plain_steps == 0  # the decode steps took the call
    assert fused == plain


def test_stays_out_of_what_it_does_not_take(tiny_model_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model_dir=str(tiny_model_dir), dtype="float32",
                                    device="cpu", block_size=16, num_blocks=32,
                                    enable_prefix_caching=False))
    model = engine.runner.model
    types = (LlamaDecoderLayer, LlamaAttention, LlamaMLP)
    assert isinstance(decode_layers.DecodeLayers.for_model(model, types),
                      decode_layers.DecodeLayers)

    class OtherLayer(LlamaDecoderLayer):  # a subclass (Qwen3's, Gemma's) keeps its forward
        pass

    assert decode_layers.DecodeLayers.for_model(model, (OtherLayer, *types[1:])) is None
    # A prefill step, and any step under the torch profiler, runs layer by layer.
    engine.add_request("p", list(range(3, 40)), SamplingParams(temperature=0, max_tokens=3))
    seen = []
    run = decode_layers.DecodeLayers.run

    def recording_run(self, *args):
        out = run(self, *args)
        seen.append(out is not None)
        return out

    decode_layers.DecodeLayers.run = recording_run
    try:
        engine.step()  # the prompt
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            engine.step()  # a decode step, profiled
        engine.step()  # a decode step
    finally:
        decode_layers.DecodeLayers.run = run
    assert seen == [False, False, True]
