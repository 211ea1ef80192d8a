"""`Scheduler`: continuous batching over a token budget, with chunked prefill.

Queues: `waiting` (new and preempted requests, FIFO; preempted ones go back
to the head), `running` (admitted, hold blocks, oldest first) and
`reserved` (WAITING_FOR_REMOTE_KV: blocks held, nothing to compute until
`commit_remote` moves them to `running`).

Each `schedule()` call builds one step:

1. Every running request gets `min(tokens left to compute, budget left)`
   tokens: 1 for a decoding request, a chunk for one still prefilling, so
   decode and prefill mix in one step. With `decode_first` (the default)
   decoding requests are served before the ones still prefilling, so a step
   never holds more than `max_num_batched_tokens` tokens and a decode token
   never waits for a prompt. When a request's blocks do not fit, the newest
   running request not yet scheduled this step is preempted by recompute
   (blocks freed, back to the head of `waiting`) until they do, or until it
   is itself the victim.
2. If nothing was preempted, waiting requests are admitted in order while
   the budget, `max_num_seqs` and free blocks allow; a request's cached
   prefix is mapped in first, and a prompt longer than the remaining budget
   is prefilled over several steps.

Short prompts first (`short_prefill_tokens` S > 0, with `decode_first`):
between the decoding requests and the running prompts' chunks, waiting
requests with at most S tokens left to compute after their cached prefix
(a conversation's next turn whose history is cached, a short prompt) are
admitted, in queue order, within half the step's budget, so they finish in
this step instead of waiting for every longer prompt admitted before them
(on a prefill pod that is most of such a request's time to first token).
The longer prompts keep at least half of every step, so they cannot starve.

Prompt tokens beside decodes (`mixed_prefill_tokens` C > 0, with
`decode_first`): a step that decodes at least one request computes at most C
prompt tokens (running prompts' chunks and newly admitted prompts
together); a step with nothing to decode gets the whole budget. A step's
time grows with its prompt tokens, and every decoding request waits for the
step, so C bounds the gap a prompt puts between two of their tokens without
capping how many sequences decode at once (a smaller
`max_num_batched_tokens` would cap both). A decode pod that prefills a
prompt itself (the router's idle side) runs with it: its running batch
stalls for C-token chunks, not for the whole prompt.

ITL budget (`itl_budget`, with `decode_first`; engine/itl_budget.py): a
step that decodes takes prompt tokens (running prompts' chunks, short and
newly admitted prompts) only while its predicted time stays within the
pod's inter-token budget; 0 left means prompt work waits a step.

Prefixes in flight (engine/prefix_wait.py): a waiting request whose next
uncached prompt block a running request is computing now waits (no blocks,
no slot) until that block is committed to the prefix cache, instead of
computing it twice; requests that share no such prefix are admitted past
it in their usual order.

Async scheduling (docs/engine.md): step N+1 may be scheduled before step
N completes. A token a scheduled step will sample counts as an output
placeholder (`Request.num_output_placeholders`), so step N+1 plans the
request's next token before it is known; a request whose tokens in flight
already end it (prefill-only, max_tokens) is not scheduled again. Every
step has an id; `update_computed` marks it completed. Blocks of a request
finished or preempted while a step that includes it is still in flight are
**deferred**: they return to the pool only once that step completed, so
nothing else (a new request, a remote reservation the injector writes) gets
a block the in-flight step still writes. A request whose new blocks would
only fit with deferred blocks waits one step instead of preempting others.

Only the engine loop thread calls this.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.block_manager import BlockManager
from engine.itl_budget import ItlBudget, PromptRoom
from engine.prefix_wait import DEFAULT_MAX_WAIT_S, PrefixWait
from engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from engine.config import EngineConfig


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """Tokens `[start, start + num_new_tokens)` of `request` are computed this
    step; `samples`: they reach the request's end, so the step samples its
    next token from the last row."""

    request: Request
    start: int
    num_new_tokens: int
    samples: bool

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    step_id: int
    scheduled: tuple[ScheduledRequest, ...]
    preempted_request_ids: tuple[str, ...]

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Decides which requests compute which tokens in the next step."""

    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int,
                 max_num_batched_tokens: int, decode_first: bool = True,
                 short_prefill_tokens: int = 0, mixed_prefill_tokens: int = 0,
                 itl_budget: ItlBudget | None = None,
                 prefix_wait_s: float = DEFAULT_MAX_WAIT_S) -> None:
        self.block_manager = block_manager
        self.prefix_wait = PrefixWait(block_manager, max_wait_s=prefix_wait_s)  # 0: off
        self.itl_budget = itl_budget  # None: off (module docstring, ITL budget)
        self.decode_first = decode_first
        self.short_prefill_tokens = short_prefill_tokens  # 0: off (module docstring)
        self.mixed_prefill_tokens = mixed_prefill_tokens  # 0: off (module docstring)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.reserved: dict[str, Request] = {}
        self.num_preemptions = 0  # cumulative, for stats and tests
        self.num_scheduled_steps = 0  # non-empty plans so far = the next step's id
        self.last_completed_step_id = -1
        # (step id, block ids) of requests freed while that step was in
        # flight: released when the step completes.
        self._deferred: list[tuple[int, list[int]]] = []

    @classmethod
    def from_config(cls, block_manager: BlockManager, config: EngineConfig,
                    itl_budget: ItlBudget | None) -> Scheduler:
        """The engine's scheduler, its policy from the pod's `EngineConfig`."""
        return cls(block_manager, max_num_seqs=config.max_num_seqs,
                   max_num_batched_tokens=config.max_num_batched_tokens,
                   decode_first=config.scheduling_policy == "decode-first",
                   short_prefill_tokens=config.short_prefill_tokens,
                   mixed_prefill_tokens=config.mixed_prefill_tokens,
                   itl_budget=itl_budget, prefix_wait_s=config.prefix_wait_s)

    @property
    def num_deferred_blocks(self) -> int:
        """Blocks that return to the pool when the steps in flight complete."""
        return sum(len(block_ids) for _, block_ids in self._deferred)

    @property
    def has_prompt_work(self) -> bool:
        """Prompt tokens are waiting or still prefilling here."""
        return bool(self.waiting) or any(not _decoding(r) for r in self.running)

    @property
    def num_seqs(self) -> int:
        """Sequences holding a batch slot: running plus remote reservations."""
        return len(self.running) + len(self.reserved)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def add_reserved(self, request: Request) -> None:
        self.reserved[request.request_id] = request

    def commit_reserved(self, request: Request) -> None:
        """A remote request's KV is in: it decodes from the next step on."""
        del self.reserved[request.request_id]
        request.transition(RequestStatus.RUNNING)
        self.running.append(request)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        step_id = self.num_scheduled_steps
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        stalled = False  # someone waits for deferred blocks: admit nobody
        decoding, prefilling = self._running_groups()
        itl: PromptRoom | None = None  # the ITL budget's room for prompt rows; None: no limit
        self.prefix_wait.begin()
        for group in (decoding, prefilling):
            if group is prefilling and self.mixed_prefill_tokens and self.decode_first \
                    and scheduled:  # the decoding requests scheduled so far
                budget = min(budget, self.mixed_prefill_tokens)
            if group is prefilling and self.itl_budget is not None and self.decode_first:
                itl = self.itl_budget.room(scheduled)
            if group is prefilling and self.short_prefill_tokens and self.decode_first \
                    and not preempted and not stalled:
                budget = self._admit_short(budget, scheduled, step_id, itl)
            for request in group:
                if budget == 0:
                    break
                if request.status is not RequestStatus.RUNNING or request.ends_with_placeholders:
                    continue  # preempted earlier in this loop, or done once its step lands
                num_new = min(request.num_tokens_with_placeholders - request.num_computed_tokens,
                              budget)
                if itl is not None and group is prefilling:
                    num_new = itl.take(request.num_computed_tokens, num_new)
                    if num_new == 0:
                        break
                room = self._make_room(request, num_new, scheduled, preempted)
                if room is None:
                    stalled = True
                    continue
                if not room:
                    break
                scheduled.append(self._take(request, num_new, step_id))
                budget -= num_new
            else:
                continue
            break  # the budget ran out, or a request had to make room by going itself
        if not preempted and not stalled:
            budget = self._admit_waiting(budget, scheduled, step_id, itl)
        if itl is not None and itl.cut:
            self.itl_budget.count_capped()
        if scheduled:  # an empty plan is never run: its id goes to the next one
            self.num_scheduled_steps += 1
        return SchedulerOutput(step_id, tuple(scheduled), tuple(preempted))

    def _running_groups(self) -> tuple[list[Request], list[Request]]:
        """Running requests in the order they get the budget, as two groups:
        with `decode_first`, decoding ones (one token left) before those
        still prefilling, so a long prompt's chunks never delay a decode
        token; oldest first within each group. Without it, all in one
        group, oldest first."""
        if not self.decode_first:
            return list(self.running), []
        decoding, prefilling = [], []
        for r in self.running:
            (decoding if _decoding(r) else prefilling).append(r)
        return decoding, prefilling

    def _admit_short(self, budget: int, scheduled: list[ScheduledRequest], step_id: int,
                     itl: PromptRoom | None) -> int:
        """Admit waiting requests with at most `short_prefill_tokens` left to
        compute, in queue order, within half the step's budget (the module
        docstring, Short prompts first)."""
        room = min(budget, self.max_num_batched_tokens // 2)
        bm = self.block_manager
        for request in list(self.waiting):
            if room == 0 or self.num_seqs >= self.max_num_seqs:
                break
            if request.num_output_placeholders:
                continue  # its token in flight lands first (see _admit_waiting)
            if self.prefix_wait.defers(request, self.running):
                continue
            cached = 0 if request.block_ids else bm.num_cached_prefix_tokens(request)
            num_new = request.num_tokens - request.num_computed_tokens - cached
            if num_new > min(self.short_prefill_tokens, room):
                continue
            if not request.block_ids:
                self._map_prefix(request)
                num_new = request.num_tokens - request.num_computed_tokens
            if num_new > room or not bm.can_allocate(request, num_new) or (
                    itl is not None and not itl.take(request.num_computed_tokens, num_new,
                                                     whole=True)):
                bm.free(request)  # drop the prefix hit; it waits its turn
                continue
            self.waiting.remove(request)
            self._start(request, num_new, scheduled, step_id)
            room -= num_new
            budget -= num_new
        return budget

    def _make_room(self, request: Request, num_new: int, scheduled: list[ScheduledRequest],
                   preempted: list[str]) -> bool | None:
        """Preempt the newest running requests not yet scheduled this step until
        `request`'s new blocks fit; False if `request` itself had to go. None:
        they fit once the deferred blocks of the steps in flight are back, so
        `request` waits a step rather than preempting anyone (more)."""
        taken = {id(s.request) for s in scheduled}
        bm = self.block_manager
        while not bm.can_allocate(request, num_new):
            if (self._deferred and bm.num_blocks_needed(request, num_new)
                    <= bm.num_free_blocks + self.num_deferred_blocks):
                return None
            victim = next(r for r in reversed(self.running) if id(r) not in taken)
            self.running.remove(victim)
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledRequest], step_id: int,
                       itl: PromptRoom | None = None) -> int:
        while self.waiting and budget > 0 and self.num_seqs < self.max_num_seqs:
            request = self._next_admissible()
            if request is None:
                break
            # A preempted request's token in flight lands before it is resumed:
            # preemption stops admission for the step that preempts.
            assert request.num_output_placeholders == 0, request.request_id
            if not request.block_ids:
                self._map_prefix(request)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if itl is not None:
                num_new = itl.take(request.num_computed_tokens, num_new)
            if num_new == 0 or not self.block_manager.can_allocate(request, num_new):
                self.block_manager.free(request)  # drop the prefix hit; retried next step
                break
            self.waiting.remove(request)
            self._start(request, num_new, scheduled, step_id)
            budget -= num_new
        return budget

    def _next_admissible(self) -> Request | None:
        """The first waiting request not waiting for a prefix in flight."""
        for request in self.waiting:
            if not self.prefix_wait.defers(request, self.running):
                return request
        return None

    def _map_prefix(self, request: Request) -> None:
        """Map a waiting request's cached prefix in (its first admission
        records the hit)."""
        num_cached = self.block_manager.match_prefix(request)
        if not request.was_scheduled:
            request.num_cached_tokens = num_cached

    def _start(self, request: Request, num_new: int, scheduled: list[ScheduledRequest],
               step_id: int) -> None:
        """A request taken off the waiting queue runs its first `num_new` tokens."""
        request.transition(RequestStatus.RUNNING)
        self.running.append(request)
        scheduled.append(self._take(request, num_new, step_id))

    def _take(self, request: Request, num_new: int, step_id: int) -> ScheduledRequest:
        """Allocate and count the tokens as computed now, so the next step can
        be planned while this one is in flight; a step that reaches the end
        adds an output placeholder for the token it samples."""
        self.block_manager.allocate(request, num_new)
        if not request.was_scheduled:
            request.first_scheduled_at = time.monotonic()
        request.was_scheduled = True
        start = request.num_computed_tokens
        request.num_computed_tokens = start + num_new
        request.last_step_id = step_id
        samples = request.num_computed_tokens == request.num_tokens_with_placeholders
        if samples:
            request.num_output_placeholders += 1
        return ScheduledRequest(request, start, num_new, samples)

    def _preempt(self, request: Request) -> None:
        self.num_preemptions += 1
        request.num_preemptions += 1
        self._free(request)
        request.transition(RequestStatus.PREEMPTED)
        self.waiting.appendleft(request)

    def _free(self, request: Request) -> None:
        """Give back the request's blocks now, or when its newest step in flight completes."""
        block_ids = self.block_manager.detach(request)
        if request.last_step_id > self.last_completed_step_id:
            self._deferred.append((request.last_step_id, block_ids))
        else:
            self.block_manager.release(block_ids)

    def update_computed(self, output: SchedulerOutput) -> None:
        """After the forward pass of `output`'s step (steps complete in the
        order they were scheduled): its KV is in the cache. Enters the
        requests' newly full blocks into the prefix cache and releases the
        blocks deferred until this step completed."""
        assert output.step_id > self.last_completed_step_id
        self.last_completed_step_id = output.step_id
        for s in output.scheduled:
            # A request finished or preempted since holds other (or no) blocks.
            if s.request.status is RequestStatus.RUNNING:
                self.block_manager.cache_computed_blocks(s.request, s.end)
        for step_id, block_ids in self._deferred:
            if step_id <= output.step_id:
                self.block_manager.release(block_ids)
        self._deferred = [d for d in self._deferred if d[0] > output.step_id]

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request in any state: leave its queue, give back its blocks."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING_FOR_REMOTE_KV:
            del self.reserved[request.request_id]
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        request.transition(status)
        self._free(request)


def _decoding(request: Request) -> bool:
    """One token left to compute: the request decodes (its prompt is done)."""
    return request.num_tokens_with_placeholders - request.num_computed_tokens == 1
