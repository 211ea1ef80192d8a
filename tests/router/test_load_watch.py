"""Pushed load reports (issue 43): the pod pool keeps one `WatchLoad` stream
per pod (router/registry/load_watch.py) instead of polling, and falls back
to polling where the stream is missing, ended or silent. Against real gRPC
servers on loopback (tests/router/test_registry.py's `LoadServer`), and
pod/load.py's `watch_load` against a real engine loop's stand-in stats."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pod.load import DEFAULT_MAX_INTERVAL_S, DEFAULT_MIN_INTERVAL_S, watch_intervals, watch_load
from proto import pdserve_pb2
from router.registry.poller import PodState, PolledPodPool
from router.registry.static import StaticPodSource
from tests.router.test_registry import POLL_TIMEOUT_S, LoadServer, eventually


def _report(role: str, **fields) -> pdserve_pb2.LoadReport:
    return pdserve_pb2.LoadReport(role=role, generation=7, num_total_blocks=64,
                                  num_free_blocks=64, block_size=16, **fields)


@pytest.mark.timeout(60)
def test_a_pushing_pod_is_not_polled_and_its_changes_arrive_on_the_stream(run_async) -> None:
    async def run() -> None:
        pod = await LoadServer("decode", num_running=1).start()
        pod.servicer.pushes = True
        polls = []
        get_load = pod.servicer.GetLoad

        async def counting(request, context):
            polls.append(1)
            return await get_load(request, context)

        pod.servicer.GetLoad = counting
        pool = PolledPodPool(StaticPodSource(decode=[pod.address]), poll_interval=0.05,
                             poll_timeout=POLL_TIMEOUT_S, heartbeat_interval=0.2,
                             health_interval=30)
        try:
            await pool.start()
            assert [p.num_running for p in pool.pods("decode")] == [1]
            await eventually(lambda: pool._pods[pod.address].watch is not None
                             and pool._pods[pod.address].watch.reports > 0)
            before = len(polls)
            pod.servicer.report = _report("decode", num_running=5)
            await eventually(lambda: [p.num_running for p in pool.pods("decode")] == [5])
            # pods() keeps each PodLoad between reports: this router's in-flight count
            # still shows at once, and is gone once the request is
            with pool.track(pod.address, num_tokens=9):
                assert [(p.in_flight, p.in_flight_tokens) for p in pool.pods("decode")] == [(1, 9)]
            assert [(p.in_flight, p.num_running) for p in pool.pods("decode")] == [(0, 5)]
            await asyncio.sleep(0.5)  # ten poll intervals: heartbeats only, no GetLoad
            assert len(polls) == before
            assert pool.state(pod.address)[0] is PodState.HEALTHY
            # draining: the report takes the pod out at once
            pod.servicer.report = _report("decode", draining=True)
            await eventually(lambda: pool.pods("decode") == [])
        finally:
            await pool.close()
            await pod.stop()

    run_async(run())


@pytest.mark.timeout(60)
def test_a_dead_pods_stream_takes_it_out_and_a_silent_one_goes_back_to_polling(
        run_async) -> None:
    async def run() -> None:
        dead = await LoadServer("prefill").start()
        silent = await LoadServer("prefill", num_waiting=3).start()
        for server in (dead, silent):
            server.servicer.pushes = True
        pool = PolledPodPool(StaticPodSource(prefill=[dead.address, silent.address]),
                             poll_interval=0.05, poll_timeout=POLL_TIMEOUT_S,
                             heartbeat_interval=0.1, health_interval=30)
        try:
            await pool.start()
            await eventually(lambda: all(p.watch is not None and p.watch.reports
                                         for p in pool._pods.values()))
            silent.servicer.silent = True  # stream open, no more heartbeats
            first = pool._pods[silent.address].watch
            await dead.stop()
            await eventually(lambda: pool.state(dead.address)[0] is PodState.UNHEALTHY)
            # past the heartbeat deadline the silent pod's stream is dropped (a
            # slow poll) and the pod polled; it answers, so it stays routed and
            # gets a new stream
            await eventually(lambda: pool._pods[silent.address].watch not in (None, first),
                             timeout=15)
            assert not first.running
            assert [p.address for p in pool.pods("prefill")] == [silent.address]
        finally:
            await pool.close()
            await silent.stop()

    run_async(run())


@pytest.mark.timeout(60)
def test_an_older_pod_without_the_stream_is_polled(run_async) -> None:
    async def run() -> None:
        pod = await LoadServer("decode", num_running=2).start()  # pushes=False: UNIMPLEMENTED
        pool = PolledPodPool(StaticPodSource(decode=[pod.address]), poll_interval=0.05,
                             poll_timeout=POLL_TIMEOUT_S)
        try:
            await pool.start()
            await eventually(lambda: pool._pods[pod.address].watch_unsupported)
            pod.servicer.report = _report("decode", num_running=4)
            await eventually(lambda: [p.num_running for p in pool.pods("decode")] == [4])
            assert pool._pods[pod.address].watch is None
        finally:
            await pool.close()
            await pod.stop()

    run_async(run())


def test_the_pod_clamps_the_intervals_a_router_asks_for() -> None:
    assert watch_intervals(pdserve_pb2.WatchLoadRequest()) == (
        DEFAULT_MIN_INTERVAL_S, DEFAULT_MAX_INTERVAL_S)
    assert watch_intervals(pdserve_pb2.WatchLoadRequest(min_interval_s=0.001,
                                                        max_interval_s=1e6)) == (0.01, 60.0)
    # a heartbeat is never asked for more often than changes are checked
    assert watch_intervals(pdserve_pb2.WatchLoadRequest(min_interval_s=3,
                                                        max_interval_s=1)) == (3, 3)


@pytest.mark.timeout(30)
def test_watch_load_sends_changes_heartbeats_and_ends_on_drain(run_async) -> None:
    async def run() -> None:
        loop = SimpleNamespace(stats=object())
        gate = SimpleNamespace(draining=False)
        built = []

        def build() -> pdserve_pb2.LoadReport:
            built.append(1)
            return _report("decode", num_running=loop.stats.running if hasattr(
                loop.stats, "running") else 0, draining=gate.draining)

        request = pdserve_pb2.WatchLoadRequest(min_interval_s=0.02, max_interval_s=0.3)
        stream = watch_load(build, loop, gate, request)
        first = await anext(stream)
        assert first.num_running == 0
        # nothing changed: no rebuild until the heartbeat
        started = asyncio.get_running_loop().time()
        beat = await anext(stream)
        assert asyncio.get_running_loop().time() - started >= 0.25
        assert beat == first and len(built) == 2
        loop.stats = SimpleNamespace(running=3)  # the engine loop published new stats
        changed = await asyncio.wait_for(anext(stream), 0.25)
        assert changed.num_running == 3
        gate.draining = True
        last = await asyncio.wait_for(anext(stream), 0.25)
        assert last.draining
        with pytest.raises(StopAsyncIteration):
            await anext(stream)

    run_async(run())


def test_rounds_between_registry_listings_poll_without_listing(run_async) -> None:
    class CountingSource(StaticPodSource):
        listings = 0

        async def discover(self):
            CountingSource.listings += 1
            return await super().discover()

    async def run() -> None:
        pod = await LoadServer("decode").start()
        pool = PolledPodPool(CountingSource(decode=[pod.address]), poll_interval=0.05,
                             poll_timeout=POLL_TIMEOUT_S, list_interval=30)
        try:
            await pool.poll_once()
            await pool.poll_once(list_registry=False)
            assert CountingSource.listings == 1 and len(pool.pods("decode")) == 1
        finally:
            await pool.close()
            await pod.stop()

    run_async(run())
    with pytest.raises(ValueError, match="list interval must be in"):
        PolledPodPool(StaticPodSource(), poll_interval=1.0, list_interval=0.5)
