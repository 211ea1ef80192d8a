"""No-cache, full-recompute reference: the ground truth of every correctness test.

`DenseCausalContext` attends over exactly the tokens of one forward pass (one
sequence, positions 0..N-1), with nothing cached. `reference_logits` and
`reference_greedy` drive the model through it; greedy decoding recomputes the
whole sequence for every new token, so it shares no state with the paged
engine it is compared against. Slow by design; tests and tools only.
"""

from __future__ import annotations

import torch

from engine.layer_attention import LayerAttention, layer_attention
from engine.model import LlamaForCausalLM
from kernels.reference import soft_cap


class DenseCausalContext:
    """Causal softmax attention over one sequence, computed in float32.

    GQA repeats each kv head for its group of query heads. With a sliding
    window W, token i sees tokens j with i - W < j <= i (itself and the W - 1
    before it), the Mistral convention. `layers` (one `LayerAttention` per
    layer, as `for_model` builds) overrides scale and window per layer and
    adds soft-capping.
    """

    def __init__(self, scale: float, sliding_window: int | None = None,
                 layers: tuple[LayerAttention, ...] = ()) -> None:
        self.scale = scale
        self.sliding_window = sliding_window
        self._uniform = LayerAttention(scale, sliding_window)  # checks both
        self.layers = layers

    @classmethod
    def for_model(cls, model: LlamaForCausalLM) -> DenseCausalContext:
        config = model.config
        return cls(scale=config.head_dim**-0.5, sliding_window=config.sliding_window,
                   layers=layer_attention(config))

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        num_tokens, num_heads, _ = q.shape
        num_kv_heads = k.shape[1]
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"query heads {num_heads} not a multiple of kv heads {num_kv_heads}")
        group = num_heads // num_kv_heads
        spec = self.layers[layer_idx] if self.layers else self._uniform
        qf = q.float().transpose(0, 1)                                  # [Hq, N, D]
        kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, N, D]
        vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = soft_cap(torch.matmul(qf, kf.transpose(1, 2)) * spec.scale,   # [Hq, N, N]
                          spec.softcap)
        row = torch.arange(num_tokens, device=q.device)[:, None]
        col = torch.arange(num_tokens, device=q.device)[None, :]
        visible = col <= row
        if spec.sliding_window is not None:
            visible &= col > row - spec.sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        out = torch.matmul(scores.softmax(dim=-1), vf)                 # [Hq, N, D]
        return out.transpose(0, 1).to(q.dtype)

    def attend_qkv(self, layer_idx: int, qkv: torch.Tensor, positions: torch.Tensor,
                   cos_sin_cache: torch.Tensor) -> None:
        """Never fused: the reference runs the model's split path."""
        return None


def _as_ids(token_ids: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=device)
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(
            f"token_ids must be a non-empty 1-D sequence, got shape {tuple(ids.shape)}"
        )
    return ids


@torch.inference_mode()
def reference_logits(model: LlamaForCausalLM, token_ids: list[int] | torch.Tensor) -> torch.Tensor:
    """Float32 logits [N, vocab] of every position of one sequence."""
    ids = _as_ids(token_ids, model.device)
    positions = torch.arange(ids.numel(), device=ids.device)
    hidden = model(ids, positions, DenseCausalContext.for_model(model))
    return model.compute_logits(hidden)


@torch.inference_mode()
def reference_greedy(
    model: LlamaForCausalLM,
    prompt_ids: list[int],
    max_tokens: int,
    eos_token_ids: tuple[int, ...] | list[int] = (),
) -> list[int]:
    """Greedy continuation of `prompt_ids`: up to `max_tokens` new tokens,
    stopping after (and including) the first token in `eos_token_ids`. Every
    step recomputes the full sequence from scratch; ties pick the lowest id
    (torch.argmax semantics)."""
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    sequence = list(prompt_ids)
    _as_ids(sequence, model.device)
    stop = set(eos_token_ids)
    output: list[int] = []
    for _ in range(max_tokens):
        logits = reference_logits(model, sequence)
        token = int(torch.argmax(logits[-1]).item())
        output.append(token)
        sequence.append(token)
        if token in stop:
            break
    return output
