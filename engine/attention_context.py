"""`AttentionContext`: how the model hands attention to whoever owns the KV.

The model computes q/k/v for a flat batch of tokens and delegates the rest to
the context it was given for this forward pass:

- `engine.reference.DenseCausalContext` (this package): one sequence, no
  cache, full causal attention over exactly the given tokens. The reference
  every correctness test compares against.
- The paged context of the engine core: writes k/v into the paged KV cache
  through the batch's slot mapping, attends over cached prefix + new tokens,
  and calls the per-layer KV hook after the layer's KV is final. In a
  pure-decode step it takes the qkv projection's output whole
  (`attend_qkv`: one fused kernel call for split, RoPE, KV write and
  attention).

The context travels as an explicit argument of `LlamaForCausalLM.forward` (no
module-global "current context"), is built per step by the engine loop
thread, and is used by the thread that runs that step's forward (the same
thread, or the forward worker of async scheduling on CPU).
"""

from __future__ import annotations

from typing import Protocol

import torch


class AttentionContext(Protocol):
    """Per-forward-pass attention over the batch's sequences."""

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Attention output for layer `layer_idx`.

        Called by every decoder layer, in layer order, once per forward pass,
        on the thread that runs the forward. Shapes: q [N, Hq, D], k and v [N, Hkv, D]
        for the N tokens of this pass (all sequences flattened, in the order
        the context was built with), RoPE already applied to q and k. Returns
        [N, Hq, D] in q's dtype. The model does not keep k/v: storing them is
        the context's job. Scale, sliding window and soft-cap are the
        context's configuration, per layer (`engine.layer_attention`).
        """
        ...

    def attend_qkv(
        self, layer_idx: int, qkv: torch.Tensor, positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor | None:
        """The same attention from the merged qkv projection's output, before
        RoPE, or None when this context does not fuse it (the model then
        splits, rotates and calls `attend`).

        qkv [N, (Hq + 2 Hkv) * D] (q, k, v heads in that order, neox RoPE at
        `positions` with `cos_sin_cache` still to apply); qkv is scratch. Returns
        [N, Hq, D] like `attend`, and stands in for its call of this layer.
        """
        ...
