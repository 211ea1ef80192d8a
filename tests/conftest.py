"""Fixtures shared by every test package.

`tiny_model_dir` is the built-in random-weight checkpoint, written once per
test session through the same code path `pdserve make-model` uses, and loaded
by the tests through the same loader as a real Hugging Face checkpoint.
`redis_url` is a real redis-server (one per test module, flushed per test,
free port), used by the router's registry and the pods' heartbeat tests.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.redis_server import RedisServer

# Helper modules that assert on behalf of tests: registered here, before any
# test package imports them, so pytest explains their failures too.
pytest.register_assert_rewrite("tests.kv_transfer.helpers", "tests.kv_transfer.tcp.raw")

# Kernel tests run Triton through its CPU interpreter; set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.make_model import make_model

    path = tmp_path_factory.mktemp("models") / "tiny"
    make_model(path, size="tiny", seed=0)
    return path


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """URL of the module's redis-server, emptied before each test."""
    client = redis_server.client()
    client.flushall()
    client.close()
    yield redis_server.url
