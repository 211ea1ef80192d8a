"""`pod.errors`: the status codes every pod servicer answers, whatever else
was imported."""

from __future__ import annotations

import grpc

from engine.engine_loop import EngineDead
from engine.errors import CapacityError
from pod.errors import pod_errors


def test_pod_errors_map_capacity_and_a_dead_engine():
    assert pod_errors.status_for(CapacityError("no free blocks")) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED, "no free blocks")
    assert pod_errors.status_for(EngineDead("engine loop stopped")) == (
        grpc.StatusCode.UNAVAILABLE, "engine loop stopped")
    assert pod_errors.status_for(ValueError("bad"))[0] == grpc.StatusCode.INVALID_ARGUMENT
