"""Pushed load reports (issue 43) against a real decode pod process (tiny
model): its `WatchLoad` sends the report at once and heartbeats while idle,
and the router's pod pool, holding that stream, takes the pod out when the
process is killed (kill -9: the stream breaks, not a poll) and back in once a
pod serves on the same address again. tests/router/test_load_watch.py covers
the pool's rules against stand-in servicers; this is the real process."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from proto import pdserve_pb2, pdserve_pb2_grpc
from router.registry.poller import PodState, PolledPodPool
from router.registry.static import StaticPodSource
from tests.integration.pods import start_pod
from tests.router.test_registry import eventually

pytestmark = pytest.mark.timeout(240)


def _watch_for(address: str, seconds: float) -> list[pdserve_pb2.LoadReport]:
    """Every report one WatchLoad stream (heartbeat 0.2 s) sends within `seconds`."""
    reports: list[pdserve_pb2.LoadReport] = []
    with grpc.insecure_channel(address) as channel:
        stream = pdserve_pb2_grpc.DecodeStub(channel).WatchLoad(
            pdserve_pb2.WatchLoadRequest(min_interval_s=0.02, max_interval_s=0.2),
            timeout=seconds)
        with pytest.raises(grpc.RpcError) as ended:
            for report in stream:
                reports.append(report)
        assert ended.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED  # it never ends itself
    return reports


def test_a_real_pods_stream_and_the_pool_across_a_kill_and_a_restart(tiny_model_dir,
                                                                     run_async) -> None:
    pods = [start_pod("decode", tiny_model_dir)]
    address = pods[0].address
    try:
        reports = _watch_for(address, 2.0)
        assert reports and (reports[0].role, reports[0].num_running) == ("decode", 0)
        assert len(reports) >= 3 and all(r == reports[0] for r in reports)  # heartbeats

        async def run() -> None:
            # polls only every 30 s: what happens before then is the stream's doing
            pool = PolledPodPool(StaticPodSource(decode=[address]), poll_interval=30,
                                 poll_timeout=5, heartbeat_interval=0.5, health_interval=60)
            await pool.start()
            try:
                pod_state = pool._pods[address]
                await eventually(lambda: pod_state.watch is not None and pod_state.watch.reports)
                pods[0].kill()
                await eventually(lambda: pool.state(address)[0] is PodState.UNHEALTHY)
                # the broken stream made the pool poll at once (polls are 30 s apart)
                assert "poll failed (1 in a row)" in pool.state(address)[1]
                assert pool.pods("decode") == []
                pods.append(await asyncio.to_thread(start_pod, "decode", tiny_model_dir,
                                                    port=pods[0].grpc_port))
                # the next rounds: a good poll (once the channel's reconnect backoff
                # from the refused re-poll has passed) opens a new stream
                for _ in range(50):
                    await pool.poll_once()
                    if pool.pods("decode"):
                        break
                    await asyncio.sleep(0.2)
                assert [p.address for p in pool.pods("decode")] == [address]
                await eventually(lambda: pod_state.watch is not None and pod_state.watch.reports)
            finally:
                await pool.close()

        run_async(run(), timeout_s=180)
    finally:
        for pod in pods:
            pod.kill()
