"""`ModelRunner`: one forward pass of the model over a scheduled step.

`prepare` runs on the engine loop thread (it reads the requests): it turns
each scheduled request into a `StepRow` and hands them to `build`, which
flattens them into one batch (decode rows first, then prefill chunks; see
`engine.paged_attention_context`), writes the step's inputs (token ids,
positions, slot mapping, decode block tables and context lengths, sampled
rows) into the persistent `StepInputs` tensors, and builds the attention
context over views of them (plus, only when a chunk needs it, the gathered
prefill context's slots, and the LayerKVHook spans). `forward` runs the
model and returns the float32 logits of the rows that sample (a request's
last scheduled row when it finished its prompt or is decoding). `execute`
is both, in order.

Tensor parallelism (docs/tensor_parallel.md, Workers in lockstep): every
rank has a runner over its shard. Rank 0 prepares from requests; the other
ranks `build` from the rows of the step description rank 0 sends them
(`engine.parallel.step_wire`), so every rank writes the same inputs and
runs the same forward and lm_head gathers; only rank 0 gets logits.

A pure-decode step replays its batch-size bucket's CUDA graph when the runner
captured them (`engine.cuda_graphs`: CUDA, Triton kernels, no `enforce_eager`,
no layer-KV hook); every other step runs eagerly.

With async scheduling (`engine.step_pipeline`) `forward` runs where the
forwards run (a worker thread on CPU), and a decode row may have a
placeholder input: the token the previous step samples for that request,
not yet in `request.all_token_ids`. `prepare` writes 0 there and records
where it comes from; `forward` copies it from the previous step's sampled
tokens on the device (no host sync), into the buffer a graph replay reads.
As step N+1 is prepared while step N may still read its inputs, a CPU
runner alternates between two `StepInputs` sets; on CUDA one suffices
(staging tensors, stream-ordered copies; docs/engine.md, Async scheduling).
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
    ROWS_PER_SLICE,
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
    """`logits[i]` is the next-token distribution of `sampling_requests[i]`;
    None on a tensor-parallel rank other than 0 (rank 0 gets the gather)."""

    sampling_requests: tuple[Request, ...]
    logits: torch.Tensor | None
    prompt_logprobs: PromptLogprobsTensors | None = None  # of PreparedStep.prompt_logprobs


@dataclass(frozen=True, slots=True)
class StepRow:
    """One scheduled request's part of a step, all `ModelRunner.build` reads:
    tokens `[start, end)` with input ids `token_ids`, KV slots from
    `block_ids`. A decode row whose token the previous step samples (async
    scheduling) has no `token_ids` but row `placeholder_source` of that
    step's sampled tokens. Made from a `Request` on rank 0 (`step_row`),
    from the step description on the other ranks (`engine.parallel`)."""

    start: int
    num_new_tokens: int
    samples: bool
    block_ids: Sequence[int]
    token_ids: Sequence[int]
    placeholder_source: int = -1

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens


@dataclass(frozen=True, slots=True)
class PreparedStep:
    """One step's model inputs, built by `ModelRunner.build` (views of a
    `StepInputs` set). `graph_bucket` is the CUDA graph that runs the step,
    or None to run `context` eagerly. Rows `placeholder_rows` of `input_ids`
    take the previous step's sampled tokens at `placeholder_sources` when the
    forward starts. `rows` in batch order, and on rank 0 their `request_ids`:
    what a tensor-parallel step description is encoded from."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    context: PagedAttentionContext | None
    graph_bucket: int | None
    sample_rows: torch.Tensor
    sampling_requests: tuple[Request, ...]
    placeholder_rows: torch.Tensor
    placeholder_sources: torch.Tensor
    prompt_logprobs: PromptLogprobsPlan | None = None  # rows scoring prompt tokens
    rows: tuple[StepRow, ...] = ()
    request_ids: tuple[str, ...] = ()


