"""`RouterConfig`: the router's validated configuration.

Built once by `pdserve router` (pdserve/commands/router.py) or `pdserve up`
from flags, then handed to `router.server.RouterServer`; nothing below the
command layer sees argparse or reads the environment. Immutable, so any
task or thread may read it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from proto.address import MAX_PORT, split_host_port
from proto.roles import PodRole
from proto.tls import PodSecurity, TlsFiles
from router.routing.split_prefill import SplitSettings
from router.settings import (
    ROUTER_ADMISSION,
    ROUTER_FLOW,
    ROUTER_LOCAL_PREFILL,
    AdmissionSettings,
    FlowSettings,
    LocalPrefillSettings,
)

RELAYS = ("session", "stream")
# router/routing/cache_aware.py's modes (repeated here: the config imports no routing code)
ROUTING_POLICIES = ("first-tokens", "session-sticky", "cache-aware", "round-robin")
# router/tools/select.py's choices (repeated, as above)
TOOL_CALL_PARSERS = ("auto", "llama3_json", "hermes")


def _check_port(name: str, port: int, *, allow_zero: bool = True) -> None:
    low = 0 if allow_zero else 1
    if not isinstance(port, int) or isinstance(port, bool) or not low <= port <= MAX_PORT:
        raise ValueError(f"{name} must be an integer port in [{low}, {MAX_PORT}], got {port!r}")


def _check_addresses(name: str, addresses: tuple[str, ...]) -> None:
    for address in addresses:
        split_host_port(address, f"{name} entries")
    if len(set(addresses)) != len(addresses):
        raise ValueError(f"{name} lists an address twice: {', '.join(addresses)}")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Everything the router needs to serve.

    `prefill`, `decode` and `colocated` are static pod addresses; with
    `redis_url` the pods register themselves instead (both may be combined).
    `max_model_len` None means: `max_position_embeddings` from the model's
    config.json (see `resolve_max_model_len`).
    """

    model_dir: str
    served_model_name: str = ""
    host: str = "0.0.0.0"
    port: int = 8000
    grpc_port: int = 50050
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    colocated: tuple[str, ...] = ()
    redis_url: str | None = None
    api_key: str | None = None
    # Named keys with limits, reloaded when the file changes (router/api_keys.py);
    # exclusive with api_key.
    api_keys_file: str | None = None
    session_epsilon: float = 0.25
    load_poll_interval: float = 0.5
    # "push": each pod's WatchLoad stream (polled only for health, and where the
    # stream is down); "poll": GetLoad from every pod every interval
    # (router/registry/poller.py).
    load_reports: str = "push"
    # A pod missing from the Redis registry but still answering its polls stays
    # routable this long (router/registry/poller.py; a registry restored empty).
    registry_absent_grace: float = 10.0
    # Prefill retries, migrations and the request timeout (router/flow/).
    flow: FlowSettings = ROUTER_FLOW
    max_model_len: int | None = None
    # Seconds SIGTERM waits for in-flight requests before closing anyway.
    shutdown_grace: float = 30.0
    # The admission queue in front of the prefill pods and the shedding limit
    # (router/routing/admission.py; the limit at colocated pods too).
    admission: AdmissionSettings = ROUTER_ADMISSION
    # How tokens come back from decode/colocated pods: "session" (one
    # Decode.Session per pod, one message per engine step) or "stream" (one
    # Decode.Generate stream per request, one message per token; the A/B
    # baseline, and what pods without Session get anyway).
    relay: str = "session"
    # Worker processes serving the same ports (SO_REUSEPORT; router/workers.py).
    workers: int = 1
    # prometheus_client multiprocess directory (set by the CLI when workers > 1):
    # /metrics of any worker sums every worker's samples.
    metrics_dir: str | None = None
    # When a decode pod prefills a prompt itself (router/routing/local_prefill.py:
    # the idle side, and conditional disaggregation below `below`); its
    # report_age is set by the router server from load_poll_interval.
    local_prefill: LocalPrefillSettings = ROUTER_LOCAL_PREFILL
    # One prompt on both pods (router/routing/split_prefill.py).
    split_prefill: SplitSettings = SplitSettings()
    # TLS of the public HTTP and gRPC listeners (with a CA: client certificates
    # required), and how the router reaches its pods (docs/deploy.md, Security).
    tls: TlsFiles | None = None
    pod_security: PodSecurity = field(default_factory=PodSecurity)
    # Where a request no session mapping decides goes (router/routing/cache_aware.py):
    # first-tokens | session-sticky | cache-aware | round-robin; and the prefix
    # index's bound, in block hashes per pod (router/cache_index/index.py).
    routing_policy: str = "first-tokens"
    cache_index_blocks: int = 262_144
    # cache-aware: a prefill pod's queued tokens count this much against the
    # tokens its cache saves (router/routing/cache_aware.py)
    cache_aware_load_weight: float = 1.0
    # HTTP connections (router/http/connection.py): seconds from a request's
    # first byte to the end of its headers, and seconds an open connection may
    # wait for its next request. Generation requests in flight per client (API
    # key, else address; router/http/client_limits.py), 0 = no limit.
    http_header_timeout: float = 30.0
    http_keepalive_timeout: float = 75.0
    max_concurrent_per_client: int = 0
    # How tool calls are read from chat replies (router/tools/select.py):
    # auto (from the chat template) | llama3_json | hermes.
    tool_call_parser: str = "auto"

    def __post_init__(self) -> None:
        if not self.model_dir:
            raise ValueError("model_dir must name the model directory (for the tokenizer)")
        _check_port("port", self.port)
        _check_port("grpc_port", self.grpc_port)
        for role in PodRole:  # the fields named after the roles
            _check_addresses(role.value, getattr(self, role.value))
        if self.redis_url is not None and not self.redis_url.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise ValueError(
                f"redis_url must start with redis://, rediss:// or unix://, got {self.redis_url!r}"
            )
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty (leave it unset to disable auth)")
        if self.api_key is not None and self.api_keys_file is not None:
            raise ValueError("give either api_key (one key) or api_keys_file (named keys), "
                             "not both")
        if not 0.0 <= self.session_epsilon <= 10.0:
            raise ValueError(f"session_epsilon must be in [0, 10], got {self.session_epsilon}")
        if self.load_reports not in ("push", "poll"):
            raise ValueError(f"load_reports must be 'push' or 'poll', got {self.load_reports!r}")
        if not 0.01 <= self.load_poll_interval <= 60.0:
            raise ValueError(
                f"load_poll_interval must be in [0.01, 60] seconds, got {self.load_poll_interval}"
            )
        if not 0.0 <= self.registry_absent_grace <= 3600.0:
            raise ValueError(f"registry_absent_grace must be in [0, 3600] seconds, "
                             f"got {self.registry_absent_grace}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not 1 <= self.workers <= 256:
            raise ValueError(f"workers must be in [1, 256], got {self.workers}")
        if self.relay not in RELAYS:
            raise ValueError(f"relay must be one of {', '.join(RELAYS)}, got {self.relay!r}")
        if self.tls is not None and self.tls.cert_file is None:
            raise ValueError("tls needs a certificate and key file for the router's listeners")
        if not 0.0 <= self.cache_aware_load_weight <= 100.0:
            raise ValueError(f"cache_aware_load_weight must be in [0, 100], "
                             f"got {self.cache_aware_load_weight}")
        if self.routing_policy not in ROUTING_POLICIES:
            raise ValueError(f"routing_policy must be one of {', '.join(ROUTING_POLICIES)}, "
                             f"got {self.routing_policy!r}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")
        if not 1 <= self.cache_index_blocks <= 1 << 26:
            raise ValueError(f"cache_index_blocks must be in [1, {1 << 26}], "
                             f"got {self.cache_index_blocks}")
        for name in ("http_header_timeout", "http_keepalive_timeout"):
            if not 0.0 < getattr(self, name) <= 3600.0:
                raise ValueError(f"{name} must be in (0, 3600] seconds, got {getattr(self, name)}")
        if not 0 <= self.max_concurrent_per_client <= 1 << 20:
            raise ValueError(f"max_concurrent_per_client must be in [0, {1 << 20}] (0 = off), "
                             f"got {self.max_concurrent_per_client}")
        if self.shutdown_grace < 0:
            raise ValueError(f"shutdown_grace must be >= 0 seconds, got {self.shutdown_grace}")

    @property
    def model_name(self) -> str:
        """The name clients put in `model`: --served-model-name, else the directory name."""
        return self.served_model_name or Path(self.model_dir).name

    def resolve_max_model_len(self) -> int:
        """The context limit requests are checked against: the explicit
        `max_model_len`, else `max_position_embeddings` from config.json.

        Read with json here, not engine.model_config, so the router never
        pulls in engine modules beyond the tokenizer."""
        if self.max_model_len is not None:
            return self.max_model_len
        path = Path(self.model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"{path} does not exist: --model must be a model directory") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None
        value = raw.get("max_position_embeddings")
        if not isinstance(value, int) or value < 2:
            raise ValueError(
                f"{path}: max_position_embeddings must be an integer >= 2, got {value!r}"
            )
        return value
