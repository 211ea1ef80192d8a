"""engine.reference: dense causal attention on hand-computed inputs, and the
greedy reference loop."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from engine.loader import load_model
from engine.reference import DenseCausalContext, reference_greedy, reference_logits

V = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]])


def _kv(rows: torch.Tensor) -> torch.Tensor:
    return rows[:, None, :]  # [N, 1 kv head, D]


def test_uniform_scores_average_visible_values() -> None:
    q = torch.zeros(3, 1, 2)
    out = DenseCausalContext(scale=1.0).attend(0, q, _kv(torch.zeros(3, 2)), _kv(V))
    assert out[:, 0].tolist() == [[1.0, 0.0], [0.5, 0.5], [1.0, 1.0]]


def test_sliding_window_keeps_last_w_tokens() -> None:
    q = torch.zeros(3, 1, 2)
    out = DenseCausalContext(scale=1.0, sliding_window=2).attend(
        0, q, _kv(torch.zeros(3, 2)), _kv(V))
    # token 2 sees tokens 1 and 2 only
    assert out[:, 0].tolist() == [[1.0, 0.0], [0.5, 0.5], [1.0, 1.5]]


def test_softmax_weights_and_gqa_sharing() -> None:
    # token 1: scores q.k0 = 0 and q.k1 = ln 3 -> weights 1/4, 3/4
    k = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0]])
    q = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0], [0.0, 0.0]])
    q2 = torch.stack([q, torch.zeros(3, 2)], dim=1)  # 2 query heads share the kv head
    out = DenseCausalContext(scale=1.0).attend(0, q2, _kv(k), _kv(V))
    torch.testing.assert_close(out[1, 0], torch.tensor([0.25, 0.75]))
    torch.testing.assert_close(out[1, 1], torch.tensor([0.5, 0.5]))


def test_scale_multiplies_scores() -> None:
    k = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    q = torch.tensor([[0.0, 0.0], [2 * math.log(3.0), 0.0]])
    out = DenseCausalContext(scale=0.5).attend(0, q[:, None], _kv(k), _kv(V[:2]))
    torch.testing.assert_close(out[1, 0], torch.tensor([0.25, 0.75]))


def test_rejects_bad_configuration() -> None:
    with pytest.raises(ValueError, match="sliding_window must be > 0 or None, got 0"):
        DenseCausalContext(scale=1.0, sliding_window=0)


def test_greedy_is_the_argmax_chain_and_stops_at_eos(tiny_model_dir: Path) -> None:
    model, _ = load_model(tiny_model_dir)
    prompt = [0, 500, 600, 700]
    sequence, chain = list(prompt), []
    for _ in range(6):
        token = int(reference_logits(model, sequence)[-1].argmax())
        chain.append(token)
        sequence.append(token)
    assert reference_greedy(model, prompt, 6) == chain
    assert reference_greedy(model, prompt, 3) == chain[:3]
    # the first occurrence of an eos token ends generation, eos included
    assert reference_greedy(model, prompt, 6, eos_token_ids=(chain[1],)) == chain[:2]
    assert reference_greedy(model, prompt, 0) == []
