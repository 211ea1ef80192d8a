"""`pod_errors`: the exception -> gRPC status table of every pod servicer
(a `proto.status.StatusMap`, used as the methods' decorator). A service that
meets more typed errors extends it explicitly (the decode pod adds the KV
landing pool's capacity error), so the codes a pod answers never depend on
which modules happen to be imported.

    engine.errors.CapacityError   -> RESOURCE_EXHAUSTED (no room now; try another pod)
    engine_loop.EngineDead        -> UNAVAILABLE (the engine loop stopped; go elsewhere)
    ServiceError / ValueError / anything else: as in proto/status.py
"""

from __future__ import annotations

import grpc

from engine.engine_loop import EngineDead
from engine.errors import CapacityError
from proto.status import StatusMap

pod_errors = StatusMap((
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (EngineDead, grpc.StatusCode.UNAVAILABLE),
))
