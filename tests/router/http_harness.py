"""An in-process router (RouterServer on loopback ports) over in-process fake
pods, for the HTTP and gRPC front-door unit tests. The proof tests with real
pod processes are tests/router/test_http_openai.py and test_failover.py."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from router.config import RouterConfig
from router.server import RouterServer
from tests.router.inprocess_pods import Behaviour, FakePod, Wire


@contextlib.asynccontextmanager
async def fake_cluster(
    model_dir: Path,
    roles: dict[str, list[Behaviour]],
    **config,
) -> AsyncIterator[tuple[RouterServer, dict[str, list[FakePod]]]]:
    """Start fake pods (one per Behaviour, per role) and a router over them."""
    wire = Wire()
    pods: dict[str, list[FakePod]] = {}
    for role, behaviours in roles.items():
        pods[role] = []
        for behaviour in behaviours:
            pod = FakePod(role, wire, behaviour)
            await pod.start()
            pods[role].append(pod)
    addresses = {role: tuple(p.address for p in ps) for role, ps in pods.items()}
    server = RouterServer(RouterConfig(
        model_dir=str(model_dir), served_model_name="tiny", host="127.0.0.1", port=0,
        grpc_port=0, load_poll_interval=0.05, shutdown_grace=1.0, **addresses, **config))
    await server.start()
    try:
        yield server, pods
    finally:
        await server.stop()
        for ps in pods.values():
            for pod in ps:
                await pod.stop()
