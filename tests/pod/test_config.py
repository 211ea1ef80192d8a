"""`pod.config`: byte sizes and the settings every pod server shares."""

from __future__ import annotations

import pytest

from pod.config import ServerConfig, parse_size


@pytest.mark.parametrize(("text", "value"), [
    ("2GiB", 2 * 1024**3), ("512MiB", 512 * 1024**2), ("1.5KiB", 1536), ("10", 10),
    ("3GB", 3 * 10**9), ("64 mib", 64 * 1024**2),
])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "GiB", "2XB", "-1GiB", "0"])
def test_parse_size_refuses(text):
    with pytest.raises(ValueError, match="size must be"):
        parse_size(text)


def test_server_config_checks_ports_and_grace():
    with pytest.raises(ValueError, match=r"port must be in \[0, 65535\]"):
        ServerConfig(port=70000)
    with pytest.raises(ValueError, match="grace period must be >= 0 seconds, got -1"):
        ServerConfig(grace_period_s=-1)
    with pytest.raises(ValueError, match="redis url must start with"):
        ServerConfig(redis_url="localhost:6379")


def test_public_host_prefers_advertised_then_bound_host():
    assert ServerConfig(host="0.0.0.0", advertise_host="pod-1.svc").public_host() == "pod-1.svc"
    assert ServerConfig(host="127.0.0.1").public_host() == "127.0.0.1"
    assert ServerConfig(host="0.0.0.0").public_host() not in ("0.0.0.0", "")
