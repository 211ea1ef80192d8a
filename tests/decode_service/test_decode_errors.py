"""`decode_service.servicer.decode_errors`: the pod table plus a full landing pool."""

from __future__ import annotations

import grpc

from decode_service.servicer import decode_errors
from engine.engine_loop import EngineDead
from kv_transfer.errors import BufferPoolExhausted


def test_decode_pod_adds_a_full_landing_pool():
    exc = BufferPoolExhausted("landing pool full")
    assert decode_errors.status_for(exc)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert decode_errors.status_for(EngineDead("x"))[0] == grpc.StatusCode.UNAVAILABLE
