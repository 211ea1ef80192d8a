"""`PrefixIndex`: which prefix blocks each pod caches, as its events said.

Fed by `router.cache_index.feed.CacheEventFeed` with the pods'
`CacheEventBatch` messages (pod/cache_events.py); read by the cache-aware
routing policy (router/routing/cache_aware.py) and the local-prefill rule
(`cached_prefix`, router/routing/local_prefill.py). Everything runs on the
router's event loop; no locks.

Per pod the index keeps its generation, block size, the last batch number
and the set of block hashes it said it stores:

* a snapshot batch replaces the set; an incremental one removes `evicted`
  and adds `stored` (a batch is already coalesced: a hash is in one list);
* a batch, or a poll (`observe_generation`), with another generation means
  the pod restarted: its entries are dropped before anything else;
* a gap in the batch numbers (missed batches: Redis pub/sub delivers at most
  once) is counted and otherwise ignored;
* `expect`: the cache-aware policy adds a prompt's blocks to the pod it just
  chose, before that pod has computed them, so the follow-ups of a
  conversation arriving within its prefill (or before its event) go there
  too; the pod's own events then confirm or evict them.

The index is a hint, never trusted for correctness: a stale entry sends a
request to a pod that then computes the prefix itself (a cache miss), a
missing one only forgoes a hit.

Memory bound: at most `max_blocks_per_pod` hashes per pod (the oldest stored
go first beyond it; a pod that reports every eviction never gets there when
the bound is at least its KV blocks), for pods the pool knows only (the feed
forgets the others). One hash costs about 100 bytes in a Python dict, so the
default 262,144 is about 26 MB per pod at most.

A prompt is hashed once per block size (`PromptBlocks`), with the engine's own
chained hash (proto/block_hash.py) over the same token ids the pod receives
(prompt + output so far), and only over the blocks a pod may reuse
(`reusable_blocks`: never the block of the last token).
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from proto import pdserve_pb2
from proto.block_hash import extend_block_hashes, reusable_blocks

DEFAULT_MAX_BLOCKS_PER_POD = 262_144


class PromptBlocks:
    """One request's context tokens and their block hashes, per block size,
    computed on first use."""

    __slots__ = ("token_ids", "_hashes")

    def __init__(self, token_ids: Sequence[int]) -> None:
        self.token_ids = token_ids
        self._hashes: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.token_ids)

    def hashes(self, block_size: int) -> list[int]:
        """Hashes of the blocks a pod of `block_size` may reuse, in order."""
        hashes = self._hashes.get(block_size)
        if hashes is None:
            hashes = self._hashes[block_size] = []
            extend_block_hashes(hashes, self.token_ids, block_size,
                                max_blocks=reusable_blocks(len(self.token_ids), block_size))
        return hashes


@dataclass(slots=True)
class _PodBlocks:
    generation: int
    block_size: int
    sequence: int = 0
    hashes: dict[int, None] = field(default_factory=dict)  # insertion order = age


class PrefixIndex:
    """Block hashes per pod address; see the module docstring."""

    def __init__(self, max_blocks_per_pod: int = DEFAULT_MAX_BLOCKS_PER_POD) -> None:
        if not 1 <= max_blocks_per_pod <= 1 << 26:
            raise ValueError(f"cache index blocks per pod must be in [1, {1 << 26}], "
                             f"got {max_blocks_per_pod}")
        self.max_blocks_per_pod = max_blocks_per_pod
        self._pods: dict[str, _PodBlocks] = {}
        self._holding: set[str] = set()  # pods with at least one block (`published`)
        self.missed_batches = 0  # gaps seen in batch numbers, summed over pods
        self.restarts = 0  # generation changes seen

    def apply(self, batch: pdserve_pb2.CacheEventBatch, address: str | None = None) -> None:
        """Take in one batch from the pod at `address` (default: the batch's own)."""
        address = address or batch.address
        if batch.block_size < 1:
            return  # not a batch any pod sends
        pod = self._pods.get(address)
        if pod is None or pod.generation != batch.generation:
            if pod is not None:
                self.restarts += 1
            pod = self._pods[address] = _PodBlocks(batch.generation, batch.block_size)
            self._holding.discard(address)
        hashes = pod.hashes
        if batch.snapshot:
            hashes.clear()
            pod.sequence = batch.sequence
        elif batch.sequence <= pod.sequence:
            return  # already applied (or older than the snapshot)
        else:
            if pod.sequence and batch.sequence > pod.sequence + 1:
                self.missed_batches += batch.sequence - pod.sequence - 1
            pod.sequence = batch.sequence
            for block_hash in batch.evicted:
                hashes.pop(block_hash, None)
        for block_hash in batch.stored:
            hashes.pop(block_hash, None)  # re-stored: now the youngest
            hashes[block_hash] = None
        excess = len(hashes) - self.max_blocks_per_pod
        if excess > 0:
            for block_hash in list(_take(hashes, excess)):
                del hashes[block_hash]
        if hashes:
            self._holding.add(address)
        else:
            self._holding.discard(address)

    def expect(self, address: str, prompt: PromptBlocks) -> None:
        """This router just sent `prompt` to the pod at `address`: count its
        reusable blocks as stored there now, before the pod's event says so,
        so a follow-up arriving within the prefill finds them (as if the
        event were already in). A pod never heard from is left alone; if the
        pod does not store them after all, the entries cost at most a miss
        and age out under the bound."""
        pod = self._pods.get(address)
        if pod is None:
            return
        hashes = pod.hashes
        for block_hash in prompt.hashes(pod.block_size):
            hashes.pop(block_hash, None)
            hashes[block_hash] = None
        excess = len(hashes) - self.max_blocks_per_pod
        if excess > 0:
            for block_hash in list(_take(hashes, excess)):
                del hashes[block_hash]
        if hashes:
            self._holding.add(address)

    def observe_generation(self, address: str, generation: int) -> None:
        """The pod's polled generation: entries of another generation go."""
        pod = self._pods.get(address)
        if pod is not None and pod.generation != generation:
            self.restarts += 1
            del self._pods[address]
            self._holding.discard(address)

    def forget(self, address: str) -> None:
        """The pod left the registry."""
        self._pods.pop(address, None)
        self._holding.discard(address)

    def addresses(self) -> list[str]:
        return list(self._pods)

    def published(self) -> AbstractSet[str]:
        """The pods the index holds at least one block of (a pod that
        subscribed but caches nothing, a decode pod without its prefix
        cache, is not one), kept as blocks come and go: read-only, no copy."""
        return self._holding

    def num_blocks(self, address: str | None = None) -> int:
        """Hashes held for `address` (all pods when None)."""
        if address is None:
            return sum(len(p.hashes) for p in self._pods.values())
        pod = self._pods.get(address)
        return 0 if pod is None else len(pod.hashes)

    def cached_tokens(self, address: str, prompt: PromptBlocks) -> int:
        """Leading tokens of `prompt` the pod at `address` would take from its
        cache, as far as its events tell (0 for a pod never heard from)."""
        pod = self._pods.get(address)
        if pod is None or not pod.hashes:
            return 0
        matched = 0
        for block_hash in prompt.hashes(pod.block_size):
            if block_hash not in pod.hashes:
                break
            matched += 1
        return matched * pod.block_size

    def holders(self, prompt: PromptBlocks,
                among: AbstractSet[str] | None = None) -> dict[str, int]:
        """`cached_tokens` of every pod (of `among`, when given: one role's)
        that holds at least the prompt's first block; every other pod would
        take none from its cache. One pass over the pods holding any block, a
        set lookup each: a placement reads this instead of asking each of
        hundreds of pods (router/routing/cache_aware.py, policy.py)."""
        found: dict[str, int] = {}
        firsts: dict[int, int | None] = {}  # block size -> the prompt's first block hash
        for address in self._holding if among is None else self._holding & among:
            pod = self._pods[address]
            if pod.block_size not in firsts:
                hashes = prompt.hashes(pod.block_size)
                firsts[pod.block_size] = hashes[0] if hashes else None
            first = firsts[pod.block_size]
            if first is not None and first in pod.hashes:
                found[address] = self.cached_tokens(address, prompt)
        return found

    def cached_prefix(self, address: str, token_ids: Sequence[int]) -> int:
        """`cached_tokens` for plain token ids: the `cached_prefix` hook of
        router/routing/local_prefill.py ("how many leading tokens of this
        prompt does decode pod X hold")."""
        return self.cached_tokens(address, PromptBlocks(token_ids))


def _take(hashes: dict[int, None], count: int):
    """The `count` oldest keys of `hashes`."""
    for i, block_hash in enumerate(hashes):
        if i == count:
            return
        yield block_hash
