"""`pod.heartbeat`: a pod's registry key in a real redis-server."""

from __future__ import annotations

import json
import time

import pytest
import redis

from pod.heartbeat import PodHeartbeat
from proto.registry import pod_key


def test_heartbeat_checks_its_ttl() -> None:
    with pytest.raises(ValueError, match=r"heartbeat ttl_s must be in \[0.5, 3600\]"):
        PodHeartbeat("redis://127.0.0.1:1", role="decode", address="h:1", model="m", ttl_s=0.1)


@pytest.mark.timeout(30)
def test_heartbeat_writes_refreshes_and_deletes_its_key(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    beat = PodHeartbeat(redis_url, role="prefill", address="127.0.0.1:5999", model="tiny",
                        ttl_s=0.6)
    beat.start()
    try:
        key = pod_key("prefill", "127.0.0.1:5999")
        assert json.loads(client.get(key)) == {
            "address": "127.0.0.1:5999", "role": "prefill", "model": "tiny",
            "started_at": beat.record.started_at,
        }
        time.sleep(1.0)  # longer than the TTL: only the refresh keeps it alive
        assert client.exists(key) == 1
        assert 0 < client.pttl(key) <= 600
    finally:
        beat.stop()
    assert client.exists(key) == 0
    client.close()


@pytest.mark.timeout(30)
def test_heartbeat_start_fails_loudly_without_redis() -> None:
    from tests.redis_server import free_port

    beat = PodHeartbeat(f"redis://127.0.0.1:{free_port()}", role="decode", address="h:1",
                        model="m")
    with pytest.raises(redis.ConnectionError):
        beat.start()


@pytest.mark.timeout(30)
def test_a_vanished_key_is_written_back_at_the_next_beat_and_logged(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    beat = PodHeartbeat(redis_url, role="decode", address="127.0.0.1:5998", model="tiny",
                        ttl_s=0.9)  # a beat every 0.3 s
    beat.start()
    try:
        client.flushall()  # Redis restored empty
        flushed_at = time.monotonic()
        while client.exists(beat.key) == 0:
            assert time.monotonic() - flushed_at < 3.0, "the key was not written back"
            time.sleep(0.02)
        assert time.monotonic() - flushed_at < 1.5  # within one beat (0.3 s) + slack
        assert f"registry key {beat.key} had vanished" in caplog.text
    finally:
        beat.stop()
        client.close()
