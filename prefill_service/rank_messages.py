"""The control messages between a prefill pod's rank 0 and its worker ranks
(engine/parallel/control.py carries them: a kind, a JSON object of
primitives, raw bytes; never pickle).

    rank 0 -> worker
      SETUP   {num_streams, security}            once, before any step: how the
                                                 worker builds its KV senders
      EXPORT  {request_id, target, layout, attempts}
                                                 at `KVExport.register`, before the
                                                 engine sees R (the step that
                                                 computes R waits until it was applied)
      FINISH  {request_id, first_token_id}       R's first token: END on its senders
      ABORT   {request_id, reason}               stop sending R
      FORGET  {request_id}                       drop R (always, last)
      LIST    {}                                 which requests the worker still holds
    worker -> rank 0
      OUTCOME {request_id, ok, reason}           after FINISH, once every transfer of
                                                 this rank for R is decided (first
                                                 failure wins)
      OPEN    {request_ids}                      the answer to LIST

`target` is the request's whole `TransferTarget` (every decode rank's
endpoints and head range, the ticket in hex, the traceparent: "" =
untraced), `layout` the whole-model `KVLayout`, `attempts` the attempt id
(hex) of each decode rank's transfer: each worker derives its own sends with
`rank_sends`, as rank 0 does.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from kv_transfer.base import KVLayout, RankTarget, TransferTarget
from proto.tls import PodSecurity, TlsFiles


class Kind(enum.IntEnum):
    SETUP = 1
    EXPORT = 2
    FINISH = 3
    ABORT = 4
    FORGET = 5
    LIST = 6
    OUTCOME = 7
    OPEN = 8


_LAYOUT_FIELDS = ("num_layers", "num_tokens", "num_kv_heads", "head_dim", "dtype",
                  "token_offset")


def setup_fields(num_streams: int, security: PodSecurity) -> dict[str, Any]:
    tls = None if security.tls is None else dataclasses.asdict(security.tls)
    return {"num_streams": num_streams, "security": {"tls": tls, "token": security.token}}


def security_from(fields: dict[str, Any]) -> PodSecurity:
    tls = fields["tls"]
    return PodSecurity(tls=None if tls is None else TlsFiles(**tls), token=fields["token"])


def export_fields(request_id: str, target: TransferTarget, layout: KVLayout,
                  attempts: tuple[bytes, ...]) -> dict[str, Any]:
    """EXPORT's fields. `layout` must be the whole-model one (not head-ranged)."""
    return {
        "request_id": request_id,
        "target": {
            "endpoints": list(target.endpoints), "ticket": target.ticket.hex(),
            "transport": target.transport, "generation": target.generation,
            "deadline": target.deadline, "tensor_parallel_size": target.tensor_parallel_size,
            "ranks": [[list(r.endpoints), r.head_start, r.head_end] for r in target.ranks],
            "traceparent": target.traceparent,  # each worker's BEGINs carry it too
        },
        "layout": {name: getattr(layout, name) for name in _LAYOUT_FIELDS},
        "attempts": [attempt.hex() for attempt in attempts],
    }


def parse_export(fields: dict[str, Any]) -> tuple[str, TransferTarget, KVLayout,
                                                  tuple[bytes, ...]]:
    """EXPORT's fields back; ValueError (from the dataclasses) for bad values."""
    t = fields["target"]
    target = TransferTarget(
        endpoints=tuple(t["endpoints"]), ticket=bytes.fromhex(t["ticket"]),
        transport=t["transport"], generation=t["generation"], deadline=t["deadline"],
        ranks=tuple(RankTarget(tuple(endpoints), start, end)
                    for endpoints, start, end in t["ranks"]),
        tensor_parallel_size=t["tensor_parallel_size"], traceparent=t.get("traceparent", ""))
    layout = KVLayout(**fields["layout"])
    attempts = tuple(bytes.fromhex(a) for a in fields["attempts"])
    return fields["request_id"], target, layout, attempts
