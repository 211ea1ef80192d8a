"""`ModelRunner`: one forward pass of the model over a scheduled step.

`prepare` runs on the engine loop thread (it reads the requests): it
flattens the scheduled requests into one batch (decode rows first, then
prefill chunks; see `engine.paged_attention_context`) and builds the
per-step attention context (slot mapping, block tables, context lengths,
gathered prefill context, LayerKVHook spans). `forward` runs the model on
those inputs and returns the float32 logits of the last row of every
request whose scheduled tokens reach its end (it finished its prompt or is
decoding): those are the rows that sample. `execute` is both, in order.

With async scheduling (`engine.step_pipeline`) `forward` runs where the
forwards run (a worker thread on CPU), and a decode row may have a
placeholder input: the token the previous step samples for that request,
not yet in `request.all_token_ids`. `prepare` leaves it 0 and records where
it comes from; `forward` copies it from the previous step's sampled-token
tensor on the device (no host sync).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from engine.host_copy import to_device
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


@dataclass(frozen=True, slots=True)
class StepInputs:
    """One step's model inputs, built by `ModelRunner.prepare`. Rows
    `placeholder_rows` of `input_ids` take the previous step's sampled tokens
    at `placeholder_sources` when the forward starts."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    context: PagedAttentionContext
    sample_rows: torch.Tensor
    sampling_requests: tuple[Request, ...]
    placeholder_rows: torch.Tensor
    placeholder_sources: torch.Tensor


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

    def execute(self, scheduled: Sequence[ScheduledRequest]) -> ModelRunnerOutput:
        """One step with every input token known (the synchronous path)."""
        return self.forward(self.prepare(scheduled))

    def prepare(self, scheduled: Sequence[ScheduledRequest],
                placeholder_sources: Mapping[str, int] | None = None) -> StepInputs:
        """Engine loop thread. `placeholder_sources[request_id]`: the row of a
        request in the previous step's sampled tokens, for each request whose
        input token that step samples."""
        decode = [s for s in scheduled if s.num_new_tokens == 1]
        prefill = [s for s in scheduled if s.num_new_tokens > 1]
        ordered = decode + prefill
        input_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        sampling: list[Request] = []
        placeholders: list[tuple[int, int]] = []  # (row, row in the previous step's tokens)
        for s in ordered:
            r = s.request
            if s.start < r.num_tokens:
                assert s.end <= r.num_tokens, "only a lone decode row may be a placeholder"
                input_ids.extend(r.all_token_ids[s.start : s.end])
            else:  # a decode row whose token the previous step samples
                placeholders.append((len(input_ids), placeholder_sources[r.request_id]))
                input_ids.append(0)
            positions.extend(range(s.start, s.end))
            if s.samples:
                sample_rows.append(len(input_ids) - 1)
                sampling.append(r)
        streamed = self._spans(ordered)
        # The forward hands every layer these spans; a later step (or a
        # preemption, which recomputes) must not stream them again.
        for request, span in streamed:
            request.num_kv_streamed = span.end
        ctx = self._build_context(decode, prefill, tuple(span for _, span in streamed))
        dev = self.device
        rows, sources = zip(*placeholders, strict=True) if placeholders else ((), ())
        return StepInputs(
            input_ids=to_device(torch.tensor(input_ids, dtype=torch.long), dev),
            positions=to_device(torch.tensor(positions, dtype=torch.long), dev),
            context=ctx,
            sample_rows=to_device(torch.tensor(sample_rows, dtype=torch.long), dev),
            sampling_requests=tuple(sampling),
            placeholder_rows=to_device(torch.tensor(rows, dtype=torch.long), dev),
            placeholder_sources=to_device(torch.tensor(sources, dtype=torch.long), dev))

    @torch.inference_mode()
    def forward(self, inputs: StepInputs,
                previous_tokens: torch.Tensor | None = None) -> ModelRunnerOutput:
        """Run the model; `previous_tokens` (the previous step's sampled token
        ids, on the device) fills the placeholder rows. Reads no request."""
        input_ids = inputs.input_ids
        if inputs.placeholder_rows.numel():
            input_ids[inputs.placeholder_rows] = previous_tokens[inputs.placeholder_sources]
        hidden = self.model(input_ids, inputs.positions, inputs.context)
        logits = (self.model.compute_logits(hidden[inputs.sample_rows])
                  if inputs.sampling_requests else hidden.new_empty(
                      (0, self.model.config.vocab_size), dtype=torch.float32))
        return ModelRunnerOutput(inputs.sampling_requests, logits)

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
            slot_mapping=to_device(torch.tensor(slots, dtype=torch.int64), dev),
            num_decode=len(decode),
            decode_block_tables=to_device(torch.tensor(tables, dtype=torch.int32).reshape(
                len(decode), max_blocks), dev),
            decode_context_lens=to_device(torch.tensor([s.end for s in decode],
                                                       dtype=torch.int32), dev),
            prefill_chunks=tuple(chunks),
            prefill_context_slots=to_device(torch.cat(context_slots) if context_slots
                                            else torch.empty(0, dtype=torch.int64), dev),
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
                slots = to_device(slots_for(r.block_ids, self.block_size, start, end), self.device)
                spans.append((r, LayerKVSpan(r.request_id, start, end, slots)))
        return spans
