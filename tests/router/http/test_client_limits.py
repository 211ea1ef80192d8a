"""`router.http.client_limits.ClientConcurrency`: slots per client key."""

from __future__ import annotations

import pytest

from router.api_error import ApiError
from router.http.client_limits import ClientConcurrency


def test_slots_per_key_and_release_on_error():
    limits = ClientConcurrency(2)
    alice = ClientConcurrency.client_key("alice", "10.0.0.1")  # an API key's name
    bob = ClientConcurrency.client_key(None, "10.0.0.1")
    assert alice == "key:alice"
    assert bob == "addr:10.0.0.1"
    with limits.hold(alice, "API key"), limits.hold(alice, "API key"):
        with pytest.raises(ApiError) as err, limits.hold(alice, "API key"):
            pass
        with limits.hold(bob, "client address"):  # another client is not affected
            assert limits.in_flight(bob) == 1
    assert err.value.status == 429 and err.value.retry_after == 1
    assert err.value.message == (
        "too many concurrent requests from this API key: 2 in flight, the limit is 2 per "
        "API key (--max-concurrent-per-client); retry when one has finished")
    with pytest.raises(RuntimeError), limits.hold(alice, "API key"):
        raise RuntimeError("the handler failed")
    assert limits.in_flight(alice) == 0 and limits.in_flight(bob) == 0


def test_zero_means_no_limit():
    limits = ClientConcurrency(0)
    with limits.hold("k", "API key"), limits.hold("k", "API key"):
        assert limits.in_flight("k") == 0
    with pytest.raises(ValueError):
        ClientConcurrency(-1)


def test_a_keys_own_limit_replaces_the_router_wide_one():
    limits = ClientConcurrency(0)  # no router-wide limit
    with limits.hold("key:small", "API key", own_limit=1):
        with pytest.raises(ApiError) as err, limits.hold("key:small", "API key", own_limit=1):
            pass
        with limits.hold("key:big", "API key"), limits.hold("key:big", "API key"):
            pass  # a key without its own limit: none
    assert err.value.message == (
        "too many concurrent requests from this API key: 1 in flight, the limit is 1 "
        "(max_concurrent of API key 'small'); retry when one has finished")
    assert limits.in_flight("key:small") == 0
