"""The router's groups of settings, each defined and validated here once.

`router.config.RouterConfig` nests one of each (with `SplitSettings`, which
lives beside its rule in router/routing/split_prefill.py); the modules that
use a group take it validated and do not check it again, and the CLI
(pdserve/commands/router.py) takes its flags' defaults from `ROUTER_*`
below. Plain dataclasses with no project imports, so the CLI can read the
defaults without loading the router.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    """The admission queue in front of the prefill pods
    (router/routing/admission.py) and the shedding limit both it and the
    colocated gate (router/routing/colocated_gate.py) apply.

    `dispatch_tokens`: prompt tokens this router lets be outstanding at one
    prefill pod (0: no queue, dispatch at once; --prefill-dispatch-tokens).
    `dispatch_seconds`: work at the pod's learnt throughput that may wait
    there behind the prompt it computes, beyond one prompt (0: tokens only;
    --prefill-dispatch-seconds). `max_queue_wait`: seconds of estimated wait
    until a new request's prompt is computed beyond which it is refused with
    429 (--max-queue-wait)."""

    dispatch_tokens: int = 4096
    dispatch_seconds: float = 1.0
    max_queue_wait: float = 30.0

    def __post_init__(self) -> None:
        if not 0 <= self.dispatch_tokens <= 1 << 24:
            raise ValueError(f"prefill dispatch tokens must be in [0, {1 << 24}], "
                             f"got {self.dispatch_tokens}")
        if not 0.0 <= self.dispatch_seconds <= 3600.0:
            raise ValueError(f"prefill dispatch seconds must be in [0, 3600], "
                             f"got {self.dispatch_seconds}")
        if not 0.0 < self.max_queue_wait <= 86400.0:
            raise ValueError(f"max queue wait must be in (0, 86400] seconds, "
                             f"got {self.max_queue_wait}")


@dataclass(frozen=True, slots=True)
class FlowSettings:
    """One request's limits in router/flow/: extra prefill pods tried against
    one decode reservation (--max-prefill-retries), moves to a new pod pair
    after its decode pod failed, each re-prefilling prompt + output so far
    (--max-migrations), and seconds for the whole request (--request-timeout)."""

    max_prefill_retries: int = 2
    max_migrations: int = 3
    request_timeout: float = 600.0
    trace_history: int = 1000  # finished requests' timelines kept (--trace-history; 0 = off)

    def __post_init__(self) -> None:
        if not 0 <= self.max_prefill_retries <= 16:
            raise ValueError(
                f"max_prefill_retries must be in [0, 16], got {self.max_prefill_retries}")
        if not 0 <= self.max_migrations <= 16:
            raise ValueError(f"max_migrations must be in [0, 16], got {self.max_migrations}")
        if not 0.0 < self.request_timeout <= 86400.0:
            raise ValueError(
                f"request_timeout must be in (0, 86400] seconds, got {self.request_timeout}")
        if not 0 <= self.trace_history <= 1_000_000:
            raise ValueError(f"trace_history must be in [0, 1000000], got {self.trace_history}")


@dataclass(frozen=True, slots=True)
class LocalPrefillSettings:
    """When a decode pod prefills a prompt itself (router/routing/local_prefill.py,
    whose docstring names N, R, T and W). `max_tokens`: N (0 = off;
    --local-prefill-max-tokens). `queue_ratio`: R (--local-prefill-queue-ratio).
    `below`: T (0 = off; --local-prefill-below). `min_wait`: W (0 = off;
    --local-prefill-min-wait). `report_age`: how old a pod's load report can
    be (the router sets twice its load poll interval). `within_budget`: a
    reservation lets its decode pod compute the prompt when the pod caches
    more of it than the prefill pod and the rest fits the pod's inter-token
    budget (--local-prefill-within-budget; engine/local_rule.py). `warm`: a turn a
    decode pod computed that way is computed again in the background on its
    prefill pod, so that cache stays whole (--local-prefill-warm;
    router/flow/prefill_warm.py). `warm_answers`: after a P/D turn of a request
    with a session id, its prefill pod computes the answer in the background
    the same way, so the session's next turn finds it cached there
    (--warm-session-answers).

    The class's defaults are the rule off; the router's are `ROUTER_LOCAL_PREFILL`."""

    max_tokens: int = 0
    queue_ratio: float = 1.0
    below: int = 0
    min_wait: float = 0.0
    report_age: float = 1.0
    within_budget: bool = False
    warm: bool = False
    warm_answers: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.max_tokens <= 1 << 20:
            raise ValueError(f"local prefill max tokens must be in [0, {1 << 20}], "
                             f"got {self.max_tokens}")
        if not 0.0 <= self.queue_ratio <= 1000.0:
            raise ValueError(f"local prefill queue ratio must be in [0, 1000], "
                             f"got {self.queue_ratio}")
        if not 0 <= self.below <= 1 << 20:
            raise ValueError(f"local prefill below must be in [0, {1 << 20}], got {self.below}")
        if not 0.0 <= self.min_wait <= 3600.0:
            raise ValueError(f"local prefill min wait must be in [0, 3600] seconds, "
                             f"got {self.min_wait}")
        if not 0.0 <= self.report_age <= 3600.0:
            raise ValueError(f"local prefill report age must be in [0, 3600] seconds, "
                             f"got {self.report_age}")

    @property
    def enabled(self) -> bool:
        return bool(self.max_tokens or self.below)

    @property
    def budget(self) -> int:
        """Tokens of local prefills at most computing on one decode pod at a time."""
        return max(self.max_tokens, self.below)


# The router's defaults (RouterConfig's, and so the flags'): the idle side on
# for prompts of up to 2048 new tokens, behind a 2 s wait at the prefill pod
# (docs/router.md, "Use the idle side"), and a decode pod computes a next
# turn whose history it holds when that fits its ITL budget, and the prefill
# pods compute such turns and sessions' answers while idle (docs/routing.md);
# the others are the classes' own.
ROUTER_ADMISSION = AdmissionSettings()
ROUTER_FLOW = FlowSettings()
ROUTER_LOCAL_PREFILL = LocalPrefillSettings(max_tokens=2048, min_wait=2.0, within_budget=True,
                                            warm=True, warm_answers=True)
