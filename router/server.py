"""`RouterServer`: wires config, pod pool, policy and both front doors.

Life cycle, driven by `pdserve router` (or `pdserve up`) on one asyncio
event loop:

    start():  tokenizer → pod pool (static list and/or Redis; first poll
              awaited) → routing policy + session store → HTTP (aiohttp,
              handler cancellation on) and gRPC servers bound → a readiness
              task mirrors `pool.is_ready()` into the gRPC health service.
    run_until_signal(): start, then wait for SIGTERM/SIGINT, then stop().
    stop():   refuse new work (health NOT_SERVING, listeners closed), give
              in-flight requests up to `shutdown_grace` seconds, then close
              the pod channels, the pool and the session store.

Nothing here touches torch: the tokenizer is the only engine module the
router loads.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
from collections.abc import Callable

from aiohttp import web

from engine.tokenizer import Tokenizer
from router.api_keys import KeyFile
from router.auth import ApiKeyCheck
from router.cache_index.feed import CacheEventFeed
from router.cache_index.index import PrefixIndex
from router.client_gate import ClientGate
from router.config import RouterConfig
from router.flow.deps import FlowDeps
from router.flow.prefill_warm import PrefillWarmer
from router.frontend import Frontend
from router.grpc_server import NOT_SERVING, SERVING, build_grpc_server
from router.http.client_limits import ClientConcurrency
from router.http.connection import HttpTimeouts, TimedAppRunner
from router.http.server import build_app
from router.metrics import RouterMetrics
from router.pod_channels import PodChannels
from router.registry.base import PodEntry, PodSource
from router.registry.poller import PolledPodPool
from router.registry.static import StaticPodSource
from router.routing.admission import PrefillAdmission
from router.routing.colocated_gate import ColocatedGate
from router.routing.ledger import LocalRate
from router.routing.local_prefill import LocalPrefill
from router.routing.split_prefill import SplitPrefill
from router.routing.timed import TimedRoutingPolicy
from router.sessions import InMemorySessionStore, RedisSessionStore, SessionStore

log = logging.getLogger(__name__)


class _CombinedSource(PodSource):
    """Static addresses plus the Redis registry's, when both are configured."""

    def __init__(self, sources: list[PodSource]) -> None:
        self._sources = sources

    async def discover(self) -> list[PodEntry]:
        entries: dict[str, PodEntry] = {}
        for source in self._sources:
            for entry in await source.discover():
                entries.setdefault(entry.address, entry)
        return sorted(entries.values(), key=lambda e: (e.role, e.address))

    async def close(self) -> None:
        for source in self._sources:
            await source.close()