def step_row(s: ScheduledRequest, placeholder_sources: Mapping[str, int] | None) -> StepRow:
    """Rank 0: the `StepRow` of a scheduled request. `placeholder_sources`
    maps a request id to its row in the previous step's sampled tokens."""
    r = s.request
    if s.start < r.num_tokens:
        assert s.end <= r.num_tokens, "only a lone decode row may be a placeholder"
        return StepRow(s.start, s.num_new_tokens, s.samples, r.block_ids,
                       r.all_token_ids[s.start : s.end])
    # a decode row whose token the previous step samples
    return StepRow(s.start, 1, s.samples, r.block_ids, (),
                   placeholder_sources[r.request_id])


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
    `async_scheduling` says a step may be prepared while another is in flight;
    `rank` is the model's tensor-parallel rank (0 without parallelism).
    """

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor], block_size: int,
                 *, layer_kv_hook: LayerKVHook | None = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 enforce_eager: bool = False, async_scheduling: bool = False,
                 rank: int = 0) -> None:
        self.model = model
        self.rank = rank
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
        """Rank 0, engine loop thread: the step of `scheduled`.
        `placeholder_sources[request_id]`: the row of a request in the
        previous step's sampled tokens, for each request whose input token
        that step samples."""
        ordered = ([s for s in scheduled if s.num_new_tokens == 1]
                   + [s for s in scheduled if s.num_new_tokens > 1])
        streamed = self._spans(ordered)
        # The forward hands every layer these spans; a later step (or a
        # preemption, which recomputes) must not stream them again.
        for request, span in streamed:
            request.num_kv_streamed = span.end
        return self.build(
            [step_row(s, placeholder_sources) for s in ordered],
            spans=tuple(span for _, span in streamed),
            prompt_logprobs=plan_prompt_logprobs(ordered, self.device),
            sampling_requests=tuple(s.request for s in ordered if s.samples),
            request_ids=tuple(s.request.request_id for s in ordered))

    def build(self, rows: Sequence[StepRow], *, spans: tuple[LayerKVSpan, ...] = (),
              prompt_logprobs: PromptLogprobsPlan | None = None,
              sampling_requests: tuple[Request, ...] = (),
              request_ids: tuple[str, ...] = ()) -> PreparedStep:
        """The step's tensors, in the next `StepInputs` set: made here only,
        on rank 0 and on every tensor-parallel worker alike. Decode rows
        first, then prefill chunks, each in `rows`' order (the order
        `prompt_logprobs` indexes)."""
        self._num_prepared += 1
        inputs = self.inputs
        decode = [r for r in rows if r.num_new_tokens == 1]
        prefill = [r for r in rows if r.num_new_tokens > 1]
        ordered = decode + prefill
        input_ids, positions, sample_rows, placeholders = self._write_rows(inputs, ordered)
        tables = inputs.block_tables.write_table([r.block_ids for r in decode])
        context_lens = inputs.context_lens.write_rows([r.end for r in decode])
        bucket = self.graph_bucket(len(decode), has_prefill=bool(prefill), has_spans=bool(spans))
        ctx = None if bucket is not None else self._eager_context(
            inputs, decode, prefill, tables, context_lens, spans)
        placeholder_rows, sources = (self._index_tensors(*zip(*placeholders, strict=True))
                                     if placeholders else (self._no_rows, self._no_rows))
        return PreparedStep(
            input_ids=input_ids, positions=positions, context=ctx, graph_bucket=bucket,
            sample_rows=sample_rows, sampling_requests=sampling_requests,
            placeholder_rows=placeholder_rows, placeholder_sources=sources,
            prompt_logprobs=prompt_logprobs, rows=tuple(ordered), request_ids=request_ids)

    def _index_tensors(self, *index_lists: Sequence[int]) -> tuple[torch.Tensor, ...]:
        return tuple(to_device(torch.tensor(values, dtype=torch.long), self.device)
                     for values in index_lists)

    @torch.inference_mode()
    def forward(self, step: PreparedStep,
                previous_tokens: torch.Tensor | None = None) -> ModelRunnerOutput:
        """Run the model; `previous_tokens` (the previous step's sampled token
        ids, on the device) fills the placeholder rows. Reads no request.
        With tensor parallelism every rank calls it for every step, in the
        same order: the forward and the logits are collectives."""
        if step.placeholder_rows.numel():
            step.input_ids[step.placeholder_rows] = previous_tokens[step.placeholder_sources]
        if step.graph_bucket is not None:
            hidden = self.graphs.run(step.graph_bucket)
        else:
            hidden = self.model(step.input_ids, step.positions, step.context)
        if step.sample_rows.numel():
            # Ascending, one per sampling row: as many as the rows means all, in order.
            every = step.sample_rows.numel() == step.input_ids.numel() == hidden.shape[0]
            logits = self.model.compute_logits(hidden if every else hidden[step.sample_rows])
        else:
            logits = hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        prompt_logprobs = None
        if step.prompt_logprobs is not None:  # only steps of requests that asked
            if self.rank == 0:
                prompt_logprobs = compute_prompt_logprobs(hidden, step.prompt_logprobs,
                                                          self.model.compute_logits)
            else:  # the same lm_head gathers, slice by slice; rank 0 scores them
                rows = step.prompt_logprobs.rows
                for i in range(0, rows.numel(), ROWS_PER_SLICE):
                    self.model.compute_logits(hidden[rows[i : i + ROWS_PER_SLICE]])
        return ModelRunnerOutput(step.sampling_requests, logits, prompt_logprobs)

    def _write_rows(self, inputs: StepInputs, ordered: list[StepRow]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
        """Input ids, positions and cache slots of every row in batch order,
        the rows that sample, and the placeholder rows: (row, row in the
        previous step's sampled tokens); a placeholder's id is written 0."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        placeholders: list[tuple[int, int]] = []
        for r in ordered:
            table, start, end = r.block_ids, r.start, r.end
            if r.placeholder_source >= 0:
                placeholders.append((len(ids), r.placeholder_source))
                ids.append(0)
            else:
                ids.extend(r.token_ids)
            if end - start == 1:  # the common row: decoding
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                positions.extend(range(start, end))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if r.samples:
                sample_rows.append(len(positions) - 1)
        inputs.slot_mapping.write_rows(slots)
        return (inputs.input_ids.write_rows(ids), inputs.positions.write_rows(positions),
                inputs.sample_rows.write_rows(sample_rows), placeholders)

    def graph_bucket(self, num_decode: int, *, has_prefill: bool, has_spans: bool) -> int | None:
        """The bucket whose graph runs a step, or None to run it eagerly:
        only pure-decode steps that stream no KV and fit a bucket replay."""
        if self.graphs is None or has_prefill or has_spans:
            return None
        return self.graphs.bucket_for(num_decode)

    def _eager_context(self, inputs: StepInputs, decode: list[StepRow], prefill: list[StepRow],
                       tables: torch.Tensor, context_lens: torch.Tensor,
                       spans: tuple[LayerKVSpan, ...]) -> PagedAttentionContext:
        bs = self.block_size
        chunks: list[PrefillChunk] = []
        context_slots: list[torch.Tensor] = []
        row, context_start = len(decode), 0
        for r in prefill:
            if r.end > r.num_new_tokens:  # earlier context: gathered from the cache
                chunks.append(PrefillChunk(row, r.num_new_tokens, context_start, r.end))
                context_slots.append(slots_for(r.block_ids, bs, 0, r.end))
                context_start += r.end
            else:
                chunks.append(PrefillChunk(row, r.num_new_tokens, -1, r.end))
            row += r.num_new_tokens
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
