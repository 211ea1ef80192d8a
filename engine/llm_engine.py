"""`LLMEngine`: the inference core one pod runs: requests in, tokens out.

Threading: single-threaded. Every method is called from the one engine loop
thread (`engine.engine_loop.EngineLoop` in the pods, the caller's thread in
`generate()` and tests). Only `kv_caches` may be read elsewhere (the decode
pod's injector writes into reserved slots; the tensors never move), and a
split prefill's tail computes on its own thread (`engine.tail_worker`).

A request's life (states in `engine.request`):

    add_request ─> waiting ─> running (chunked prefill, then decode) ─> finished
                      ^           │ preempted (blocks freed, recompute later)
                      └───────────┘
    reserve_remote ─> reserved (blocks for context + max_tokens held, a cached
                      prefix pinned; the injector fills the rest) ─ commit_remote
                      ─> running ─> finished
    reserve_remote ─> reserved ─ start_tail (a split prefill: the tail computes
                      on the tail worker) ─> running with one context token left
    abort_request: any state ─> finished ("abort"), blocks freed at once (a
                      split's tail still computing: once it stopped)

`step()` schedules one batch, runs one forward pass, samples, and returns
one `RequestOutput` per request that sampled a token or finished (a finish
caused between steps, by `abort_request` or a `commit_remote` whose first
token ends the request, is reported by the next `step()`).

With async scheduling (`EngineConfig.async_scheduling`, docs/engine.md)
`step()` schedules and launches step N+1, then completes step N and returns
its outputs while N+1 computes (`engine.step_pipeline`): a step's tokens
come out of the *next* `step()` call, and `has_unfinished_requests()` stays
true while a step is in flight. A request that stopped at N but was already
in N+1 has its N+1 token discarded; blocks of a request finished, aborted
or preempted while a step that includes it is in flight return to the pool
when that step completes.

Tensor parallelism (docs/tensor_parallel.md): at N > 1 ranks this engine is rank 0 and
drives the others (`engine.parallel`); a dying rank makes `step()` raise TensorParallelError.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from functools import partial

from engine.block_manager import BlockManager, cdiv
from engine.config import EngineConfig
from engine.errors import CapacityError
from engine.grammar import GrammarCompiler, model_tokenizer
from engine.grammar_batch import GrammarBatch
from engine.itl_budget import ItlBudget
from engine.kv_hook import LayerKVHook
from engine.layer_gate import LayerGate
from engine.local_rule import LocalAsk
from engine.model_runner import slots_for
from engine.offline import generate_batch, model_dir_tokenizer
from engine.outputs import EngineStats, GenerationResult, RemoteReservation, RequestOutput
from engine.parallel.launch import build_first_rank
from engine.prompt_logprobs import deliver as deliver_prompt_logprobs
from engine.prompt_logprobs import take_prompt_logprobs
from engine.request import Request, RequestStatus
from engine.request_checks import RequestLimits, check_new_request
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.step_pipeline import CompletedStep, StepPipeline
from engine.tail_worker import TailJob, TailWorker


class LLMEngine:
    """Owns the model, the paged KV cache, the scheduler and the sampler.

    `layer_kv_hook` (prefill pods) is a constructor argument rather than
    config because it is a live object bound to the pod's sender.
    """

    def __init__(self, config: EngineConfig, *, layer_kv_hook: LayerKVHook | None = None) -> None:
        self.config = config
        # Refuses what cannot run, before any step. `tp`: the pod's other
        # ranks (TP > 1: started first, loading their shards beside ours).
        self.tp, rank = build_first_rank(config, layer_kv_hook)
        loaded, self.runner, self.kv_caches = rank.loaded, rank.runner, rank.kv_caches
        self.model, self.model_config = loaded.model, loaded.model_config
        self.matmul_backend, self.native_gemm = loaded.matmul_backend, loaded.native_gemm
        self.max_model_len, self.device = loaded.max_model_len, self.model.device
        mc = self.model_config
        self.block_manager = BlockManager(rank.num_blocks, config.block_size,
                                          enable_prefix_caching=config.enable_prefix_caching)
        budget = ItlBudget.of(config.itl_budget)
        self.scheduler = Scheduler.from_config(self.block_manager, config, budget)
        self.sampler = Sampler(config.seed)
        self.async_scheduling = config.use_async_scheduling
        self.eos_token_ids = loaded.eos_token_ids
        # Structured outputs: matchers of the requests with a grammar; the
        # compiler is thread-safe (the pods compile off the engine thread).
        self.grammars = GrammarBatch(GrammarCompiler(partial(
            model_tokenizer, config.model_dir, mc.vocab_size, self.eos_token_ids)), mc.vocab_size)
        # On CPU the forwards run on a worker thread, so the engine thread's
        # Python work overlaps them (torch ops release the GIL).
        self._pipeline = StepPipeline(self.runner, self.sampler,
                                      use_worker=self.async_scheduling and config.device == "cpu",
                                      grammars=self.grammars, eos_token_ids=self.eos_token_ids,
                                      tp=self.tp if self.tp.size > 1 else None,
                                      async_scheduling=self.async_scheduling,
                                      on_step_time=budget.observe if budget else None)
        self._tokenizer = None  # loaded by the first generate() that needs text
        self._generate_ids = (f"generate-{i}" for i in itertools.count())
        self._requests: dict[str, Request] = {}
        # Finished between steps (abort, commit ending a request): reported next step.
        self._pending: list[RequestOutput] = []
        self._limits = RequestLimits(mc.vocab_size, self.max_model_len, config.block_size,
                                     self.block_manager.num_total_blocks)
        # split prefills' tails, computed beside the steps (start_tail)
        self.tails = TailWorker(self.model)

    # ------------------------------------------------------------ admission

    def _new_request(self, request_id: str, prompt_token_ids: Sequence[int],
                     sampling_params: SamplingParams, output_token_ids: Sequence[int],
                     **kwargs) -> Request:
        """Validate everything a caller can get wrong; raises ValueError naming it."""
        check_new_request(request_id, prompt_token_ids, sampling_params, output_token_ids,
                          ids_in_use=self._requests, limits=self._limits)
        return Request(request_id, prompt_token_ids, sampling_params,
                       output_token_ids=output_token_ids, **kwargs)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    sampling_params: SamplingParams, *, output_token_ids: Sequence[int] = (),
                    prefill_only: bool = False) -> None:
        """Queue a request. `output_token_ids` (a migration) are context and count toward
        max_tokens. `prefill_only` (prefill pods): finish with "prefill_done" after the first
        sampled token; its blocks return to the pool but stay in the prefix cache."""
        request = self._new_request(request_id, prompt_token_ids, sampling_params,
                                    output_token_ids, prefill_only=prefill_only)
        if sampling_params.grammar is not None:
            self.grammars.start(request)
        self._requests[request_id] = request
        self.scheduler.add(request)

    def reserve_remote(self, request_id: str, prompt_token_ids: Sequence[int],
                       sampling_params: SamplingParams, *,
                       output_token_ids: Sequence[int] = (),
                       local_prefill_below: int = 0,
                       prefill_cached_tokens: int | None = None) -> RemoteReservation | None:
        """Decode pod: hold blocks for all context tokens plus the remaining max_tokens, so the
        request never needs more. Raises CapacityError when the blocks or a batch slot are
        not free now.

        With the prefix cache on, the longest cached prefix of whole blocks (leaving at least
        one context token) is mapped in first and pinned until the request ends: the
        reservation's `num_held_tokens`, which the prefill pod does not send (cache-miss-only
        transfer). A cached prefix that ends inside a block shares only the blocks before it.

        Conditional disaggregation (engine/local_rule.py): when `local_prefill_below` > 0 and
        fewer context tokens than that are left after the cached prefix, or when
        `prefill_cached_tokens` is given, the cached prefix is longer and the rest fits the
        next step's inter-token budget, the request is queued to be computed here instead, as
        `add_request` would, and None is returned."""
        local = LocalAsk(local_prefill_below, prefill_cached_tokens)  # ValueError if negative
        request = self._new_request(request_id, prompt_token_ids, sampling_params,
                                    output_token_ids,
                                    status=RequestStatus.WAITING_FOR_REMOTE_KV)
        if sampling_params.max_tokens == 0:
            raise ValueError("max_tokens 0 (scoring the prompt) ends after prefill: compute it "
                             "where the prompt is computed, not as a remote reservation")
        request.prompt_logprobs = None  # the prefill pod computes the prompt
        if local.asks(self.scheduler):
            cached = self.block_manager.num_cached_prefix_tokens(request)
            if local.computes_here(self.scheduler, cached, request.num_context_tokens - cached):
                self.add_request(request_id, prompt_token_ids, sampling_params,
                                 output_token_ids=output_token_ids)
                return None
        total = request.num_prompt_tokens + sampling_params.max_tokens
        if self.scheduler.num_seqs >= self.config.max_num_seqs:
            raise CapacityError(f"all {self.config.max_num_seqs} sequence slots are taken")
        if sampling_params.grammar is not None:
            self.grammars.start(request)
        held = self.block_manager.match_prefix(request)  # pinned: counted in block_ids
        needed = cdiv(total, self.config.block_size) - len(request.block_ids)
        free = self.block_manager.num_free_blocks
        if needed > free:
            self.block_manager.free(request)  # lets go of the held prefix
            self.grammars.drop(request_id)
            raise CapacityError(f"request needs {needed} KV blocks, {free} are free")
        self.block_manager.allocate_slots(request, total)
        self._requests[request_id] = request
        self.scheduler.add_reserved(request)
        slots = slots_for(request.block_ids, self.config.block_size, held,
                          request.num_context_tokens, self.config.device)
        return RemoteReservation(request_id, tuple(request.block_ids), self.config.block_size,
                                 request.num_context_tokens, slots, num_held_tokens=held)

    def commit_remote(self, request_id: str, first_token_id: int) -> None:
        """Decode pod: all layers of the reservation's KV are injected and the prefill pod
        sampled `first_token_id`; the request decodes from the next step on (or finishes
        there if that token already ends it)."""
        request = self._reserved(request_id)
        if not 0 <= first_token_id < self.model_config.vocab_size:
            raise ValueError(f"first_token_id {first_token_id} is outside the vocabulary "
                             f"[0, {self.model_config.vocab_size})")
        self.grammars.check_next(request_id, first_token_id)
        request.num_computed_tokens = request.num_context_tokens
        request.append_output_token(first_token_id)
        self.grammars.accept(request_id, first_token_id)
        self.block_manager.cache_computed_blocks(request)
        status = self._stop_status(request, first_token_id, prefill_only=False)
        if status is None:
            self.scheduler.commit_reserved(request)
        else:
            self._finish(request, status)
            self._pending.append(RequestOutput.of(request, (), ()))

    def _reserved(self, request_id: str) -> Request:
        request = self._requests.get(request_id)
        if request is None or request.status is not RequestStatus.WAITING_FOR_REMOTE_KV:
            state = "unknown" if request is None else request.status.name
            raise ValueError(f"request {request_id!r} is not awaiting remote KV ({state})")
        return request

    def start_tail(self, request_id: str, num_head_tokens: int, gate: LayerGate, *,
                   on_done: Callable[[], object] | None = None) -> None:
        """Decode pod, split prefill (docs/architecture.md, "One prompt on both pods"): a
        reservation whose context tokens [0, num_head_tokens) come from a prefill pod layer
        by layer while this engine computes the rest, each layer of it waiting on `gate` for
        that layer of the head. The tail but its last token computes on the tail worker,
        beside the steps (engine.tail_worker; a tail of one token waits there for the whole
        head); then the request joins the next step, which computes the last token and
        samples token 0. A failed gate ends the request aborted. `on_done()` is called on the
        tail worker's thread when the tail is done (the engine loop's `wake`: an idle loop
        steps again). Not at TP > 1 (its collectives would run beside the steps')."""
        if self.tp.size > 1:
            raise ValueError("a split prefill's tail is not computed at tensor_parallel_size > 1")
        request = self._reserved(request_id)
        if not request.num_computed_tokens <= num_head_tokens < request.num_context_tokens:
            raise ValueError(
                f"num_head_tokens {num_head_tokens} must be in [{request.num_computed_tokens}, "
                f"{request.num_context_tokens}): the tail computes at least the last context "
                "token, and the cached prefix is held already")
        if gate.num_layers != self.model_config.num_hidden_layers:
            raise ValueError(f"the gate counts {gate.num_layers} layers, the model has "
                             f"{self.model_config.num_hidden_layers}")
        request.num_computed_tokens = num_head_tokens
        last = request.num_context_tokens - 1
        inputs = (self.runner.tail_inputs(request, num_head_tokens, last, gate)
                  if num_head_tokens < last else None)
        self.tails.start(TailJob(request_id, gate, inputs, on_done))

    def _settle_tails(self) -> None:
        """Tails the worker finished: the request joins the steps with its last context token to
        compute, or (its head lost, or aborted while the tail ran) ends aborted, now that
        nothing writes its blocks."""
        for job in self.tails.finished():
            request = self._requests[job.request_id]
            if job.aborted or not job.ok:
                self._finish(request, RequestStatus.FINISHED_ABORTED)
                self._pending.append(RequestOutput.of(request, (), ()))
                continue
            request.num_computed_tokens = request.num_context_tokens - 1
            self.block_manager.cache_computed_blocks(request)
            self.scheduler.commit_reserved(request)

    def abort_request(self, request_id: str) -> bool:
        """Abort in any state and free its blocks (once the step in flight that includes it
        completes, with async scheduling); False if unknown or already finished. The next
        `step()` reports it with "abort"."""
        request = self._requests.get(request_id)
        if request is None or request.is_finished:
            return False
        tail = self.tails.job(request_id)
        if tail is not None:  # its blocks are freed once the tail stops writing them
            if tail.aborted:
                return False
            tail.aborted = True
            tail.gate.fail()
            return True
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        self._pending.append(RequestOutput.of(request, (), ()))
        return True

    # ------------------------------------------------------------ stepping

    def has_unfinished_requests(self) -> bool:
        """Whether `step()` has work: waiting or running requests, pending
        finish reports, or a step in flight. Reserved requests need no step
        until committed. True once a tensor-parallel rank died (step() raises)."""
        return bool(self.scheduler.waiting or self.scheduler.running or self._pending
                    or self._pipeline or self.tails.has_finished()
                    or self.tp.failure is not None)

    def step(self) -> list[RequestOutput]:
        """One step (see the module docstring). TensorParallelError once a
        tensor-parallel rank died or a collective failed (close the engine)."""
        self.tp.check()
        self._settle_tails()
        outputs, self._pending = self._pending, []
        if self.grammars and self._pipeline and self.grammars.tokens_in_flight():
            # A grammar request's next mask needs the token in flight: complete
            # that step before planning the next (grammar batches lose the overlap).
            while self._pipeline:
                outputs.extend(self._finish_step(self._pipeline.complete()))
        plan = self.scheduler.schedule()
        if plan.scheduled:
            self._pipeline.launch(plan)
        # Async: leave the step just launched in flight and finish the one before.
        keep = 1 if self.async_scheduling and plan.scheduled else 0
        while len(self._pipeline) > keep:
            outputs.extend(self._finish_step(self._pipeline.complete()))
        return outputs

    def _finish_step(self, step: CompletedStep) -> list[RequestOutput]:
        """A completed step's tokens: append, stop checks, outputs."""
        self.scheduler.update_computed(step.plan)
        if step.prompt_logprobs is not None:
            deliver_prompt_logprobs(*step.prompt_logprobs)
        outputs = []
        grammars = self.grammars if self.grammars else None
        for request, token, logprob in zip(step.sampling_requests, step.sampled.token_ids,
                                           step.sampled.logprobs, strict=True):
            if request.is_finished:
                continue  # stopped or aborted while this step was in flight: discarded
            if request.sampling_params.max_tokens == 0:
                # scoring only: the prompt is computed, the row's token is dropped
                self._finish(request, RequestStatus.FINISHED_LENGTH)
                outputs.append(RequestOutput.of(request, (), (), take_prompt_logprobs(request)))
                continue
            request.append_output_token(token)
            if grammars is not None:
                grammars.accept(request.request_id, token)
            status = self._stop_status(request, token, prefill_only=request.prefill_only)
            if status is not None:
                self._finish(request, status)
            logprobs = () if logprob is None else (logprob,)
            outputs.append(RequestOutput.of(request, (token,), logprobs,
                                            take_prompt_logprobs(request)))
        return outputs

    def _stop_status(self, request: Request, token: int, *,
                     prefill_only: bool) -> RequestStatus | None:
        """Why the request ends after `token`, or None to continue. A prefill-only
        request always ends ("prefill_done"); the decode pod judges the token."""
        if prefill_only:
            return RequestStatus.FINISHED_PREFILL_DONE
        params = request.sampling_params
        if (token in self.eos_token_ids and not params.ignore_eos) or (
                token in params.stop_token_ids):
            return RequestStatus.FINISHED_STOPPED
        if self.grammars and self.grammars.finished(request.request_id):
            return RequestStatus.FINISHED_STOPPED  # the grammar is complete
        if (request.num_output_tokens >= params.max_tokens
                or request.num_tokens >= self.max_model_len):
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.scheduler.finish(request, status)
        del self._requests[request.request_id]
        self.grammars.drop(request.request_id)
        self.tp.forget(request.request_id)

    def on_fatal(self, callback: Callable[[], object]) -> None:
        """`callback()` runs on another thread when a tensor-parallel rank exits."""
        self.tp.on_failure(callback)

    def close(self) -> None:
        """Stop the tensor-parallel workers and leave the group (idempotent)."""
        self.tp.close()

    def stats(self) -> EngineStats:
        """Counts for GetLoad and the gauges (engine loop thread)."""
        waiting = self.scheduler.waiting
        cache = self.block_manager.prefix_cache
        return EngineStats(
            num_waiting=len(waiting),
            num_waiting_tokens=sum(r.num_tokens - r.num_computed_tokens for r in waiting),
            num_running=len(self.scheduler.running),
            num_reserved=len(self.scheduler.reserved),
            num_reserved_blocks=sum(len(r.block_ids) for r in self.scheduler.reserved.values()),
            num_free_blocks=self.block_manager.num_free_blocks,
            num_total_blocks=self.block_manager.num_total_blocks,
            prefix_cache_queries=cache.num_queries,
            prefix_cache_hits=cache.num_hits,
            num_preemptions=self.scheduler.num_preemptions)

    # ------------------------------------------------------------ offline use

    def generate(self, prompts: list[list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams]
                 ) -> list[GenerationResult]:
        """Run `prompts` to completion (all batched together) and return one result per prompt,
        in order. Text and stop strings use the model directory's tokenizer when it has one:
        a request whose text contains a stop string ends there (text cut before it,
        finish_reason "stop"). Must not be mixed with requests that other code steps
        concurrently."""
        if self._tokenizer is None:  # loaded by the first call that finds one
            self._tokenizer = model_dir_tokenizer(self.config.model_dir)
        return generate_batch(self, prompts, sampling_params, tokenizer=self._tokenizer,
                              request_ids=self._generate_ids)
