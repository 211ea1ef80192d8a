"""`ModelRunner`: one forward pass of the model over a scheduled step.

`prepare` runs on the engine loop thread (it reads the requests): it
flattens the scheduled requests into one batch (decode rows first, then
prefill chunks; see `engine.paged_attention_context`), writes the step's
inputs (token ids, positions, slot mapping, decode block tables and context
lengths, sampled rows) into the persistent `StepInputs` tensors, and builds
the attention context over views of them (plus, only when a chunk needs it,
the gathered prefill context's slots, and the LayerKVHook spans). `forward`
runs the model on those inputs and returns the float32 logits of the rows
that sample (a request's last scheduled row when the step samples for it:
it finished its prompt or is decoding). `execute` is both, in order.

A pure-decode step replays the CUDA graph of its batch-size bucket when the
runner captured them (`engine.cuda_graphs`: CUDA, Triton kernels, no
`enforce_eager`, no layer-KV hook); every other step runs eagerly.

With async scheduling (`engine.step_pipeline`) `forward` runs where the
forwards run (a worker thread on CPU), and a decode row may have a
placeholder input: the token the previous step samples for that request,
not yet in `request.all_token_ids`. `prepare` writes 0 there and records
where it comes from; `forward` copies it from the previous step's
sampled-token tensor on the device (no host sync), into the very buffer a
graph replay reads. Because step N+1 is prepared while step N may still be
reading its inputs, a CPU runner under async scheduling alternates between
two `StepInputs` sets; on CUDA one set suffices (the host writes go through staging tensors and
stream-ordered copies; docs/engine.md, Async scheduling).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from engine.cuda_graphs import DecodeGraphs, capture_sizes, eager_reason
from engine.host_copy import to_device
from engine.kv_hook import LayerKVHook, LayerKVSpan
from engine.layer_attention import layer_attention
from engine.layer_gate import LayerGate
from engine.model import LlamaForCausalLM
from engine.paged_attention_context import PagedAttentionContext, PrefillChunk
from engine.prompt_logprobs import (
    PromptLogprobsPlan,
    PromptLogprobsTensors,
    compute_prompt_logprobs,
    plan_prompt_logprobs,
)
from engine.request import Request
from engine.scheduler import ScheduledRequest
from engine.step_inputs import StepInputs

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    """`logits[i]` is the next-token distribution of `sampling_requests[i]`."""

    sampling_requests: tuple[Request, ...]
    logits: torch.Tensor
    prompt_logprobs: PromptLogprobsTensors | None = None  # of PreparedStep.prompt_logprobs


@dataclass(frozen=True, slots=True)
class PreparedStep:
    """One step's model inputs, built by `ModelRunner.prepare` (views of a
    `StepInputs` set). `graph_bucket` is the CUDA graph that runs the step,
    or None to run `context` eagerly. Rows `placeholder_rows` of `input_ids`
    take the previous step's sampled tokens at `placeholder_sources` when the
    forward starts."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    context: PagedAttentionContext | None
    graph_bucket: int | None
    sample_rows: torch.Tensor
    sampling_requests: tuple[Request, ...]
    placeholder_rows: torch.Tensor
    placeholder_sources: torch.Tensor
    prompt_logprobs: PromptLogprobsPlan | None = None  # rows scoring prompt tokens


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
    buffers (a step never holds more); `enforce_eager` turns CUDA graphs off;
    `async_scheduling` says a step may be prepared while another is in flight.
    """

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor], block_size: int,
                 *, layer_kv_hook: LayerKVHook | None = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 enforce_eager: bool = False, async_scheduling: bool = False) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.layer_kv_hook = layer_kv_hook
        self.device = model.device
        self.scale = model.config.head_dim ** -0.5
        self.sliding_window = model.config.sliding_window
        self.layer_attention = layer_attention(model.config)
        max_model_len = max_model_len or model.config.max_position_embeddings
        # A CPU forward reads the buffers themselves, so with a step in
        # flight while the next is prepared it needs a second set.
        num_sets = 2 if async_scheduling and self.device.type != "cuda" else 1
        self._input_sets = tuple(
            StepInputs(max_num_tokens=max(max_num_batched_tokens, max_num_seqs),
                       max_num_seqs=max_num_seqs,
                       max_blocks_per_seq=-(-max_model_len // block_size), device=self.device)
            for _ in range(num_sets))
        self._num_prepared = 0
        self._no_rows = torch.empty(0, dtype=torch.long, device=self.device)
        self.graphs: DecodeGraphs | None = None
        reason = eager_reason(device=self.device, kernel_backend=model.kernel_backend,
                              enforce_eager=enforce_eager,
                              has_layer_kv_hook=layer_kv_hook is not None,
                              model_blocker=model.cuda_graph_blocker)
        if reason is None:
            self.graphs = DecodeGraphs(model, self.inputs, self.decode_graph_context,
                                       capture_sizes(max_num_seqs))
        else:
            log.info("no CUDA graphs, every step runs eagerly: %s", reason)

    @property
    def inputs(self) -> StepInputs:
        """The `StepInputs` set the latest `prepare` wrote (the one set on CUDA)."""
        return self._input_sets[(self._num_prepared - 1) % len(self._input_sets)]

    def execute(self, scheduled: Sequence[ScheduledRequest]) -> ModelRunnerOutput:
        """One step with every input token known (the synchronous path)."""
        return self.forward(self.prepare(scheduled))

    def prepare(self, scheduled: Sequence[ScheduledRequest],
                placeholder_sources: Mapping[str, int] | None = None) -> PreparedStep:
        """Engine loop thread. `placeholder_sources[request_id]`: the row of a
        request in the previous step's sampled tokens, for each request whose
        input token that step samples."""
        self._num_prepared += 1
        inputs = self.inputs
        decode = [s for s in scheduled if s.num_new_tokens == 1]
        prefill = [s for s in scheduled if s.num_new_tokens > 1]
        ordered = decode + prefill
        streamed = self._spans(ordered)
        # The forward hands every layer these spans; a later step (or a
        # preemption, which recomputes) must not stream them again.
        for request, span in streamed:
            request.num_kv_streamed = span.end
        input_ids, placeholders = self._write_input_ids(inputs, ordered, placeholder_sources)
        positions, sample_rows, sampling = self._write_rows(inputs, ordered)
        tables = inputs.block_tables.write_table([s.request.block_ids for s in decode])
        context_lens = inputs.context_lens.write_rows([s.end for s in decode])
        bucket = self._graph_bucket(decode, prefill, streamed)
        ctx = None if bucket is not None else self._eager_context(
            inputs, decode, prefill, tables, context_lens, tuple(span for _, span in streamed))
        rows, sources = (self._index_tensors(*zip(*placeholders, strict=True)) if placeholders
                         else (self._no_rows, self._no_rows))
        return PreparedStep(
            input_ids=input_ids, positions=positions, context=ctx, graph_bucket=bucket,
            sample_rows=sample_rows, sampling_requests=tuple(sampling),
            placeholder_rows=rows, placeholder_sources=sources,
            prompt_logprobs=plan_prompt_logprobs(ordered, self.device))

    def _index_tensors(self, *index_lists: Sequence[int]) -> tuple[torch.Tensor, ...]:
        return tuple(to_device(torch.tensor(values, dtype=torch.long), self.device)
                     for values in index_lists)

    @torch.inference_mode()
    def forward(self, step: PreparedStep,
                previous_tokens: torch.Tensor | None = None) -> ModelRunnerOutput:
        """Run the model; `previous_tokens` (the previous step's sampled token
        ids, on the device) fills the placeholder rows. Reads no request."""
        if step.placeholder_rows.numel():
            step.input_ids[step.placeholder_rows] = previous_tokens[step.placeholder_sources]
        if step.graph_bucket is not None:
            hidden = self.graphs.run(step.graph_bucket)
        else:
            hidden = self.model(step.input_ids, step.positions, step.context)
        if step.sampling_requests:
            logits = self.model.compute_logits(hidden[step.sample_rows])
        else:
            logits = hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        prompt_logprobs = None
        if step.prompt_logprobs is not None:  # only steps of requests that asked
            prompt_logprobs = compute_prompt_logprobs(hidden, step.prompt_logprobs,
                                                      self.model.compute_logits)
        return ModelRunnerOutput(step.sampling_requests, logits, prompt_logprobs)

    @staticmethod
    def _write_input_ids(inputs: StepInputs, ordered: list[ScheduledRequest],
                         placeholder_sources: Mapping[str, int] | None
                         ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """The step's token ids in batch order, written to `inputs.input_ids`,
        and the placeholder rows: (row, row in the previous step's tokens)."""
        ids: list[int] = []
        placeholders: list[tuple[int, int]] = []
        for s in ordered:
            r = s.request
            if s.start < r.num_tokens:
                assert s.end <= r.num_tokens, "only a lone decode row may be a placeholder"
                ids.extend(r.all_token_ids[s.start : s.end])
            else:  # a decode row whose token the previous step samples
                placeholders.append((len(ids), placeholder_sources[r.request_id]))
                ids.append(0)
        return inputs.input_ids.write_rows(ids), placeholders

    def _write_rows(self, inputs: StepInputs, ordered: list[ScheduledRequest]
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
            if s.samples:
                sample_rows.append(len(positions) - 1)
                sampling.append(r)
        inputs.slot_mapping.write_rows(slots)
        return (inputs.positions.write_rows(positions),
                inputs.sample_rows.write_rows(sample_rows), sampling)

    def _graph_bucket(self, decode: list[ScheduledRequest], prefill: list[ScheduledRequest],
                      streamed: list[tuple[Request, LayerKVSpan]]) -> int | None:
        """The bucket whose graph runs this step, or None to run it eagerly:
        only pure-decode steps that stream no KV and fit a bucket replay."""
        if self.graphs is None or prefill or streamed:
            return None
        return self.graphs.bucket_for(len(decode))

    def _eager_context(self, inputs: StepInputs, decode: list[ScheduledRequest],
                       prefill: list[ScheduledRequest], tables: torch.Tensor,
                       context_lens: torch.Tensor,
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
        return PagedAttentionContext(
            kv_caches=self.kv_caches,
            slot_mapping=inputs.slot_mapping.buffer[:row],
            num_decode=len(decode),
            decode_block_tables=tables,
            decode_context_lens=context_lens,
            prefill_chunks=tuple(chunks),
            prefill_context_slots=(to_device(torch.cat(context_slots), self.device)
                                   if context_slots else None),
            scale=self.scale,
            sliding_window=self.sliding_window,
            layers=self.layer_attention,
            hook=self.layer_kv_hook,
            spans=spans,
            kernel_backend=self.model.kernel_backend,
        )

    def tail_inputs(self, request: Request, start: int, end: int, gate: LayerGate
                    ) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionContext]:
        """Input ids, positions and context of a split prefill's tail, context
        tokens [start, end), computed on its own (engine.tail_worker): fresh
        tensors, not the step buffers, as it runs beside the steps. Every
        layer waits for `gate` and stops when it fails."""
        bs, device = self.block_size, self.device
        input_ids = to_device(torch.tensor(request.all_token_ids[start:end], dtype=torch.long),
                              device)
        positions = to_device(torch.arange(start, end), device)
        ctx = PagedAttentionContext(
            kv_caches=self.kv_caches,
            slot_mapping=slots_for(request.block_ids, bs, start, end, device),
            num_decode=0,
            decode_block_tables=self._no_rows,
            decode_context_lens=self._no_rows,
            prefill_chunks=(PrefillChunk(0, end - start, 0, end),),
            prefill_context_slots=slots_for(request.block_ids, bs, 0, end, device),
            scale=self.scale,
            sliding_window=self.sliding_window,
            layers=self.layer_attention,
            gate=gate,
            kernel_backend=self.model.kernel_backend,
        )
        return input_ids, positions, ctx

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
            layers=self.layer_attention,
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
