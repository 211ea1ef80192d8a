"""`LayerKVHook`: how a prefill pod sees each layer's KV the moment it is final.

The engine calls the hook from inside the forward pass, once per layer in
layer order, right after that layer's new K/V were written into the paged
cache. The prefill service's hook extracts the spans (with
`kernels.extract_kv(kv_cache_layer, span.slot_mapping)`) and hands them to
its sender threads, so layer l's bytes are on the wire while layer l+1 is
computed (DESIGN.md "layer-wise streaming").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True, slots=True)
class LayerKVSpan:
    """Context tokens `[start, end)` of `request_id` whose KV is final in the cache.

    Context tokens are the prompt plus any `output_token_ids` given on
    arrival (a migration). On a request's first chunk `start == 0`, so
    prefix-cache hits are included; later chunks continue where the
    previous one ended; over a request's life the spans cover
    `[0, num_context_tokens)` exactly once (also across preemption, which
    recomputes but does not resend). `slot_mapping[i]` (int64, on the cache's
    device) is the cache slot of token `start + i`.
    """

    request_id: str
    start: int
    end: int
    slot_mapping: torch.Tensor

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"span [{self.start}, {self.end}) must be non-empty, start >= 0")
        if tuple(self.slot_mapping.shape) != (self.end - self.start,):
            raise ValueError(
                f"slot_mapping shape {tuple(self.slot_mapping.shape)} must be "
                f"[{self.end - self.start}] for span [{self.start}, {self.end})"
            )
        if self.slot_mapping.dtype != torch.int64:
            raise ValueError(f"slot_mapping must be int64, got {self.slot_mapping.dtype}")

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


class LayerKVHook(Protocol):
    """Receives each layer's final KV during a step (prefill pods)."""

    def on_layer_kv(
        self, layer_idx: int, kv_cache_layer: torch.Tensor, spans: tuple[LayerKVSpan, ...]
    ) -> None:
        """Called on the thread that runs the forward (the engine loop
        thread, inside `LLMEngine.step()`; with async scheduling on CPU the
        engine's forward worker thread, while the engine loop thread goes
        on), for layers 0..L-1 in order, only in steps where some request computed
        context tokens; `spans` has one entry per such request.

        `kv_cache_layer` is the layer's whole cache tensor
        `[2, num_blocks, block_size, num_kv_heads, head_dim]`, owned by the
        engine. Its contents at the spans' slots are only guaranteed during
        the call: later steps may preempt, evict and overwrite those blocks.
        The hook must copy what it needs before returning (or, on CUDA,
        enqueue the copy on a stream ordered after the current one with an
        event). It must not block on the network.
        """
        ...
