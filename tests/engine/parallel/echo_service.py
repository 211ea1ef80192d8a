"""A rank service for the control-channel tests, started by name in each
worker (`EngineConfig.rank_service = "tests.engine.parallel.echo_service:start"`).

It says READY at start, echoes ECHO messages (fields plus its rank, the
payload reversed), sleeps on SLOW, raises on FAIL, and records, at layer 0
of every step its hook sees, each span (request id, start, end, slots) with
the tags of the control messages applied before that forward; REPORT sends
the record back.
"""

from __future__ import annotations

import enum
import time
from typing import Any

import torch

from engine.kv_hook import LayerKVSpan


class Kind(enum.IntEnum):
    READY = 1
    ECHO = 2
    SLOW = 3
    FAIL = 4
    REPORT = 5


def span_record(span: LayerKVSpan) -> list:
    return [span.request_id, span.start, span.end, span.slot_mapping.tolist()]


class EchoService:
    def __init__(self, rank: int, num_blocks: int, control) -> None:
        self.rank = rank
        self.control = control
        self.applied: list[str] = []
        self.spans: list[list] = []
        self.layer_kv_hook = self
        control.send(Kind.READY, {"rank": rank, "num_blocks": num_blocks})

    def on_layer_kv(self, layer_idx: int, kv_cache_layer: torch.Tensor,
                    spans: tuple[LayerKVSpan, ...]) -> None:
        if layer_idx == 0:
            self.spans += [[*span_record(s), list(self.applied)] for s in spans]

    def on_control(self, kind: int, fields: dict[str, Any], payload: bytes) -> None:
        if kind == Kind.SLOW:
            time.sleep(fields["sleep_s"])
        elif kind == Kind.FAIL:
            raise RuntimeError("told to fail")
        self.applied.append(fields.get("tag", ""))
        if kind == Kind.ECHO:
            self.control.send(Kind.ECHO, {**fields, "rank": self.rank}, payload[::-1])
        elif kind == Kind.REPORT:
            self.control.send(Kind.REPORT, {"spans": self.spans})

    def close(self) -> None:
        pass


def start(spec, rank_model, group, control) -> EchoService:
    return EchoService(spec.rank, rank_model.num_blocks, control)