class RouterServer:
    """One router process. Not reusable: start() once, stop() once."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.metrics = RouterMetrics(multiprocess_dir=config.metrics_dir)
        self.http_port = 0
        self.grpc_port = 0
        self._runner: web.AppRunner | None = None
        self._frontend: Frontend | None = None
        self._warmer: PrefillWarmer | None = None
        self._grpc = None
        self._health = None
        self._ready_task: asyncio.Task[None] | None = None
        self._keys_task: asyncio.Task[None] | None = None
        self.pool: PolledPodPool | None = None
        self._sessions: SessionStore | None = None
        self._feed: CacheEventFeed | None = None
        self._channels = PodChannels(decode_streams=config.relay == "session",
                                     security=config.pod_security,
                                     on_relayed=self.metrics.direct_relayed.inc)

    def _pod_source(self) -> PodSource:
        c = self.config
        sources: list[PodSource] = []
        if c.prefill or c.decode or c.colocated:
            sources.append(StaticPodSource(prefill=c.prefill, decode=c.decode,
                                           colocated=c.colocated))
        if c.redis_url:
            from router.registry.redis_registry import RedisPodSource

            sources.append(RedisPodSource(c.redis_url))
        if not sources:
            raise ValueError("no pods configured: pass --prefill/--decode, --colocated "
                             "or --redis-url")
        return sources[0] if len(sources) == 1 else _CombinedSource(sources)

    async def start(self) -> None:
        c = self.config
        max_model_len = c.resolve_max_model_len()
        tokenizer = Tokenizer.from_pretrained(c.model_dir)
        self.pool = PolledPodPool(self._pod_source(), poll_interval=c.load_poll_interval,
                                  security=c.pod_security,
                                  absent_grace=c.registry_absent_grace,
                                  watch=c.load_reports == "push",
                                  list_interval=(max(c.load_poll_interval, 2.0)
                                                 if c.load_reports == "push" else None),
                                  on_report=lambda source: self.metrics.load_reports.labels(
                                      source=source).inc())
        await self.pool.start()
        self._sessions = RedisSessionStore(c.redis_url) if c.redis_url else InMemorySessionStore()
        index = PrefixIndex(c.cache_index_blocks)
        if c.routing_policy != "round-robin" or c.local_prefill.below > 0:
            # the pods' cache events, for the policy (cache-aware placement, and
            # the decode choice in every policy but the round-robin baseline:
            # decode pods with --prefix-cache, docs/routing.md) and
            # LocalPrefill's cached prefix
            self._feed = CacheEventFeed(
                self.pool, index, redis_url=c.redis_url, interval=c.load_poll_interval,
                blocks_gauge=self.metrics.cache_index_blocks,
                missed_gauge=self.metrics.cache_events_missed, security=c.pod_security)
            await self._feed.start()
        policy = TimedRoutingPolicy(self.pool, self._sessions, epsilon=c.session_epsilon,
                                    mode=c.routing_policy, index=index,
                                    cache_load_weight=c.cache_aware_load_weight,
                                    decision_seconds=self.metrics.routing_decision,
                                    decision_cpu_seconds=self.metrics.routing_decision_cpu)
        local_rate = LocalRate()  # the local prefills' rate, which shedding counts
        admission = PrefillAdmission(
            self.pool, policy, self.metrics,
            c.admission, local=local_rate)
        deps = FlowDeps(
            pool=self.pool, policy=policy, channels=self._channels, metrics=self.metrics,
            settings=c.flow,
            admission=admission,
            colocated_gate=ColocatedGate(self.pool, self.metrics, c.admission),
            local_prefill=LocalPrefill(
                self.pool, admission.least_ahead,
                dataclasses.replace(c.local_prefill, report_age=2 * c.load_poll_interval),
                cached_prefix=index.cached_prefix, rate=local_rate,
                epsilon=c.session_epsilon),
            split=SplitPrefill(self.pool, c.split_prefill, cached_prefix=index.cached_prefix),
            warmer=(PrefillWarmer(self.pool, self._channels, self.metrics)
                    if c.local_prefill.warm or c.local_prefill.warm_answers else None),
        )
        self._warmer = deps.warmer
        frontend = self._frontend = Frontend(model_name=c.model_name,
                                             max_model_len=max_model_len,
                                             tokenizer=tokenizer, deps=deps,
                                             tool_call_parser=c.tool_call_parser)
        auth = self._auth()
        # both front doors: per-client slots, per-key token rates
        gate = ClientGate(auth, ClientConcurrency(c.max_concurrent_per_client),
                          metrics=self.metrics)
        app = build_app(frontend, self.pool, auth, gate)
        self._runner = TimedAppRunner(
            app, HttpTimeouts(header_timeout=c.http_header_timeout,
                              keepalive_timeout=c.http_keepalive_timeout),
            handler_cancellation=True, access_log=None, shutdown_timeout=c.shutdown_grace)
        await self._runner.setup()
        # several workers share the ports (router/workers.py)
        site = web.TCPSite(self._runner, c.host, c.port, reuse_port=c.workers > 1,
                           ssl_context=c.tls.ssl_context() if c.tls else None)
        await site.start()
        self.http_port = self._runner.addresses[0][1]
        self._grpc, self.grpc_port, self._health = build_grpc_server(
            frontend, auth, f"{c.host}:{c.grpc_port}", reuse_port=c.workers > 1, tls=c.tls,
            gate=gate)
        await self._grpc.start()
        self._ready_task = asyncio.create_task(self._mirror_readiness(), name="router-ready")
        log.info("router serving %s: HTTP%s on %s:%d, gRPC on %s:%d (%s); pods: %s",
                 c.model_name, "S" if c.tls else "", c.host, self.http_port, c.host,
                 self.grpc_port, "TLS" if c.tls else "plaintext", c.pod_security.describe())

    def _auth(self) -> ApiKeyCheck:
        """The key check: none, `--api-key`'s one key, or `--api-keys-file`'s
        keys, watched for changes by a task of this event loop (a file that
        does not parse raised at `RouterConfig`'s start, see api_keys.py)."""
        c = self.config
        if c.api_keys_file is None:
            return ApiKeyCheck(c.api_key)
        keys = KeyFile(c.api_keys_file,
                       on_reload=lambda outcome: self.metrics.key_reloads.labels(
                           outcome=outcome).inc())
        self._keys_task = asyncio.create_task(keys.watch(), name="api-keys-watch")
        log.info("API keys from %s: %s", c.api_keys_file, ", ".join(keys.ring.names))
        return ApiKeyCheck(lambda: keys.ring)

    async def _mirror_readiness(self) -> None:
        """Keep the gRPC health status equal to the pool's readiness."""
        last = None
        while True:
            assert self.pool is not None and self._health is not None
            status = SERVING if self.pool.is_ready() else NOT_SERVING
            if status != last:
                await self._health.set("", status)
                last = status
            await asyncio.sleep(self.config.load_poll_interval)

    async def stop(self) -> None:
        """Stop taking work, let in-flight requests finish (up to the grace
        period), then release everything."""
        if self._keys_task is not None:
            self._keys_task.cancel()
        if self._ready_task is not None:
            self._ready_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ready_task
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        grace = self.config.shutdown_grace
        # Both servers drain at once: gRPC streams and HTTP handlers each get
        # the grace period (aiohttp's shutdown_timeout) to finish.
        waits = []
        if self._grpc is not None:
            waits.append(self._grpc.stop(grace))
        if self._runner is not None:
            waits.append(self._runner.cleanup())
        await asyncio.gather(*waits)
        if self._frontend is not None:
            self._frontend.close()
        if self._warmer is not None:
            await self._warmer.close()
        await self._channels.close()
        if self._feed is not None:
            await self._feed.close()
        if self.pool is not None:
            await self.pool.close()
        if self._sessions is not None:
            await self._sessions.close()

    async def run_until_signal(self, on_started: Callable[[RouterServer], None] | None = None
                               ) -> None:
        """Serve until SIGTERM or SIGINT, then shut down gracefully.
        `on_started` runs once both servers listen (e.g. to write a ready file)."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await self.start()
        if on_started is not None:
            on_started(self)
        try:
            await stop.wait()
            log.info("router: signal received, draining for up to %gs",
                     self.config.shutdown_grace)
        finally:
            await self.stop()
            # Drained and closed: from here the process only exits. Closing the
            # loop would restore the default SIGTERM action, and a second
            # SIGTERM (an impatient supervisor) during interpreter exit would
            # then turn a clean shutdown into exit status -15.
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
                signal.signal(sig, signal.SIG_IGN)
