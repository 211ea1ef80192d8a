"""Session stores (router/sessions.py): in-memory LRU+TTL and Redis (real redis-server)."""

from __future__ import annotations

import asyncio

import pytest
import redis

from router.sessions import InMemorySessionStore, RedisSessionStore


class FakeClock:
    """Manual time for TTL tests (the store takes the clock as a parameter)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_in_memory_set_if_absent_and_compare_and_set() -> None:
    async def run() -> None:
        store = InMemorySessionStore()
        assert await store.get("prefill", "s1") is None
        assert await store.assign("prefill", "s1", None, "a:1") == "a:1"
        # a second router's set-if-absent loses to the first mapping
        assert await store.assign("prefill", "s1", None, "b:1") == "a:1"
        # compare-and-set from the right old value wins
        assert await store.assign("prefill", "s1", "a:1", "b:1") == "b:1"
        # ... from a stale one loses
        assert await store.assign("prefill", "s1", "a:1", "c:1") == "b:1"
        assert await store.get("prefill", "s1") == "b:1"
        # roles are separate namespaces
        assert await store.get("colocated", "s1") is None

    asyncio.run(run())


def test_in_memory_ttl_refreshes_on_use_and_expires() -> None:
    async def run() -> None:
        clock = FakeClock()
        store = InMemorySessionStore(ttl_s=10.0, clock=clock)
        await store.assign("prefill", "s1", None, "a:1")
        clock.now += 9.0
        assert await store.get("prefill", "s1") == "a:1"  # refreshed: expires at +19
        clock.now += 9.0
        assert await store.get("prefill", "s1") == "a:1"
        clock.now += 10.0
        assert await store.get("prefill", "s1") is None
        assert len(store) == 0

    asyncio.run(run())


def test_in_memory_evicts_least_recently_used() -> None:
    async def run() -> None:
        store = InMemorySessionStore(max_sessions=2)
        await store.assign("prefill", "s1", None, "a:1")
        await store.assign("prefill", "s2", None, "a:1")
        assert await store.get("prefill", "s1") == "a:1"  # s2 is now the LRU entry
        await store.assign("prefill", "s3", None, "b:1")
        assert len(store) == 2
        assert await store.get("prefill", "s2") is None
        assert await store.get("prefill", "s1") == "a:1"
        assert await store.get("prefill", "s3") == "b:1"

    asyncio.run(run())


def test_validation_messages() -> None:
    with pytest.raises(ValueError, match="ttl_s must be > 0"):
        InMemorySessionStore(ttl_s=0)
    with pytest.raises(ValueError, match="max_sessions must be > 0"):
        InMemorySessionStore(max_sessions=0)

    async def run() -> None:
        store = InMemorySessionStore()
        with pytest.raises(ValueError, match="role must be one of"):
            await store.get("router", "s1")
        with pytest.raises(ValueError, match="session id must be 1..256"):
            await store.get("prefill", "")

    asyncio.run(run())


@pytest.mark.timeout(30)
def test_redis_store_cas_ttl_and_key_schema(redis_url: str) -> None:
    async def run() -> None:
        store = RedisSessionStore(redis_url, ttl_s=5.0)
        try:
            assert await store.get("prefill", "s1") is None
            assert await store.assign("prefill", "s1", None, "a:1") == "a:1"
            assert await store.assign("prefill", "s1", None, "b:1") == "a:1"
            assert await store.assign("prefill", "s1", "a:1", "b:1") == "b:1"
            assert await store.assign("prefill", "s1", "a:1", "c:1") == "b:1"
            assert await store.get("prefill", "s1") == "b:1"
        finally:
            await store.close()

    asyncio.run(run())
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    assert client.get("pdserve:session:prefill:s1") == "b:1"
    assert 4000 < client.pttl("pdserve:session:prefill:s1") <= 5000
    client.close()


@pytest.mark.timeout(30)
def test_two_redis_stores_racing_on_a_new_session_agree(redis_url: str) -> None:
    async def run() -> list[str]:
        stores = [RedisSessionStore(redis_url) for _ in range(2)]
        try:
            results = await asyncio.gather(
                *(
                    stores[i % 2].assign("prefill", f"s{j}", None, f"pod{i}:1")
                    for j in range(50)
                    for i in range(2)
                )
            )
        finally:
            for store in stores:
                await store.close()
        return results

    results = asyncio.run(run())
    # per session, both routers got the same winner
    assert all(results[2 * j] == results[2 * j + 1] for j in range(50))


@pytest.mark.timeout(30)
def test_redis_mapping_expires(redis_url: str) -> None:
    async def run() -> None:
        store = RedisSessionStore(redis_url, ttl_s=0.2)
        try:
            await store.assign("colocated", "s9", None, "a:1")
            assert await store.get("colocated", "s9") == "a:1"
            await asyncio.sleep(0.35)
            assert await store.get("colocated", "s9") is None
        finally:
            await store.close()

    asyncio.run(run())


@pytest.mark.timeout(30)
def test_redis_store_queues_bursts_larger_than_its_connection_pool(redis_url: str) -> None:
    """300 requests at once over 8 connections: they wait for a connection, none fail."""

    async def run() -> list[str]:
        store = RedisSessionStore(redis_url, max_connections=8, timeout_s=5.0)
        try:
            return await asyncio.gather(
                *(store.assign("prefill", f"burst-{i}", None, f"pod{i % 3}:1") for i in range(300))
            )
        finally:
            await store.close()

    assert asyncio.run(run()) == [f"pod{i % 3}:1" for i in range(300)]
    with pytest.raises(ValueError, match="max_connections must be > 0"):
        RedisSessionStore(redis_url, max_connections=0)


@pytest.mark.timeout(30)
def test_redis_store_pipelines_a_mixed_burst_and_survives_a_script_flush(redis_url: str) -> None:
    """Gets and assigns issued together share pipelines and each gets its own
    answer; after SCRIPT FLUSH (a restarted or failed-over Redis) assign reloads
    the script and goes on."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)

    async def run() -> tuple[list, str]:
        store = RedisSessionStore(redis_url, max_connections=2, max_batch=16, timeout_s=5.0)
        try:
            for i in range(0, 100, 2):
                assert await store.assign("decode", f"mix-{i}", None, f"pod{i}:1") == f"pod{i}:1"
            burst = await asyncio.gather(*(
                store.get("decode", f"mix-{i}") if i % 2 == 0
                else store.assign("decode", f"mix-{i}", None, f"new{i}:1")
                for i in range(100)
            ))  # fmt: skip
            client.script_flush()
            after = await store.assign("decode", "after-flush", None, "x:1")
            return burst, after
        finally:
            await store.close()

    burst, after = asyncio.run(run())
    assert burst == [f"pod{i}:1" if i % 2 == 0 else f"new{i}:1" for i in range(100)]
    assert after == "x:1" and client.get("pdserve:session:decode:after-flush") == "x:1"
    client.close()
    with pytest.raises(ValueError, match="max_batch must be > 0"):
        RedisSessionStore(redis_url, max_batch=0)
