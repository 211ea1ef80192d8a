"""Who sends which KV heads to whom between a prefill pod at TP=a and a decode pod at TP=b.

Each prefill rank holds the KV heads `kv_head_range(H, rank, a)` of the
request's cache, each decode rank needs `kv_head_range(H, rank, b)`
(engine/parallel/shard.py, restated below: contiguous ranges; a size above
H replicates each head on size / H ranks). The plan moves every head a decode rank needs
exactly once into that rank:

* from the LOWEST prefill rank holding it: a head the prefill side
  replicates is sent by one rank only, so nothing arrives twice;
* to EVERY decode rank holding it: a head the decode side replicates is
  sent once per decode rank (each rank injects only its own cache shard);
* consecutive heads from one prefill rank to one decode rank merge into one
  `SubTransfer`, so each pair exchanges one contiguous head range.

The plan is sorted by (decode_rank, head_start). Pure functions: both pods
compute the same plan from (H, a, b), nothing about it travels on the wire
except each sender's own range (BEGIN's `sub_start`/`sub_end`) and the number
of senders a decode rank waits for (`num_senders` = len(senders_of(plan, d))).
"""

from __future__ import annotations

from dataclasses import dataclass


def kv_head_range(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of the KV heads rank `rank` of `size` holds: the rule of
    `engine.parallel.shard.kv_head_range`, restated here because kv_transfer
    imports only proto and torch (docs/architecture.md); a test checks that the
    two agree."""
    if size <= num_kv_heads:
        per_rank = num_kv_heads // size
        return rank * per_rank, (rank + 1) * per_rank
    head = rank * num_kv_heads // size
    return head, head + 1


@dataclass(frozen=True, slots=True)
class SubTransfer:
    """Prefill rank `prefill_rank` sends global KV heads [head_start, head_end)
    to decode rank `decode_rank`."""

    prefill_rank: int
    decode_rank: int
    head_start: int  # global KV head index, inclusive
    head_end: int  # exclusive

    def __post_init__(self) -> None:
        if self.prefill_rank < 0 or self.decode_rank < 0:
            raise ValueError(f"ranks must be >= 0, got prefill {self.prefill_rank}, "
                             f"decode {self.decode_rank}")
        if not 0 <= self.head_start < self.head_end:
            raise ValueError(f"head range [{self.head_start}, {self.head_end}) is empty "
                             "or negative")

    @property
    def num_heads(self) -> int:
        return self.head_end - self.head_start


def _check_size(num_kv_heads: int, size: int, side: str) -> None:
    """ValueError unless `size` ranks can hold `num_kv_heads` heads (the rule of
    engine.parallel.shard.check_shardable for KV heads)."""
    if size < 1 or num_kv_heads < 1:
        raise ValueError(f"{side} TP size {size} and KV heads {num_kv_heads} must be >= 1")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(f"{side} TP size {size} cannot hold {num_kv_heads} KV heads: "
                         "neither divides the other")


def send_plan(num_kv_heads: int, prefill_tp: int, decode_tp: int) -> tuple[SubTransfer, ...]:
    """The SubTransfers moving a request's KV from a TP=`prefill_tp` prefill pod
    to a TP=`decode_tp` decode pod (the rules in the module docstring)."""
    _check_size(num_kv_heads, prefill_tp, "prefill")
    _check_size(num_kv_heads, decode_tp, "decode")
    # owner[h]: the lowest prefill rank holding head h (ranks ascend, so the first wins)
    owner: dict[int, int] = {}
    for rank in range(prefill_tp):
        start, end = kv_head_range(num_kv_heads, rank, prefill_tp)
        for head in range(start, end):
            owner.setdefault(head, rank)
    plan: list[SubTransfer] = []
    for decode_rank in range(decode_tp):
        start, end = kv_head_range(num_kv_heads, decode_rank, decode_tp)
        run_start = start
        for head in range(start + 1, end + 1):
            if head == end or owner[head] != owner[run_start]:
                plan.append(SubTransfer(owner[run_start], decode_rank, run_start, head))
                run_start = head
    return tuple(plan)


def senders_of(plan: tuple[SubTransfer, ...], decode_rank: int) -> tuple[SubTransfer, ...]:
    """What decode rank `decode_rank` receives, by head_start (one per sending rank)."""
    return tuple(s for s in plan if s.decode_rank == decode_rank)


def sends_of(plan: tuple[SubTransfer, ...], prefill_rank: int) -> tuple[SubTransfer, ...]:
    """What prefill rank `prefill_rank` sends, by (decode_rank, head_start)."""
    return tuple(s for s in plan if s.prefill_rank == prefill_rank)
