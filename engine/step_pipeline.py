"""`StepPipeline`: launches engine steps and completes them in launch order.

Used by `LLMEngine.step()` on the engine loop thread. A step has three
phases:

    schedule   (engine thread)  Scheduler.schedule(): step N+1 is planned
                                while step N may still be in flight; a token
                                N will sample is an output placeholder.
    launch     (engine thread)  ModelRunner.prepare reads the requests and
                                builds the inputs, GrammarBatch.mask the
                                grammar rows' token mask (their previous
                                tokens are known: `LLMEngine.step` makes
                                sure); then forward + sampling are
                                started: queued on the CUDA stream, or
                                handed to the one forward worker thread on
                                CPU. A placeholder row's input id is taken
                                from step N's sampled-token tensor there, on
                                the device, without a host sync.
    complete   (engine thread)  wait for the oldest step, read its sampled
                                tokens (and logprobs) on the host.

Synchronous scheduling completes each step right after launching it. Async
scheduling keeps one step in flight: `step()` schedules and launches N+1,
then completes N and processes its tokens while N+1 computes.

Threads: on CUDA there is no worker (kernel launches return at once, the
sampled tokens are copied to pinned host memory in stream order and an
event says when they are there). On CPU, torch ops release the GIL, so a
single worker thread runs the forwards one after another (in launch order,
so step N+1 reads step N's tokens after they exist) while the engine thread
does its Python work. The worker touches only the prepared tensors, the
model, the KV cache and the LayerKVHook (which therefore runs on the worker
thread); never a `Request`.

Tensor parallelism (`tp`, rank 0's `TPLeader`): launch sends the step's
description to the other ranks after preparing it and before starting the
forward, so every rank runs the same collectives in launch order; with
async scheduling, the forward thread broadcasts each step's sampled token
ids after sampling (the other ranks fill their placeholder rows from them).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine.grammar_batch import GrammarBatch, TokenMask
from engine.logits_processors import LogitsAdjustments, build_adjustments
from engine.model_runner import ModelRunner, PreparedStep
from engine.parallel.launch import TPLeader
from engine.prompt_logprobs import PromptLogprobsPlan, PromptLogprobsTensors
from engine.request import Request
from engine.sampler import SampledTensors, Sampler, SamplerOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput

_NO_SAMPLES = SamplerOutput((), ())


@dataclass(frozen=True, slots=True)
class _Result:
    """What a launched step leaves behind: its sampled tokens on the device
    (the next step's placeholders read them), a host copy, and on CUDA the
    event recorded after both."""

    token_ids: torch.Tensor | None
    host: SampledTensors | None
    done: torch.cuda.Event | None
    prompt_logprobs: PromptLogprobsTensors | None = None  # on the host


@dataclass(frozen=True, slots=True)
class _Launched:
    plan: SchedulerOutput
    sampling_requests: tuple[Request, ...]
    params: tuple[SamplingParams, ...]
    result: Future[_Result]
    prompt_logprobs: PromptLogprobsPlan | None = None
    launched_at: float = 0.0  # time.perf_counter() when launch began


@dataclass(frozen=True, slots=True)
class CompletedStep:
    """A step whose forward has finished: `sampled` has one token per
    `sampling_requests` entry (requests may have finished meanwhile)."""

    plan: SchedulerOutput
    sampling_requests: tuple[Request, ...]
    sampled: SamplerOutput
    # the step's prompt-logprob rows and their values (host), when any request asked
    prompt_logprobs: tuple[PromptLogprobsPlan, PromptLogprobsTensors] | None = None


class StepPipeline:
    """Steps launched and not yet completed, oldest first. `use_worker`: run
    forwards on a worker thread (CPU async scheduling). `tp`: the other
    ranks of a tensor-parallel pod; `async_scheduling`: a step may be
    launched before the previous one completed (its placeholder rows then
    need that step's sampled tokens on every rank)."""

    def __init__(self, runner: ModelRunner, sampler: Sampler, *, use_worker: bool,
                 grammars: GrammarBatch, eos_token_ids: frozenset[int] = frozenset(),
                 tp: TPLeader | None = None, async_scheduling: bool = False,
                 on_step_time: Callable[[tuple, float], None] | None = None) -> None:
        """`on_step_time(scheduled, seconds)`: told each completed step's plan
        and how long it held the forward (from its launch, or from the
        previous step's completion when it waited behind that one)."""
        self._runner = runner
        self._on_step_time = on_step_time
        self._last_completed = 0.0
        self._tp = tp
        self._async = async_scheduling
        self._sampler = sampler
        self._grammars = grammars
        self._eos_token_ids = eos_token_ids  # min_tokens masks these
        self._cuda = runner.device.type == "cuda"
        self._worker = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-forward")
                        if use_worker else None)
        self._in_flight: deque[_Launched] = deque()

    def __len__(self) -> int:
        return len(self._in_flight)

    def launch(self, plan: SchedulerOutput) -> None:
        """Prepare `plan`'s inputs and start its forward and sampling."""
        launched_at = time.perf_counter()
        previous = self._in_flight[-1] if self._in_flight else None
        sources = ({} if previous is None else
                   {r.request_id: row for row, r in enumerate(previous.sampling_requests)})
        inputs = self._runner.prepare(plan.scheduled, sources)
        requests = inputs.sampling_requests
        broadcast = self._tp is not None and self._async and bool(requests)
        if self._tp is not None:
            self._tp.send_step(inputs, broadcast_sampled=broadcast)
        params = tuple(r.sampling_params for r in requests)
        # The scheduler counted this step's token as a placeholder already.
        indices = tuple(r.num_output_tokens + r.num_output_placeholders - 1 for r in requests)
        mask = self._grammars.mask(requests)
        # A second placeholder is the token the step in flight samples (async scheduling).
        pending = [sources.get(r.request_id) if r.num_output_placeholders > 1 else None
                   for r in requests]
        adjustments = build_adjustments(requests, indices, pending, self._eos_token_ids,
                                        self._runner.model.config.vocab_size,
                                        self._runner.device)
        try:
            result = self._submit(self._run, inputs,
                                  None if previous is None else previous.result,
                                  params, indices, mask, adjustments, broadcast)
        except Exception as exc:
            if self._tp is None:
                raise
            # the ranks are out of step for good: say why (TensorParallelError)
            raise self._tp.explain(exc) from exc
        self._in_flight.append(_Launched(plan, requests, params, result, inputs.prompt_logprobs,
                                         launched_at))

    def complete(self) -> CompletedStep:
        """Wait for the oldest step in flight and read its tokens on the host."""
        step = self._in_flight.popleft()
        try:
            result = step.result.result()  # re-raises what the forward raised
            if result.done is not None:
                result.done.synchronize()
        except Exception as exc:
            if self._tp is None:
                raise
            raise self._tp.explain(exc) from exc
        if self._on_step_time is not None:
            now = time.perf_counter()
            self._on_step_time(step.plan.scheduled,
                               now - max(step.launched_at, self._last_completed))
            self._last_completed = now
        sampled = _NO_SAMPLES if result.host is None else result.host.output(step.params)
        prompt = None
        if step.prompt_logprobs is not None:
            prompt = (step.prompt_logprobs, result.prompt_logprobs)
        return CompletedStep(step.plan, step.sampling_requests, sampled, prompt)

    def _submit(self, fn: Callable[..., _Result], *args) -> Future[_Result]:
        if self._worker is not None:
            return self._worker.submit(fn, *args)
        future: Future[_Result] = Future()
        future.set_result(fn(*args))  # an exception propagates from step() at once
        return future

    def _run(self, inputs: PreparedStep, previous: Future[_Result] | None,
             params: tuple[SamplingParams, ...], indices: tuple[int, ...],
             mask: TokenMask | None, adjustments: LogitsAdjustments | None,
             broadcast: bool) -> _Result:
        """Forward + sampling (worker thread on CPU), then the sampled tokens
        to the other ranks when `broadcast`. `previous` is done: the worker
        runs steps in order, and on CUDA its tensors are stream-ordered."""
        previous_tokens = None
        if inputs.placeholder_rows.numel() or (
                adjustments is not None and adjustments.pending_rows.numel()):
            assert previous is not None
            previous_tokens = previous.result().token_ids
        output = self._runner.forward(inputs, previous_tokens)
        token_ids = host = None
        if params:
            sampled = self._sampler.sample(output.logits, params, indices, token_mask=mask,
                                           adjustments=adjustments,
                                           previous_tokens=previous_tokens)
            token_ids = sampled.token_ids
            if broadcast:
                self._tp.broadcast_sampled(token_ids)
            host = sampled.to("cpu", non_blocking=True) if self._cuda else sampled
        prompt = output.prompt_logprobs
        if prompt is not None and self._cuda:
            prompt = prompt.to("cpu", non_blocking=True)
        done = None
        if self._cuda:
            done = torch.cuda.Event()
            done.record()
        return _Result(token_ids, host, done, prompt)
