"""The control messages between rank 0 of a decode pod at TP=b and its worker
ranks (engine/parallel/control.py carries them: a u16 kind, a JSON object of
primitives, raw bytes). Rank 0's side is decode_service/rank_links.py, a
worker's decode_service/rank_kv.py.

    kind       from    fields (+ payload)
    SETUP      rank 0  receiver: the ReceiverConfig's fields (secret as hex, the
                       pod's: every rank issues rank 0's tickets), transport
    READY      worker  endpoints, head_start, head_end: its receiver listens
    EXPECT     rank 0  request_id, layout (`layout_fields`), deadline,
                       transfer_timeout_s (+ the slot mapping, int64 native)
    EXPECTING  worker  request_id: its receiver and injector expect R (rank 0
                       hands R's target out only after every EXPECTING, so no
                       sender reaches a rank that does not know R yet)
    LANDED     worker  request_id, first_token_id: every layer of its heads is
                       in its cache shard (copies done) and END accepted
    FAILED     worker  request_id, reason (kv_transfer's reason string)
    FORGET     rank 0  request_id: cancel, let the injector go, free the landing
    FORGOTTEN  worker  request_id: it will never write R's slots again

Every request rank 0 sent EXPECT for gets EXPECTING then LANDED or FAILED,
or FAILED alone (it could not expect R), and every FORGET one FORGOTTEN.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from kv_transfer.base import KVLayout
from kv_transfer.config import ReceiverConfig
from proto.tls import PodSecurity, TlsFiles


class RankKind(enum.IntEnum):
    SETUP = 1
    READY = 2
    EXPECT = 3
    LANDED = 4
    FAILED = 5
    FORGET = 6
    FORGOTTEN = 7
    EXPECTING = 8


def layout_fields(layout: KVLayout) -> dict[str, Any]:
    """A layout as JSON primitives (every field, by name)."""
    return dataclasses.asdict(layout)


def layout_of(fields: dict[str, Any]) -> KVLayout:
    return KVLayout(**fields)


def rank_layout(layout: KVLayout, head_start: int, head_end: int) -> KVLayout:
    """A decode rank's part of a whole-model `layout`: its heads, head-ranged
    (head-major, kv_transfer/base.py) so several prefill ranks can each
    write their heads of it."""
    return dataclasses.replace(layout, head_start=head_start, num_kv_heads=head_end - head_start,
                               model_kv_heads=layout.num_kv_heads)


def receiver_fields(config: ReceiverConfig) -> dict[str, Any]:
    """A receiver's settings for SETUP (the secret as hex)."""
    fields = dataclasses.asdict(config)
    fields["secret"] = None if config.secret is None else config.secret.hex()
    return fields


def receiver_config_of(fields: dict[str, Any]) -> ReceiverConfig:
    security = fields["security"]
    tls = security["tls"]
    return ReceiverConfig(**{
        **fields,
        "secret": None if fields["secret"] is None else bytes.fromhex(fields["secret"]),
        "security": PodSecurity(tls=None if tls is None else TlsFiles(**tls),
                                token=security["token"])})
