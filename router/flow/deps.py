"""What every request flow shares: `FlowSettings` and `FlowDeps`.

Built once by the router server (router.server) and passed to each
`router.flow.request_flow.RequestFlow`; everything in it is used on the
router's event loop only.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.metrics import RouterMetrics
from router.pod_channels import PodChannels
from router.routing.admission import PrefillAdmission
from router.routing.base import PodPool
from router.routing.colocated_gate import ColocatedGate
from router.routing.local_prefill import LocalPrefill
from router.routing.policy import RoutingPolicy
from router.routing.split_prefill import SplitPrefill


@dataclass(frozen=True, slots=True)
class FlowSettings:
    """The flow's limits, taken from RouterConfig."""

    max_prefill_retries: int = 2
    max_migrations: int = 3
    request_timeout: float = 600.0

    def __post_init__(self) -> None:
        if self.max_prefill_retries < 0:
            raise ValueError(f"max_prefill_retries must be >= 0, got {self.max_prefill_retries}")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")
        if self.request_timeout <= 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {self.request_timeout}")


@dataclass(frozen=True, slots=True)
class FlowDeps:
    """The router-wide objects a flow uses; owned by the router server."""

    pool: PodPool
    policy: RoutingPolicy
    channels: PodChannels
    metrics: RouterMetrics
    settings: FlowSettings
    admission: PrefillAdmission
    local_prefill: LocalPrefill | None = None  # None: every P/D request takes the P/D path
    split: SplitPrefill | None = None  # None: no prompt is split across the pods
    colocated_gate: ColocatedGate | None = None  # None: colocated pods shed nothing
