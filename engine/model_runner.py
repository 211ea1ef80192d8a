"""`ModelRunner`: one forward pass of the model over a scheduled step.

Called by `LLMEngine.step()` on the engine loop thread. It flattens the
scheduled requests into one batch (decode rows first, then prefill chunks;
see `engine.paged_attention_context`), builds the per-step attention context
(slot mapping, block tables, context lengths, gathered prefill context,
LayerKVHook spans), runs the model, and returns the float32 logits of the
last row of every request whose scheduled tokens reach its end (it finished
its prompt or is decoding): those are the rows that sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.kv_hook import LayerKVHook, LayerKVSpan
from engine.model import LlamaForCausalLM
from engine.paged_attention_context import PagedAttentionContext, PrefillChunk
from engine.request import Request
from engine.scheduler import ScheduledRequest


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    """`logits[i]` is the next-token distribution of `sampling_requests[i]`."""

    sampling_requests: tuple[Request, ...]
    logits: torch.Tensor


def slots_for(block_ids: Sequence[int], block_size: int, start: int, end: int,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 cache slots of token positions `[start, end)` under a block table."""
    positions = torch.arange(start, end)
    table = torch.tensor(block_ids, dtype=torch.int64)
    return (table[positions // block_size] * block_size + positions % block_size).to(device)


class ModelRunner:
    """Owns nothing but references: the model, the cache tensors and the hook."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor], block_size: int,
                 *, layer_kv_hook: LayerKVHook | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.layer_kv_hook = layer_kv_hook
        self.device = model.device
        self.scale = model.config.head_dim ** -0.5
        self.sliding_window = model.config.sliding_window

    @torch.inference_mode()
    def execute(self, scheduled: Sequence[ScheduledRequest]) -> ModelRunnerOutput:
        decode = [s for s in scheduled if s.num_new_tokens == 1]
        prefill = [s for s in scheduled if s.num_new_tokens > 1]
        ordered = decode + prefill
        input_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        sampling: list[Request] = []
        for s in ordered:
            r = s.request
            input_ids.extend(r.all_token_ids[s.start : s.end])
            positions.extend(range(s.start, s.end))
            if s.end == r.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                sampling.append(r)
        streamed = self._spans(ordered)
        ctx = self._build_context(decode, prefill, tuple(span for _, span in streamed))
        dev = self.device
        hidden = self.model(torch.tensor(input_ids, dtype=torch.long, device=dev),
                            torch.tensor(positions, dtype=torch.long, device=dev), ctx)
        # Only after the forward: every layer has been handed the spans.
        for request, span in streamed:
            request.num_kv_streamed = span.end
        rows = torch.tensor(sample_rows, dtype=torch.long, device=dev)
        logits = self.model.compute_logits(hidden[rows]) if sample_rows else hidden.new_empty(
            (0, self.model.config.vocab_size), dtype=torch.float32)
        return ModelRunnerOutput(tuple(sampling), logits)

    def _build_context(self, decode: list[ScheduledRequest], prefill: list[ScheduledRequest],
                       spans: tuple[LayerKVSpan, ...]) -> PagedAttentionContext:
        bs, dev = self.block_size, self.device
        slots = []
        for s in decode + prefill:
            table = s.request.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in range(s.start, s.end))
        max_blocks = max((len(s.request.block_ids) for s in decode), default=0)
        tables = [s.request.block_ids + [0] * (max_blocks - len(s.request.block_ids))
                  for s in decode]
        chunks: list[PrefillChunk] = []
        context_slots: list[torch.Tensor] = []
        row, context_start = len(decode), 0
        for s in prefill:
            chunks.append(PrefillChunk(row, s.num_new_tokens, context_start, s.end))
            context_slots.append(slots_for(s.request.block_ids, bs, 0, s.end))
            row += s.num_new_tokens
            context_start += s.end
        return PagedAttentionContext(
            kv_caches=self.kv_caches,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_decode=len(decode),
            decode_block_tables=torch.tensor(tables, dtype=torch.int32, device=dev).reshape(
                len(decode), max_blocks),
            decode_context_lens=torch.tensor([s.end for s in decode], dtype=torch.int32,
                                             device=dev),
            prefill_chunks=tuple(chunks),
            prefill_context_slots=(torch.cat(context_slots) if context_slots
                                   else torch.empty(0, dtype=torch.int64)).to(dev),
            scale=self.scale,
            sliding_window=self.sliding_window,
            hook=self.layer_kv_hook,
            spans=spans,
            kernel_backend=self.model.kernel_backend,
        )

    def _spans(self, scheduled: list[ScheduledRequest]) -> list[tuple[Request, LayerKVSpan]]:
        """Context-token ranges whose KV becomes final this step, not yet streamed."""
        if self.layer_kv_hook is None:
            return []
        spans = []
        for s in scheduled:
            r = s.request
            start, end = r.num_kv_streamed, min(s.end, r.num_context_tokens)
            if start < end:
                slots = slots_for(r.block_ids, self.block_size, start, end, self.device)
                spans.append((r, LayerKVSpan(r.request_id, start, end, slots)))
        return spans
