"""What one prefill rank sends of one request: its `RankSend`s, one per
decode rank it writes to, from the pod-wide send plan
(`kv_transfer.tp_plan.send_plan`, docs/tensor_parallel.md, "Prefill ranks").

A prefill pod at TP=a holds each KV head on the ranks `kv_head_range`
gives; a decode pod at TP=b (b = len(target.ranks), 1 when the target has
no ranks) lands each of its ranks' heads from the plan's SubTransfers. A
prefill rank p sends `sends_of(plan, p)`: for SubTransfer s to decode rank
d, the layout is decode rank d's (its heads, head-ranged) and this sender
writes heads [s.head_start, s.head_end) of it, sharing the attempt id that
prefill rank 0 picked for d with every other sender of d.

At a = b = 1 the one send is today's TP=1 transfer, byte for byte: the
request's layout, the target as given, no head range, a fresh attempt id.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from engine.parallel.shard import kv_head_range
from kv_transfer.base import KVLayout, TransferTarget
from kv_transfer.tp_plan import send_plan, senders_of, sends_of

ATTEMPT_BYTES = 8  # as the senders' own random attempt ids (kv_transfer/outgoing.py)


@dataclass(frozen=True, slots=True)
class RankSend:
    """One transfer this prefill rank makes for a request.

    `target` and `layout` are the decode rank's; `heads` is None for a
    whole-layout TP=1 transfer, else `(sub_start, sub_end)` in the layout's
    own head indices; `local_heads` is the same heads' `[start, end)` in this
    rank's cache shard (what `extract_kv` returns), so the hook slices
    `kv[:, :, start:end]`."""

    decode_rank: int
    target: TransferTarget
    layout: KVLayout
    heads: tuple[int, int] | None
    local_heads: tuple[int, int]
    attempt: bytes | None
    num_senders: int

    def __post_init__(self) -> None:
        if self.heads is not None and not 0 <= self.heads[0] < self.heads[1] <= \
                self.layout.num_kv_heads:
            raise ValueError(f"send heads {self.heads} must be a non-empty range inside the "
                             f"layout's {self.layout.num_kv_heads} KV heads")
        if self.heads is not None and self.attempt is None:
            raise ValueError("a head-ranged send needs the attempt id rank 0 picked")


def decode_tp(target: TransferTarget) -> int:
    """The decode pod's TP size as the target gives it (no ranks: TP=1)."""
    return target.num_ranks


def head_ranged(prefill_tp: int, target: TransferTarget) -> bool:
    """Whether this request's transfers carry head ranges: whenever either
    pod is sharded (a TP=1 pair keeps today's wire byte for byte)."""
    return prefill_tp > 1 or decode_tp(target) > 1


def new_attempts(target: TransferTarget) -> tuple[bytes, ...]:
    """One attempt id per decode rank, picked by prefill rank 0: all senders
    of one decode rank's layout are one attempt with several peers."""
    return tuple(os.urandom(ATTEMPT_BYTES) for _ in range(decode_tp(target)))


def rank_sends(target: TransferTarget, layout: KVLayout, prefill_rank: int, prefill_tp: int,
               attempts: tuple[bytes, ...]) -> tuple[RankSend, ...]:
    """`prefill_rank`'s sends of one request whose whole-model layout is
    `layout` (all `H` KV heads). Empty for a rank whose heads another rank
    sends (a replicated head goes from the lowest rank holding it)."""
    if not head_ranged(prefill_tp, target):
        whole = (0, layout.num_kv_heads)
        return (RankSend(0, target, layout, None, whole, None, 1),)
    num_heads, b = layout.num_kv_heads, decode_tp(target)
    if len(attempts) != b:
        raise ValueError(f"{len(attempts)} attempt ids for a decode pod of {b} ranks")
    check_rank_ranges(target, num_heads)
    plan = send_plan(num_heads, prefill_tp, b)
    mine = kv_head_range(num_heads, prefill_rank, prefill_tp)[0]
    sends = []
    for sub in sends_of(plan, prefill_rank):
        d = sub.decode_rank
        start, end = kv_head_range(num_heads, d, b)
        sends.append(RankSend(
            d, target.for_rank(d), layout.head_share(start, end),
            (sub.head_start - start, sub.head_end - start),
            (sub.head_start - mine, sub.head_end - mine), attempts[d],
            len(senders_of(plan, d))))
    return tuple(sends)


def check_rank_ranges(target: TransferTarget, num_kv_heads: int) -> None:
    """ValueError unless each decode rank's head range in the target is the
    one `kv_head_range` gives (both pods shard by the same rule; a decode pod
    that does not would land heads in the wrong places)."""
    b = decode_tp(target)
    for d, rank in enumerate(target.ranks):
        expected = kv_head_range(num_kv_heads, d, b)
        if (rank.head_start, rank.head_end) != expected:
            raise ValueError(
                f"target rank {d} of {b} holds KV heads [{rank.head_start}, {rank.head_end}); "
                f"this prefill pod shards the model's {num_kv_heads} KV heads as "
                f"[{expected[0]}, {expected[1]}) for it")


def sending_ranks(num_kv_heads: int, prefill_tp: int, target: TransferTarget) -> tuple[int, ...]:
    """The prefill ranks with something to send for this target, in order."""
    if not head_ranged(prefill_tp, target):
        return (0,)
    plan = send_plan(num_kv_heads, prefill_tp, decode_tp(target))
    return tuple(sorted({sub.prefill_rank for sub in plan}))


def bytes_moved(layout: KVLayout, target: TransferTarget) -> int:
    """Bytes the whole prefill pod sends for a request (whole-model
    `layout`): each head once per decode rank holding it, so the layout's
    bytes unless the decode pod replicates heads (b > H: each of its b ranks
    gets one head). The prefill pod's TP size changes nothing."""
    heads = layout.num_kv_heads
    return layout.total_bytes // heads * max(heads, decode_tp(target))
