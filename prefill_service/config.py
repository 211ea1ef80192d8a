"""`PrefillConfig`: the one validated configuration of a prefill pod, built
by `pdserve prefill` from its flags (the service never sees argparse)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig
from pod.config import ServerConfig

MAX_KV_STREAMS = 64
@dataclass(frozen=True, slots=True)
class PrefillConfig:
    """Engine, listening settings and the KV sender's stream count.

    A prefill pod sends each request's KV over `kv_streams` parallel
    connections to the decode pod (DESIGN.md "Wire contracts"); at
    `engine.tensor_parallel_size` N > 1 every rank sends its own KV heads
    so, each rank over its own `kv_streams` connections per decode rank
    (docs/tensor_parallel.md, "Prefill ranks").
    """

    engine: EngineConfig
    server: ServerConfig
    kv_streams: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.kv_streams <= MAX_KV_STREAMS:
            raise ValueError(f"kv_streams must be in [1, {MAX_KV_STREAMS}], got {self.kv_streams}")
