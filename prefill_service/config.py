"""`PrefillConfig`: the one validated configuration of a prefill pod, built
by `pdserve prefill` from its flags (the service never sees argparse), and
`parse_size`, the byte-size syntax all pod flags share ("2GiB", "512MiB")."""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine.config import EngineConfig
from prefill_service.pod import ServerConfig

MAX_KV_STREAMS = 64
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
class PrefillConfig:
    """Engine, listening settings and the KV sender's stream count.

    A prefill pod sends each request's KV over `kv_streams` parallel
    connections to the decode pod (DESIGN.md "Wire contracts").
    """

    engine: EngineConfig
    server: ServerConfig
    kv_streams: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.kv_streams <= MAX_KV_STREAMS:
            raise ValueError(f"kv_streams must be in [1, {MAX_KV_STREAMS}], got {self.kv_streams}")
