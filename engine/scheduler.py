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

Only the engine loop thread calls this.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.request import Request, RequestStatus


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """Tokens `[start, start + num_new_tokens)` of `request` are computed this step."""

    request: Request
    start: int
    num_new_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledRequest, ...]
    preempted_request_ids: tuple[str, ...]

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Decides which requests compute which tokens in the next step."""

    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int,
                 max_num_batched_tokens: int, decode_first: bool = True) -> None:
        self.block_manager = block_manager
        self.decode_first = decode_first
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.reserved: dict[str, Request] = {}
        self.num_preemptions = 0  # cumulative, for stats and tests

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
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        for request in self._running_order():
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._make_room(request, num_new, scheduled, preempted):
                break
            scheduled.append(self._take(request, num_new))
            budget -= num_new
        if not preempted:
            budget = self._admit_waiting(budget, scheduled)
        return SchedulerOutput(tuple(scheduled), tuple(preempted))

    def _running_order(self) -> list[Request]:
        """Running requests in the order they get the budget: with
        `decode_first`, decoding ones (one token left) before those still
        prefilling, so a long prompt's chunks never delay a decode token;
        oldest first within each group."""
        if not self.decode_first:
            return list(self.running)
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed_tokens != 1]
        return decoding + prefilling

    def _make_room(self, request: Request, num_new: int, scheduled: list[ScheduledRequest],
                   preempted: list[str]) -> bool:
        """Preempt the newest running requests not yet scheduled this step until
        `request`'s new blocks fit; False if `request` itself had to go."""
        taken = {id(s.request) for s in scheduled}
        while not self.block_manager.can_allocate(request, num_new):
            victim = next(r for r in reversed(self.running) if id(r) not in taken)
            self.running.remove(victim)
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledRequest]) -> int:
        while self.waiting and budget > 0 and self.num_seqs < self.max_num_seqs:
            request = self.waiting[0]
            if not request.block_ids:
                num_cached = self.block_manager.match_prefix(request)
                if not request.was_scheduled:
                    request.num_cached_tokens = num_cached
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.block_manager.can_allocate(request, num_new):
                self.block_manager.free(request)  # drop the prefix hit; retried next step
                break
            self.waiting.popleft()
            request.transition(RequestStatus.RUNNING)
            self.running.append(request)
            scheduled.append(self._take(request, num_new))
            budget -= num_new
        return budget

    def _take(self, request: Request, num_new: int) -> ScheduledRequest:
        self.block_manager.allocate(request, num_new)
        request.was_scheduled = True
        return ScheduledRequest(request, request.num_computed_tokens, num_new)

    def _preempt(self, request: Request) -> None:
        self.num_preemptions += 1
        self.block_manager.free(request)
        request.transition(RequestStatus.PREEMPTED)
        self.waiting.appendleft(request)

    def update_computed(self, output: SchedulerOutput) -> None:
        """After the forward pass: the scheduled tokens' KV is in the cache."""
        for s in output.scheduled:
            s.request.num_computed_tokens = s.end
            self.block_manager.cache_computed_blocks(s.request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request in any state: leave its queue, give back its blocks."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING_FOR_REMOTE_KV:
            del self.reserved[request.request_id]
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        request.transition(status)
        self.block_manager.free(request)
