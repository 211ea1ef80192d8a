"""What every request flow shares: `FlowDeps` (with its `FlowSettings`,
router/settings.py).

Built once by the router server (router.server) and passed to each
`router.flow.request_flow.RequestFlow`; everything in it is used on the
router's event loop only.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.flow.prefill_warm import PrefillWarmer
from router.metrics import RouterMetrics
from router.pod_channels import PodChannels
from router.routing.admission import PrefillAdmission
from router.routing.base import PodPool
from router.routing.colocated_gate import ColocatedGate
from router.routing.local_prefill import LocalPrefill
from router.routing.policy import RoutingPolicy
from router.routing.split_prefill import SplitPrefill
from router.settings import FlowSettings
from telemetry.history import History


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
    warmer: PrefillWarmer | None = None  # None: no turn a decode pod computed is warmed
    # finished requests' timelines (GET /debug/requests/{id}); made from
    # settings.trace_history when not given
    history: History | None = None

    def __post_init__(self) -> None:
        if self.history is None:
            object.__setattr__(self, "history", History(self.settings.trace_history))
