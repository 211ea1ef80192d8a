"""`SimEngine`: an engine without a model, for simulated pods.

Who uses it: the simulated engine loop (sim/engine_loop.py) calls it the
way `engine.engine_loop.EngineLoop` calls `LLMEngine`: `add_request`,
`reserve_remote`, `commit_remote`, `abort_request`, `stats()`,
`has_unfinished_requests()`, plus `plan_step()` / `finish_step(plan)`
around the modelled step time (a real step is one `step()` call; the
simulated one is split so the loop can sleep in between). Event loop only.

What is real: the request checks (engine/request_checks.py), `Request`
and its state table, the `Scheduler` (chunked prefill, decode-first,
preemption, deferred frees of a step in flight), the `BlockManager`,
`BlockPool` and `PrefixCache` (so block ids, block hashes and KV cache
events are a real pod's). What is simulated: the forward pass (its time
comes from the `PerfModel`) and sampling: output token i of a request is
`token_at(seed, prompt, i)`, a hash of the request's sampling seed, its
prompt and i, so the same request gets the same tokens on any simulated
pod, disaggregated or not. No token is an end-of-sequence token: a
request ends at max_tokens (or when the context reaches max_model_len).

Not simulated, refused with ValueError: structured outputs (grammar),
logprobs and prompt logprobs, split prefill (`start_tail`).

A request's life is `LLMEngine`'s (engine/llm_engine.py): add_request ->
waiting -> running -> finished; reserve_remote -> reserved -> commit_remote
-> running -> finished; abort_request from any state. A plan is in flight
between `plan_step` and `finish_step`: an abort meanwhile frees the
request's blocks only when that step finishes (the scheduler's deferred
frees), exactly as with the real engine's async scheduling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

from engine.block_manager import BlockManager, cdiv
from engine.errors import CapacityError
from engine.local_rule import LocalAsk
from engine.outputs import EngineStats, RemoteReservation, RequestOutput
from engine.request import Request, RequestStatus
from engine.request_checks import RequestLimits, check_new_request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput


@dataclass(frozen=True, slots=True)
class SimEngineConfig:
    """What sizes one simulated engine (a real pod's engine flags)."""

    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    mixed_prefill_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_model_len", "num_blocks", "block_size", "max_num_seqs",
                     "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.mixed_prefill_tokens < 0:
            raise ValueError(f"mixed_prefill_tokens must be >= 0, got "
                             f"{self.mixed_prefill_tokens}")


def token_at(seed: int | None, prompt_token_ids: Sequence[int], index: int, vocab: int) -> int:
    """Output token `index` of a request: deterministic in (seed, prompt, index)."""
    digest = xxhash.xxh64(repr((seed or 0, index)).encode())
    digest.update(b"".join(t.to_bytes(4, "little") for t in prompt_token_ids))
    return digest.intdigest() % vocab


class SimEngine:
    """Real scheduler and block pool, modelled forward (module docstring)."""

    def __init__(self, config: SimEngineConfig) -> None:
        self.config = config
        self.max_model_len = config.max_model_len
        self.block_manager = BlockManager(config.num_blocks, config.block_size,
                                          enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   mixed_prefill_tokens=config.mixed_prefill_tokens)
        self._limits = RequestLimits(config.vocab_size, config.max_model_len, config.block_size,
                                     config.num_blocks)
        self._requests: dict[str, Request] = {}
        self._pending: list[RequestOutput] = []  # finished between steps: reported next

    # ------------------------------------------------------------ admission

    def _new_request(self, request_id: str, prompt_token_ids: Sequence[int],
                     params: SamplingParams, output_token_ids: Sequence[int],
                     **kwargs) -> Request:
        check_new_request(request_id, prompt_token_ids, params, output_token_ids,
                          ids_in_use=self._requests, limits=self._limits)
        _check_simulated(params)
        return Request(request_id, prompt_token_ids, params, output_token_ids=output_token_ids,
                       **kwargs)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    sampling_params: SamplingParams, *, output_token_ids: Sequence[int] = (),
                    prefill_only: bool = False) -> None:
        request = self._new_request(request_id, prompt_token_ids, sampling_params,
                                    output_token_ids, prefill_only=prefill_only)
        self._requests[request_id] = request
        self.scheduler.add(request)

    def reserve_remote(self, request_id: str, prompt_token_ids: Sequence[int],
                       sampling_params: SamplingParams, *,
                       output_token_ids: Sequence[int] = (),
                       local_prefill_below: int = 0,
                       prefill_cached_tokens: int | None = None) -> RemoteReservation | None:
        """`LLMEngine.reserve_remote`'s contract: blocks for context +
        max_tokens (a cached prefix pinned), CapacityError when they or a
        batch slot are not free; None when a local rule (engine/local_rule.py)
        has the request computed here. The simulated scheduler has no ITL
        budget, so the within-budget rule never holds, as on a real pod
        without one."""
        local = LocalAsk(local_prefill_below, prefill_cached_tokens)
        if sampling_params.max_tokens == 0:
            raise ValueError("max_tokens 0 (scoring the prompt) ends after prefill: compute it "
                             "where the prompt is computed, not as a remote reservation")
        request = self._new_request(request_id, prompt_token_ids, sampling_params,
                                    output_token_ids, status=RequestStatus.WAITING_FOR_REMOTE_KV)
        bm = self.block_manager
        if local.asks(self.scheduler):
            cached = bm.num_cached_prefix_tokens(request)
            if local.computes_here(self.scheduler, cached, request.num_context_tokens - cached):
                self.add_request(request_id, prompt_token_ids, sampling_params,
                                 output_token_ids=output_token_ids)
                return None
        if self.scheduler.num_seqs >= self.config.max_num_seqs:
            raise CapacityError(f"all {self.config.max_num_seqs} sequence slots are taken")
        held = bm.match_prefix(request)
        total = request.num_prompt_tokens + sampling_params.max_tokens
        needed = cdiv(total, self.config.block_size) - len(request.block_ids)
        if needed > bm.num_free_blocks:
            free = bm.num_free_blocks
            bm.free(request)
            raise CapacityError(f"request needs {needed} KV blocks, {free} are free")
        bm.allocate_slots(request, total)
        self._requests[request_id] = request
        self.scheduler.add_reserved(request)
        # The slots a real injector would write (nobody writes them here).
        slots = torch.zeros(request.num_context_tokens - held, dtype=torch.int64)
        return RemoteReservation(request_id, tuple(request.block_ids), self.config.block_size,
                                 request.num_context_tokens, slots, num_held_tokens=held)

    def commit_remote(self, request_id: str, first_token_id: int) -> None:
        """The prefill pod's KV "landed" with `first_token_id`: the request
        decodes from the next step (or ends now if that token ends it)."""
        request = self._requests.get(request_id)
        if request is None or request.status is not RequestStatus.WAITING_FOR_REMOTE_KV:
            raise ValueError(f"request {request_id!r} is not awaiting remote KV")
        if not 0 <= first_token_id < self.config.vocab_size:
            raise ValueError(f"first_token_id {first_token_id} is outside the vocabulary "
                             f"[0, {self.config.vocab_size})")
        request.num_computed_tokens = request.num_context_tokens
        request.append_output_token(first_token_id)
        self.block_manager.cache_computed_blocks(request)
        if self._ends(request):
            self._finish(request, RequestStatus.FINISHED_LENGTH)
            self._pending.append(RequestOutput.of(request, (), ()))
        else:
            self.scheduler.commit_reserved(request)

    def start_tail(self, *args: object, **kwargs: object) -> None:
        raise ValueError("split prefill is not simulated: simulated decode pods take whole "
                         "prompts' KV")

    def abort_request(self, request_id: str) -> bool:
        request = self._requests.get(request_id)
        if request is None or request.is_finished:
            return False
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        self._pending.append(RequestOutput.of(request, (), ()))
        return True

    # ------------------------------------------------------------ stepping

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self._pending)

    def plan_step(self) -> SchedulerOutput:
        """The next step's plan (possibly empty); it is in flight until `finish_step`."""
        return self.scheduler.schedule()

    def finish_step(self, plan: SchedulerOutput) -> list[RequestOutput]:
        """The planned step completed: its rows' KV is in the (simulated)
        cache, each sampling row gets its token. Returns the step's outputs
        and those of requests that ended between steps."""
        outputs, self._pending = self._pending, []
        if not plan.scheduled:
            return outputs
        self.scheduler.update_computed(plan)
        for row in plan.scheduled:
            request = row.request
            if not row.samples or request.is_finished:
                continue  # a chunk, or aborted while the step was in flight
            if request.sampling_params.max_tokens == 0:  # scoring only: no token
                self._finish(request, RequestStatus.FINISHED_LENGTH)
                outputs.append(RequestOutput.of(request, (), ()))
                continue
            token = token_at(request.sampling_params.seed, request.prompt_token_ids,
                             request.num_output_tokens, self.config.vocab_size)
            request.append_output_token(token)
            if request.prefill_only:
                self._finish(request, RequestStatus.FINISHED_PREFILL_DONE)
            elif self._ends(request):
                self._finish(request, RequestStatus.FINISHED_LENGTH)
            outputs.append(RequestOutput.of(request, (token,), ()))
        return outputs

    def _ends(self, request: Request) -> bool:
        return (request.num_output_tokens >= request.sampling_params.max_tokens
                or request.num_tokens >= self.max_model_len)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.scheduler.finish(request, status)
        del self._requests[request.request_id]

    def stats(self) -> EngineStats:
        waiting, cache = self.scheduler.waiting, self.block_manager.prefix_cache
        reserved = self.scheduler.reserved.values()
        return EngineStats(
            num_waiting=len(waiting),
            num_waiting_tokens=sum(r.num_tokens - r.num_computed_tokens for r in waiting),
            num_running=len(self.scheduler.running),
            num_reserved=len(reserved),
            num_reserved_blocks=sum(len(r.block_ids) for r in reserved),
            num_free_blocks=self.block_manager.num_free_blocks,
            num_total_blocks=self.block_manager.num_total_blocks,
            prefix_cache_queries=cache.num_queries,
            prefix_cache_hits=cache.num_hits,
            num_preemptions=self.scheduler.num_preemptions)


def _check_simulated(params: SamplingParams) -> None:
    """ValueError for what a simulated pod cannot pretend to compute."""
    if params.grammar is not None:
        raise ValueError("structured outputs (a grammar) are not simulated: a simulated pod's "
                         "tokens are a hash, not a model's")
    if params.logprobs is not None or params.prompt_logprobs is not None:
        raise ValueError("logprobs and prompt_logprobs are not simulated: a simulated pod has "
                         "no model distribution")
