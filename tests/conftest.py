"""Fixtures shared by every test package.

`tiny_model_dir` is the built-in random-weight checkpoint, written once per
test session through the same code path `pdserve make-model` uses, and loaded
by the tests through the same loader as a real Hugging Face checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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
