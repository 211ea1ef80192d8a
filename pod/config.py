"""What every pod's configuration shares: `ServerConfig` (where a pod listens
and how it announces itself, part of every pod config) and `parse_size`, the
byte-size syntax all pod flags share ("2GiB", "512MiB"). Built by the CLI's
pod commands from their flags; the services never see argparse."""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass, field

from proto.tls import PodSecurity

_WILDCARD_HOSTS = ("0.0.0.0", "::", "")
_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
               "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """'2GiB' -> 2147483648; plain numbers are bytes. ValueError names the input."""
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"size must be a number with an optional unit (B, KiB, MiB, GiB, KB, "
                         f"MB, GB), got {text!r}")
    value = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise ValueError(f"size must be > 0 bytes, got {text!r}")
    return value


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Where a pod listens and how it announces itself; part of every pod config."""

    host: str = "0.0.0.0"
    port: int = 0
    metrics_port: int = 0
    advertise_host: str | None = None
    redis_url: str | None = None
    grace_period_s: float = 30.0
    ready_file: str | None = None
    # TLS and token of the pod's gRPC port (and of the channels it opens to
    # other pods, and of a decode pod's gRPC KV port); docs/deploy.md, Security.
    security: PodSecurity = field(default_factory=PodSecurity)
    # A plaintext port serving only the gRPC health service, for probes that
    # cannot speak TLS (kubelet); None: not served.
    health_port: int | None = None

    def __post_init__(self) -> None:
        if self.health_port is not None and not 0 <= self.health_port <= 65535:
            raise ValueError(f"health_port must be in [0, 65535] (0 = any free port), "
                             f"got {self.health_port}")
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise ValueError(f"{name} must be in [0, 65535] (0 = any free port), got {value}")
        if self.grace_period_s < 0:
            raise ValueError(f"grace period must be >= 0 seconds, got {self.grace_period_s}")
        if self.redis_url is not None and not self.redis_url.startswith(("redis://", "rediss://",
                                                                         "unix://")):
            raise ValueError(f"redis url must start with redis://, rediss:// or unix://, "
                             f"got {self.redis_url!r}")

    def public_host(self) -> str:
        """The host peers should dial: --advertise-host, else the bind host,
        else (bound to a wildcard) this machine's address."""
        if self.advertise_host:
            return self.advertise_host
        if self.host not in _WILDCARD_HOSTS:
            return self.host
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"
