"""`TransferTarget` <-> `pdserve.v1.KVTarget`: the one place the target is converted.

The decode pod builds the message from its receiver's target (`Reserved`),
the router carries it unchanged, the prefill pod reads it back. Per-rank
targets travel as `ranks` (one `KVRankTarget` per decode rank) and
`tensor_parallel_size`; a TP=1 pod leaves both empty, which is what older
pods send and read.
"""

from __future__ import annotations

from kv_transfer.target import RankTarget, TransferTarget
from proto import pdserve_pb2


def target_to_proto(target: TransferTarget, num_held_tokens: int = 0) -> pdserve_pb2.KVTarget:
    """The message for `Reserved.target`; `num_held_tokens` is the decode pod's
    cached prefix the prefill pod skips (a field of the message, not of the target)."""
    return pdserve_pb2.KVTarget(
        endpoints=list(target.endpoints), ticket=target.ticket, transport=target.transport,
        generation=target.generation, deadline_unix_ms=int(target.deadline * 1000),
        num_held_tokens=num_held_tokens,
        ranks=[pdserve_pb2.KVRankTarget(endpoints=list(r.endpoints), head_start=r.head_start,
                                        head_end=r.head_end) for r in target.ranks],
        tensor_parallel_size=target.tensor_parallel_size if target.ranks else 0,
    )  # fmt: skip


def target_from_proto(msg: pdserve_pb2.KVTarget) -> TransferTarget:
    """The target a prefill pod sends to; ValueError (from TransferTarget or
    RankTarget) names whatever field is malformed. An empty transport is TCP
    (the default connector)."""
    ranks = tuple(RankTarget(tuple(r.endpoints), r.head_start, r.head_end) for r in msg.ranks)
    return TransferTarget(
        endpoints=tuple(msg.endpoints), ticket=bytes(msg.ticket), transport=msg.transport or "tcp",
        generation=msg.generation, deadline=msg.deadline_unix_ms / 1000.0, ranks=ranks,
        tensor_parallel_size=msg.tensor_parallel_size or 1,
    )  # fmt: skip
