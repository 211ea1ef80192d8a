"""`prefill_service.config`: the prefill pod's config."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from pod.config import ServerConfig
from prefill_service.config import PrefillConfig


def test_prefill_config_limits_streams():
    engine = EngineConfig(model_dir="/m")
    assert PrefillConfig(engine, ServerConfig(), kv_streams=64).kv_streams == 64
    with pytest.raises(ValueError, match=r"kv_streams must be in \[1, 64\], got 0"):
        PrefillConfig(engine, ServerConfig(), kv_streams=0)
