"""`PrefixWait`: a waiting request whose prompt prefix another request is
computing right now waits for those blocks instead of computing them twice.

Used by `engine.scheduler.Scheduler` when it admits waiting requests (the
same scheduler runs on prefill, colocated and decode pods). A conversation's
next turn, or several requests with one system prompt, often arrive while
the first request with that prefix is still prefilling: its blocks are not
in the prefix cache yet, so without this rule the second request computes
them again beside it (twice the prompt work for the step, and no hit).

The rule (simple and safe): a waiting request that holds no blocks is
deferred when the first block of its prompt beyond what the prefix cache
holds now is a block a running request that has already been scheduled is
computing (the same block hash at the same index: the hash chains the whole
prefix, so equal hashes mean equal prefixes) and has not yet entered into
the cache. That request computes the block within its next steps, sooner
than a request not yet admitted could. The deferred request holds no
blocks and no batch slot, and is skipped in admission, so requests behind
it that share no such prefix are admitted in their usual order. It waits
until:

* the blocks are committed (the prefix cache then holds them: it is
  admitted with them as cache hits and computes only its tail);
* the running request is aborted, preempted or fails (it is no longer
  running, so nothing is in flight: it proceeds and computes what is not
  cached); or
* `max_wait_s` passed since its first deferral (a bound, never a
  deadlock: it then proceeds like any other request).

Only the engine loop thread calls this.
"""

from __future__ import annotations

import time

from engine.block_manager import BlockManager
from engine.prefix_cache import extend_block_hashes
from engine.request import Request, RequestStatus

DEFAULT_MAX_WAIT_S = 5.0


class PrefixWait:
    """Which waiting requests wait for a prefix in flight, for one schedule
    call (`begin` each step), plus the count of requests that ever waited."""

    __slots__ = ("block_manager", "max_wait_s", "num_waits", "_in_flight")

    def __init__(self, block_manager: BlockManager, *,
                 max_wait_s: float = DEFAULT_MAX_WAIT_S) -> None:
        if max_wait_s < 0:
            raise ValueError(f"prefix wait max_wait_s must be >= 0 (0: off); got {max_wait_s}")
        self.block_manager = block_manager
        self.max_wait_s = max_wait_s
        self.num_waits = 0  # requests deferred at least once (cumulative, for /metrics)
        self._in_flight: set[tuple[int, int]] | None = None  # (index, hash), built lazily

    def begin(self) -> None:
        """A new schedule call: forget the last step's blocks in flight."""
        self._in_flight = None

    def defers(self, request: Request, running: list[Request]) -> bool:
        """Whether `request` (waiting) should wait this step for blocks of its
        prefix that a request in `running` is computing."""
        bm = self.block_manager
        if (not self.max_wait_s or request.block_ids or not bm.prefix_cache.enabled
                or request.sampling_params.prompt_logprobs is not None):
            return False
        if request.prefix_wait_since is not None and (
                time.monotonic() - request.prefix_wait_since >= self.max_wait_s):
            return False
        cached = bm.num_cached_prefix_tokens(request) // bm.block_size  # extends its hashes
        max_blocks = (request.num_tokens - 1) // bm.block_size
        if cached >= max_blocks:
            return False
        if (cached, request.block_hashes[cached]) not in self._blocks_in_flight(running):
            return False
        if request.prefix_wait_since is None:
            request.prefix_wait_since = time.monotonic()
            self.num_waits += 1
        return True

    def _blocks_in_flight(self, running: list[Request]) -> set[tuple[int, int]]:
        """(index, hash) of every full block a running, already scheduled
        request computes or will compute and has not entered into the cache."""
        if self._in_flight is None:
            size = self.block_manager.block_size
            self._in_flight = set()
            for r in running:
                if r.status is not RequestStatus.RUNNING or not r.was_scheduled:
                    continue
                extend_block_hashes(r.block_hashes, r.all_token_ids, size)
                for i in range(r.num_cached_blocks, len(r.block_hashes)):
                    self._in_flight.add((i, r.block_hashes[i]))
        return self._in_flight
