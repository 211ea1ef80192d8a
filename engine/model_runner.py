"""`ModelRunner`: one forward pass of the model over a scheduled step.

Called by `LLMEngine.step()` on the engine loop thread. It flattens the
scheduled requests into one batch (decode rows first, then prefill chunks;
see `engine.paged_attention_context`), writes the step's inputs (token ids,
positions, slot mapping, decode block tables and context lengths, sampled
rows) into the persistent `StepInputs` tensors, builds the attention
context over views of them (plus, only when a chunk needs it, the gathered
prefill context's slots, and the LayerKVHook spans), runs the model, and
returns the float32 logits of the last row of every request whose scheduled
tokens reach its end (it finished its prompt or is decoding): those are the
rows that sample.

A pure-decode step replays the CUDA graph of its batch-size bucket when the
runner captured them (`engine.cuda_graphs`: CUDA, Triton kernels, no
`enforce_eager`, no layer-KV hook); every other step runs eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.cuda_graphs import DecodeGraphs, capture_sizes, eager_reason
from engine.kv_hook import LayerKVHook, LayerKVSpan
from engine.model import LlamaForCausalLM
from engine.paged_attention_context import PagedAttentionContext, PrefillChunk
from engine.request import Request
from engine.scheduler import ScheduledRequest
from engine.step_inputs import StepInputs

log = logging.getLogger(__name__)


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
    """Holds references to the model, the cache tensors and the hook; owns the
    step input buffers and the decode graphs.

    `max_num_seqs`, `max_num_batched_tokens` and `max_model_len` size the
    buffers (a step never holds more); `enforce_eager` turns CUDA graphs off.
    """

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor], block_size: int,
                 *, layer_kv_hook: LayerKVHook | None = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 enforce_eager: bool = False) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.layer_kv_hook = layer_kv_hook
        self.device = model.device
        self.scale = model.config.head_dim ** -0.5
        self.sliding_window = model.config.sliding_window
        max_model_len = max_model_len or model.config.max_position_embeddings
        self.inputs = StepInputs(
            max_num_tokens=max(max_num_batched_tokens, max_num_seqs), max_num_seqs=max_num_seqs,
            max_blocks_per_seq=-(-max_model_len // block_size), device=self.device)
        self.graphs: DecodeGraphs | None = None
        reason = eager_reason(device=self.device, kernel_backend=model.kernel_backend,
                              enforce_eager=enforce_eager,
                              has_layer_kv_hook=layer_kv_hook is not None)
        if reason is None:
            self.graphs = DecodeGraphs(model, self.inputs, self.decode_graph_context,
                                       capture_sizes(max_num_seqs))
        else:
            log.info("no CUDA graphs, every step runs eagerly: %s", reason)

    @torch.inference_mode()
    def execute(self, scheduled: Sequence[ScheduledRequest]) -> ModelRunnerOutput:
        """One forward pass over the step (engine loop thread); see module docstring."""
        decode = [s for s in scheduled if s.num_new_tokens == 1]
        prefill = [s for s in scheduled if s.num_new_tokens > 1]
        ordered = decode + prefill
        streamed = self._spans(ordered)
        input_ids = self._write_input_ids(ordered)
        positions, sample_rows, sampling = self._write_rows(ordered)
        tables = self.inputs.block_tables.write_table([s.request.block_ids for s in decode])
        context_lens = self.inputs.context_lens.write_rows([s.end for s in decode])
        bucket = self._graph_bucket(decode, prefill, streamed)
        if bucket is not None:
            hidden = self.graphs.run(bucket)
        else:
            ctx = self._eager_context(decode, prefill, tables, context_lens,
                                      tuple(span for _, span in streamed))
            hidden = self.model(input_ids, positions, ctx)
        # Only after the forward: every layer has been handed the spans.
        for request, span in streamed:
            request.num_kv_streamed = span.end
        logits = self.model.compute_logits(hidden[sample_rows]) if sampling else hidden.new_empty(
            (0, self.model.config.vocab_size), dtype=torch.float32)
        return ModelRunnerOutput(tuple(sampling), logits)

    def _write_input_ids(self, ordered: list[ScheduledRequest]) -> torch.Tensor:
        """The step's token ids in batch order, written to `inputs.input_ids`.

        Kept on its own: with async scheduling a decode row's id can come
        from the previous step's sampled-token tensor instead of
        `request.all_token_ids`."""
        ids: list[int] = []
        for s in ordered:
            ids.extend(s.request.all_token_ids[s.start : s.end])
        return self.inputs.input_ids.write_rows(ids)

    def _write_rows(self, ordered: list[ScheduledRequest]
                    ) -> tuple[torch.Tensor, torch.Tensor, list[Request]]:
        """Positions and cache slots of every row, and the rows that sample."""
        bs = self.block_size
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sampling: list[Request] = []
        for s in ordered:
            r, table, start = s.request, s.request.block_ids, s.start
            end = start + s.num_new_tokens
            if end - start == 1:  # the common row: decoding
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                positions.extend(range(start, end))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if end == r.num_tokens:
                sample_rows.append(len(positions) - 1)
                sampling.append(r)
        self.inputs.slot_mapping.write_rows(slots)
        return (self.inputs.positions.write_rows(positions),
                self.inputs.sample_rows.write_rows(sample_rows), sampling)

    def _graph_bucket(self, decode: list[ScheduledRequest], prefill: list[ScheduledRequest],
                      streamed: list[tuple[Request, LayerKVSpan]]) -> int | None:
        """The bucket whose graph runs this step, or None to run it eagerly:
        only pure-decode steps that stream no KV and fit a bucket replay."""
        if self.graphs is None or prefill or streamed:
            return None
        return self.graphs.bucket_for(len(decode))

    def _eager_context(self, decode: list[ScheduledRequest], prefill: list[ScheduledRequest],
                       tables: torch.Tensor, context_lens: torch.Tensor,
                       spans: tuple[LayerKVSpan, ...]) -> PagedAttentionContext:
        bs = self.block_size
        chunks: list[PrefillChunk] = []
        context_slots: list[torch.Tensor] = []
        row, context_start = len(decode), 0
        for s in prefill:
            if s.end > s.num_new_tokens:  # earlier context: gathered from the cache
                chunks.append(PrefillChunk(row, s.num_new_tokens, context_start, s.end))
                context_slots.append(slots_for(s.request.block_ids, bs, 0, s.end))
                context_start += s.end
            else:
                chunks.append(PrefillChunk(row, s.num_new_tokens, -1, s.end))
            row += s.num_new_tokens
        num_rows = row
        return PagedAttentionContext(
            kv_caches=self.kv_caches,
            slot_mapping=self.inputs.slot_mapping.buffer[:num_rows],
            num_decode=len(decode),
            decode_block_tables=tables,
            decode_context_lens=context_lens,
            prefill_chunks=tuple(chunks),
            prefill_context_slots=(torch.cat(context_slots).to(self.device) if context_slots
                                   else None),
            scale=self.scale,
            sliding_window=self.sliding_window,
            hook=self.layer_kv_hook,
            spans=spans,
            kernel_backend=self.model.kernel_backend,
        )

    def decode_graph_context(self, size: int) -> PagedAttentionContext:
        """The context a bucket's graph is captured with: `size` decode rows over
        the full-width static tensors, no prefill, no hook."""
        inputs = self.inputs
        return PagedAttentionContext(
            kv_caches=self.kv_caches,
            slot_mapping=inputs.slot_mapping.buffer[:size],
            num_decode=size,
            decode_block_tables=inputs.block_tables.buffer[:size],
            decode_context_lens=inputs.context_lens.buffer[:size],
            prefill_chunks=(),
            prefill_context_slots=None,
            scale=self.scale,
            sliding_window=self.sliding_window,
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
