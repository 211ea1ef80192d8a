"""Pod registry and polling (router/registry/*), with pods' `pod.heartbeat` as the writer.

The poller is exercised against real gRPC servers on loopback that serve the
standard health service and GetLoad with a report the test controls (the
layer below the poller is the network, which is real here). Redis discovery
and heartbeats run against a real redis-server.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
import redis
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pod.heartbeat import PodHeartbeat
from proto import pdserve_pb2, pdserve_pb2_grpc
from proto.registry import pod_key
from router.registry.base import PodEntry
from router.registry.poller import SLOW_POLLS_TOLERATED, PodState, PolledPodPool
from router.registry.redis_registry import RedisPodSource
from router.registry.static import StaticPodSource, parse_addresses

# A poll of a live pod on loopback must not time out in these tests, however
# loaded the machine: under one busy core and other test processes a first poll
# took over the default 0.5 s. A dead pod's poll fails at once (connection
# refused), so a generous timeout does not slow any leaving this file checks.
POLL_TIMEOUT_S = 10.0


async def eventually(predicate, timeout: float = 10.0, interval: float = 0.02) -> None:
    """Wait until `predicate()` holds; fail with its last value after `timeout` seconds.

    The registry's changes land at a poll after a TTL or a grace, so a fixed sleep
    is a race on a loaded machine; waiting for the condition is not.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, f"condition not met within {timeout} s"
        await asyncio.sleep(interval)


class LoadServicer(pdserve_pb2_grpc.PrefillServicer, pdserve_pb2_grpc.DecodeServicer):
    def __init__(self, report: pdserve_pb2.LoadReport) -> None:
        self.report = report
        self.delay = 0.0  # seconds GetLoad takes: a pod alive but too slow to answer
        self.pushes = False  # serves WatchLoad (a pod from issue 43 on)
        self.silent = False  # ... but sends no heartbeat

    async def GetLoad(self, request, context):  # noqa: N802 (gRPC method name)
        if self.delay:
            await asyncio.sleep(self.delay)
        return self.report

    async def WatchLoad(self, request, context):  # noqa: N802 (gRPC method name)
        """An older pod's answer unless `pushes` (tests/router/test_load_watch.py):
        UNIMPLEMENTED, so the pool polls it; with `pushes`, the report at once,
        again whenever `report` is replaced, and a heartbeat every
        max_interval_s unless `silent` (a stuck pod)."""
        if not self.pushes:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        sent, beat = None, 0.0
        while True:
            if self.report is not sent or (not self.silent and beat >= request.max_interval_s):
                sent, beat = self.report, 0.0
                yield sent
            await asyncio.sleep(0.02)
            beat += 0.02


class LoadServer:
    """A gRPC server on a free loopback port serving health + GetLoad for one role."""

    def __init__(self, role: str, **report: int) -> None:
        self.servicer = LoadServicer(
            pdserve_pb2.LoadReport(role=role, generation=7, num_total_blocks=64,
                                   num_free_blocks=64, block_size=16, **report)
        )
        self.health = health_async.HealthServicer()
        self.server = grpc.aio.server()
        if role == "prefill":
            pdserve_pb2_grpc.add_PrefillServicer_to_server(self.servicer, self.server)
        else:
            pdserve_pb2_grpc.add_DecodeServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"

    async def start(self) -> LoadServer:
        await self.server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        return self

    async def stop(self) -> None:
        await self.server.stop(grace=None)


def test_parse_addresses_and_static_source_validation() -> None:
    assert parse_addresses(" a:1, b:2,,") == ["a:1", "b:2"]
    with pytest.raises(ValueError, match="listed as both prefill and decode"):
        StaticPodSource(prefill=["h:1"], decode=["h:1"])
    with pytest.raises(ValueError, match="pod address must be host:port"):
        StaticPodSource(prefill=["h"])
    source = StaticPodSource(prefill=["h:2", "h:1"], decode=["h:3"])
    assert asyncio.run(source.discover()) == [
        PodEntry("h:3", "decode"), PodEntry("h:1", "prefill"), PodEntry("h:2", "prefill"),
    ]


