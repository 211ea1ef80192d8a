"""`decode_service.config`: the decode pod's validated settings."""

from __future__ import annotations

import pytest

from decode_service.config import DecodeConfig
from engine.config import EngineConfig
from pod.config import ServerConfig

ENGINE = EngineConfig(model_dir="/m", block_size=128)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"kv_port": 70000}, r"kv_port must be in \[0, 65535\] \(0 = any free port\), got 70000"),
    ({"kv_transport": "udp"}, r"kv_transport must be one of \('tcp', 'grpc'\), got 'udp'"),
    ({"landing_memory": 0}, "landing_memory must be > 0 bytes, got 0"),
    ({"transfer_timeout_s": 0}, r"transfer_timeout must be in \(0, 3600.0\] seconds, got 0"),
    ({"join_wait": 1.5}, r"join_wait must be in \[0, 1\] of a step, got 1.5"),
    ({"join_wait": -0.1}, r"join_wait must be in \[0, 1\] of a step, got -0.1"),
])
def test_decode_config_refuses(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DecodeConfig(ENGINE, ServerConfig(), **kwargs)


def test_decode_config_defaults_follow_the_cli_contract():
    config = DecodeConfig(ENGINE, ServerConfig())
    assert (config.kv_port, config.kv_transport, config.landing_memory,
            config.transfer_timeout_s, config.join_wait) == (50062, "tcp", 1 << 30, 30.0, 0.5)
