"""A `SimCluster` (sim/cluster.py) on its own event-loop thread, for tests.

    cluster = ClusterThread(tiny_model_dir, "--prefill", "1", "--decode", "1")
    address = cluster.addresses()["decode"][0]   # real gRPC on loopback
    cluster.drain([address]); cluster.kill([...]); cluster.stop()

The pods serve real gRPC on loopback ports, exactly as in `pdserve sim`;
running them in the test process (on their own thread) lets a test make
chosen pods drain or disappear and read their engines' state directly.
Flags are `pdserve sim`'s; `--model` and `--served-model-name tiny` are
given here.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from pdserve.commands import sim as sim_command
from sim.cluster import SimCluster
from sim.pods import SimPod

T = TypeVar("T")


class ClusterThread:
    def __init__(self, model_dir: str | Path, *flags: str) -> None:
        parser = argparse.ArgumentParser()
        sim_command.add_arguments(parser)
        args = parser.parse_args(["--model", str(model_dir), "--served-model-name", "tiny",
                                  *flags])
        config = sim_command.cluster_config_from_args(args)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sim-cluster",
                                        daemon=True)
        self._thread.start()
        self.cluster: SimCluster = self.run(self._start(config))

    @staticmethod
    async def _start(config: Any) -> SimCluster:
        cluster = SimCluster(config)
        await cluster.start()
        return cluster

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        """Run `coroutine` on the cluster's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def on_loop(self, fn: Callable[[], T], timeout: float = 10.0) -> T:
        """`fn()` on the cluster's loop (to read a pod's engine safely)."""
        async def call() -> T:
            return fn()
        return self.run(call(), timeout)

    def addresses(self) -> dict[str, list[str]]:
        return self.on_loop(self.cluster.addresses)

    def pod(self, address: str) -> SimPod:
        return self.cluster.pod(address)

    def drain(self, addresses: list[str]) -> None:
        self.run(self.cluster.drain(addresses))

    def kill(self, addresses: list[str]) -> None:
        self.run(self.cluster.kill(addresses))

    def stop(self) -> int:
        try:
            return self.run(self.cluster.stop(), timeout=120)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