@pytest.mark.timeout(30)
def test_poller_reports_loads_and_drops_dead_pods_within_an_interval(run_async) -> None:
    async def run() -> None:
        p1 = await LoadServer("prefill", num_waiting=2, num_waiting_tokens=300,
                              tensor_parallel_size=4).start()
        p2 = await LoadServer("prefill").start()
        d1 = await LoadServer("decode", num_running=3).start()
        pool = PolledPodPool(
            StaticPodSource(prefill=[p1.address, p2.address], decode=[d1.address]),
            poll_interval=0.1, poll_timeout=POLL_TIMEOUT_S,
        )
        await pool.start()
        try:
            assert pool.is_ready()
            prefill = pool.pods("prefill")
            assert [p.address for p in prefill] == sorted([p1.address, p2.address])
            by_address = {p.address: p for p in prefill}
            assert by_address[p1.address].num_waiting_tokens == 300
            assert by_address[p1.address].num_waiting == 2
            assert by_address[p1.address].generation == 7
            # a TP pod's size; a pod that predates the field (0) is one process
            assert by_address[p1.address].tensor_parallel_size == 4
            assert by_address[p2.address].tensor_parallel_size == 1
            assert pool.pods("decode")[0].num_running == 3
            with pool.track(p2.address, num_tokens=40):
                assert {p.address: p.in_flight_tokens for p in pool.pods("prefill")} == {
                    p1.address: 0, p2.address: 40,
                }
            # load changes show up at the next poll
            p1.servicer.report.num_waiting_tokens = 10
            await eventually(lambda: {p.address: p.num_waiting_tokens
                                      for p in pool.pods("prefill")}[p1.address] == 10)
            # a dead pod leaves within one interval, and comes back when it answers again
            await d1.stop()
            await eventually(lambda: pool.pods("decode") == [])
            assert not pool.is_ready()
            assert pool.state(d1.address)[0] is PodState.UNHEALTHY
            assert pool.known("decode") == [d1.address]
            # health NOT_SERVING and draining also take a pod out
            await p2.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            p1.servicer.report.draining = True
            await eventually(lambda: pool.pods("prefill") == []
                             and pool.state(p1.address) == (PodState.UNHEALTHY, "draining"))
            p1.servicer.report.draining = False
            await eventually(lambda: [p.address for p in pool.pods("prefill")] == [p1.address])
            # the server can take a pod out at once; the next good poll returns it
            pool.mark_unhealthy(p1.address, "connect failed")
            assert pool.pods("prefill") == []
            await eventually(lambda: [p.address for p in pool.pods("prefill")] == [p1.address])
        finally:
            await pool.close()
            for server in (p1, p2):
                await server.stop()

    run_async(run())


@pytest.mark.timeout(30)
def test_poller_refuses_a_pod_reporting_another_role(run_async) -> None:
    async def run() -> None:
        server = await LoadServer("decode").start()
        # a colocated pod address given as --decode: the report says "decode" for a
        # pod registered as colocated -> not used
        pool = PolledPodPool(StaticPodSource(colocated=[server.address]), poll_interval=0.1,
                             poll_timeout=POLL_TIMEOUT_S)
        await pool.start()
        try:
            assert pool.pods("colocated") == []
            state, reason = pool.state(server.address)
            assert state is PodState.UNHEALTHY
            assert reason == "registered as colocated but reports role 'decode'"
        finally:
            await pool.close()
            await server.stop()

    run_async(run())


@pytest.mark.timeout(30)
def test_redis_registry_adds_new_pods_and_drops_expired_ones(redis_url: str, run_async) -> None:
    async def run() -> None:
        p1 = await LoadServer("prefill").start()
        d1 = await LoadServer("decode").start()
        client = redis.Redis.from_url(redis_url, decode_responses=True)
        client.set("pdserve:pods:decode:junk", "not json")  # skipped with a warning
        # a pod gone from Redis that still answers its polls is kept for absent_grace
        pool = PolledPodPool(RedisPodSource(redis_url), poll_interval=0.1, absent_grace=0.3,
                             poll_timeout=POLL_TIMEOUT_S)
        await pool.start()
        beats = []
        try:
            assert pool.known("prefill") == [] and not pool.is_ready()
            for role, server in (("prefill", p1), ("decode", d1)):
                beat = PodHeartbeat(redis_url, role=role, address=server.address, model="m",
                                    ttl_s=0.6)
                beat.start()
                beats.append(beat)
            await eventually(lambda: [p.address for p in pool.pods("prefill")] == [p1.address]
                             and [p.address for p in pool.pods("decode")] == [d1.address])
            # a crashed pod stops refreshing: its key expires and the pod leaves the pool
            beats[0]._stop.set()
            beats[0]._thread.join()
            await eventually(lambda: pool.known("prefill") == [])
            assert [p.address for p in pool.pods("decode")] == [d1.address]
            # a clean stop (on drain) deletes the key at once; the draining pod leaves
            # at the next poll
            d1.servicer.report.draining = True
            beats[1].stop()
            await eventually(lambda: pool.known("decode") == [])
        finally:
            for beat in beats:
                beat.stop()
            await pool.close()
            client.close()
            await p1.stop()
            await d1.stop()

    run_async(run())


