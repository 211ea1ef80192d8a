"""Every model family the engine loads, sharded at TP=2 on real ranks,
against the same checkpoint at TP=1 (the check of test_sharded_model.py:
prefill and decode logits within `TOLERANCE`, the same argmax, each rank's
KV cache TP=1's values of its own KV heads).

One tiny checkpoint per family and feature that sharding touches: an odd
vocabulary (1,001 rows: the second shard's last row is padding) untied and
tied (Gemma), Qwen2's q/k/v biases with tied embeddings, Qwen3's and Gemma
3's per-head q/k norms, Phi-3's fused qkv_proj with partial rotary (its
rows permuted per head) and fused gate_up_proj, Mixtral's experts and
replicated router, sliding windows (Phi-3, Mixtral, Gemma), Gemma 2's
attention and final soft-caps and embedding scale, and Gemma 3 over one KV
head (replicated on both ranks). All ranks run every checkpoint in one
spawn; each family is its own test over the shared result.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.make_model import MODEL_TYPES, SIZES, make_model
from tests.engine.parallel.spawn import (
    load_prepacked,
    paged_forward,
    prompts_for,
    run_ranks,
    sharded_forward,
    vocab_of,
    write_checkpoint,
)
from tests.engine.parallel.test_sharded_model import (
    assert_kv_is_own_heads,
    assert_logits_match,
)

pytestmark = pytest.mark.timeout(240)

ODD_VOCAB = 1001


def _raw(architecture: str, **fields: Any) -> dict[str, Any]:
    return {**SIZES["tiny"], "architectures": [architecture],
            "model_type": MODEL_TYPES.get(architecture, "gemma"), "vocab_size": ODD_VOCAB,
            "rms_norm_eps": 1e-5, "torch_dtype": "float32", "tie_word_embeddings": False,
            **fields}


GEMMA = dict(num_hidden_layers=4, max_position_embeddings=512, sliding_window=8,
             hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=48,
             final_logit_softcapping=50.0, tie_word_embeddings=True)
# name -> (make_model variant) or (raw config for write_checkpoint)
FAMILIES: dict[str, dict[str, Any]] = {
    "llama_odd_vocab": {"raw": _raw("LlamaForCausalLM", hidden_act="silu")},
    "qwen2_bias_tied": {"variant": dict(architecture="Qwen2ForCausalLM",
                                        tie_word_embeddings=True)},
    "qwen3": {"variant": dict(architecture="Qwen3ForCausalLM")},
    "phi3_partial_rotary_window": {"raw": _raw("Phi3ForCausalLM", hidden_act="silu",
                                               partial_rotary_factor=0.5, sliding_window=8)},
    "mixtral_window": {"variant": dict(architecture="MixtralForCausalLM", sliding_window=8)},
    "gemma2": {"raw": _raw("Gemma2ForCausalLM", **GEMMA, attn_logit_softcapping=2.0,
                           rope_theta=10000.0)},
    "gemma3_one_kv_head": {"raw": _raw("Gemma3ForCausalLM", **GEMMA, num_key_value_heads=1,
                                       sliding_window_pattern=2, attn_logit_softcapping=None,
                                       rope_theta=1e6, rope_local_base_freq=1e4)},
}


@pytest.fixture(scope="module")
def family_runs(tmp_path_factory) -> dict[str, tuple[dict[str, Any], list[dict[str, Any]]]]:
    """name -> (TP=1 result, [rank 0 result, rank 1 result])."""
    root = tmp_path_factory.mktemp("families")
    dirs: list[Path] = []
    for seed, (name, spec) in enumerate(FAMILIES.items()):
        if "raw" in spec:
            dirs.append(write_checkpoint(root / name, spec["raw"], seed=seed))
        else:
            dirs.append(make_model(root / name, size="tiny", seed=seed, **spec["variant"]))
    prompts = [prompts_for(vocab_of(d), seed=i) for i, d in enumerate(dirs)]
    want = [paged_forward(load_prepacked(d), p) for d, p in zip(dirs, prompts, strict=True)]
    ranks = run_ranks(sharded_forward, 2, [str(d) for d in dirs], prompts,
                      tmp_dir=root / "ranks", timeout_s=200)
    return {name: (want[i], [ranks[0][i], ranks[1][i]]) for i, name in enumerate(FAMILIES)}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_at_tp2_matches_tp1(family_runs, family):
    want, ranks = family_runs[family]
    assert_logits_match(ranks[0], want)
    assert ranks[1]["prefill"] is None
    for rank_result in ranks:
        assert_kv_is_own_heads(rank_result, want)
    if family == "gemma3_one_kv_head":  # the one KV head on both ranks
        assert [(r["shard"].kv_head_start, r["shard"].kv_head_end) for r in ranks] == [
            (0, 1), (0, 1)]
    if family in ("llama_odd_vocab", "gemma2"):  # 501 rows each, the last one padding
        assert [(r["shard"].vocab_start, r["shard"].vocab_end) for r in ranks] == [
            (0, 501), (501, 1001)]