@pytest.mark.timeout(30)
def test_redis_outage_keeps_the_known_pods(tmp_path, run_async) -> None:
    from tests.redis_server import RedisServer

    server = RedisServer(tmp_path)

    async def run() -> None:
        p1 = await LoadServer("prefill").start()
        client = server.client()
        client.set(pod_key("prefill", p1.address),
                   json.dumps({"address": p1.address, "role": "prefill", "model": "m"}))
        client.close()
        pool = PolledPodPool(RedisPodSource(server.url), poll_interval=0.1,
                             poll_timeout=POLL_TIMEOUT_S)
        await pool.start()
        try:
            assert [p.address for p in pool.pods("prefill")] == [p1.address]
            server.stop()
            await asyncio.sleep(0.5)  # several polls whose discovery fails
            assert [p.address for p in pool.pods("prefill")] == [p1.address]
        finally:
            await pool.close()
            await p1.stop()

    try:
        run_async(run())
    finally:
        server.stop()


@pytest.mark.timeout(30)
def test_a_pod_missing_from_redis_stays_while_it_answers_until_the_grace_passes(
    redis_url: str, run_async
) -> None:
    async def run() -> None:
        p1 = await LoadServer("prefill").start()
        d1 = await LoadServer("decode").start()
        client = redis.Redis.from_url(redis_url, decode_responses=True)
        for server, role in ((p1, "prefill"), (d1, "decode")):
            client.set(pod_key(role, server.address),
                       json.dumps({"address": server.address, "role": role, "model": "m"}))
        pool = PolledPodPool(RedisPodSource(redis_url), poll_interval=0.05, absent_grace=1.0,
                             poll_timeout=POLL_TIMEOUT_S)
        await pool.start()
        try:
            assert [p.address for p in pool.pods("prefill")] == [p1.address]
            client.flushall()  # Redis restored empty
            await asyncio.sleep(0.4)  # several polls that find no key
            assert [p.address for p in pool.pods("prefill")] == [p1.address]
            assert [p.address for p in pool.pods("decode")] == [d1.address]
            # the prefill pod re-registers; the decode pod's poll fails: it leaves at once
            client.set(pod_key("prefill", p1.address),
                       json.dumps({"address": p1.address, "role": "prefill", "model": "m"}))
            await d1.stop()
            await eventually(lambda: pool.known("decode") == [])
            await asyncio.sleep(1.2)  # past the grace: the re-registered pod is still there
            assert [p.address for p in pool.pods("prefill")] == [p1.address]
            # a pod that stays missing leaves once the grace has passed
            client.flushall()
            await asyncio.sleep(0.5)
            assert pool.known("prefill") == [p1.address]
            await eventually(lambda: pool.known("prefill") == [])
        finally:
            await pool.close()
            client.close()
            await p1.stop()

    run_async(run())


def test_absent_grace_is_validated() -> None:
    with pytest.raises(ValueError, match=r"registry absent grace must be in \[0, 3600\] s"):
        PolledPodPool(StaticPodSource(prefill=["h:1"]), absent_grace=-1)


@pytest.mark.timeout(60)
def test_a_slow_pod_stays_routed_through_slow_polls_and_a_dead_one_leaves_at_once(
        run_async) -> None:
    """Polls driven one at a time: a pod whose GetLoad outlasts the poll's
    deadline keeps its traffic for SLOW_POLLS_TOLERATED polls in a row (its
    last report in use), leaves at the next, comes back at its first answer in
    time; a pod that refuses the connection leaves at its first failed poll."""
    async def run() -> None:
        pod = await LoadServer("decode", num_running=2).start()
        pool = PolledPodPool(StaticPodSource(decode=[pod.address]), poll_interval=0.05,
                             poll_timeout=POLL_TIMEOUT_S)
        try:
            await pool.poll_once()
            assert [p.num_running for p in pool.pods("decode")] == [2]
            pool.poll_timeout, pod.servicer.delay = 0.2, 2.0
            for _ in range(SLOW_POLLS_TOLERATED):
                await pool.poll_once()
                assert [p.num_running for p in pool.pods("decode")] == [2]
            await pool.poll_once()
            assert pool.pods("decode") == []
            assert pool.state(pod.address)[0] is PodState.UNHEALTHY
            pool.poll_timeout, pod.servicer.delay = POLL_TIMEOUT_S, 0.0
            await pool.poll_once()
            assert [p.address for p in pool.pods("decode")] == [pod.address]
            await pod.stop()
            await pool.poll_once()
            assert pool.pods("decode") == []
        finally:
            await pool.close()
            await pod.stop()

    run_async(run())
