"""OpenTelemetry tracing for one pdserve process: off unless asked for.

Every role's command calls `setup(TraceConfig.from_args(...), role=...)`
once before it serves. Tracing is on when an OTLP endpoint is given
(`--otlp-endpoint URL`, or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT /
OTEL_EXPORTER_OTLP_ENDPOINT); only then are the OpenTelemetry SDK and its
OTLP/gRPC exporter imported and a TracerProvider made, with a
BatchSpanProcessor that exports off the serving threads and is flushed at
exit (`shutdown`, registered with atexit). Off, `tracer()` is None and the
code that makes spans (telemetry.spans, the servicers, router/flow/) skips
all of it: no exporter, no provider, no SDK import.

Sampling: parent-based (a sampled or unsampled parent decides; a new root
is sampled with --trace-sample-ratio, default 1.0). Without the flag,
OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG choose as the SDK reads them.
Resource: service.name `pdserve-<role>` (OTEL_SERVICE_NAME wins), plus
pdserve.role, pdserve.address, pdserve.model and OTEL_RESOURCE_ATTRIBUTES;
service.instance.id `<address>/<instance>` for a process that is one of
several serving one address (a router worker, router/workers.py).

One provider per process, never shared across a fork: its exporter's gRPC
channel and its batch thread belong to the process that made them. A forked
child forgets the parent's (tracing is off there until it calls `setup`
itself); `pdserve router --workers N` spawns its workers, and each calls
`setup` with its own instance.
"""

from __future__ import annotations

import atexit
import logging
import os
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

ENDPOINT_ENV = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
SAMPLER_ENV = "OTEL_TRACES_SAMPLER"
INSTRUMENTATION = "pdserve"

_tracer: Any = None  # the process's Tracer; None: tracing is off
_provider: Any = None


@dataclass(frozen=True, slots=True)
class TraceConfig:
    """`endpoint`: the OTLP/gRPC collector URL ("" = the OTEL_* environment
    decides; nothing there = off). `sample_ratio`: the ratio of new traces
    sampled (None = OTEL_TRACES_SAMPLER or 1.0)."""

    endpoint: str = ""
    sample_ratio: float | None = None

    def __post_init__(self) -> None:
        if self.sample_ratio is not None and not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError(f"--trace-sample-ratio must be in [0, 1], got {self.sample_ratio}")

    def resolved_endpoint(self, environ=os.environ) -> str:
        """The endpoint in force: the flag's, else the environment's; "" = off."""
        if self.endpoint:
            return self.endpoint
        return next((environ[name] for name in ENDPOINT_ENV if environ.get(name)), "")


def add_flags(parser) -> None:
    """--otlp-endpoint and --trace-sample-ratio on a role's argparse parser."""
    parser.add_argument(
        "--otlp-endpoint", default="", metavar="URL",
        help="send OpenTelemetry traces over OTLP/gRPC to URL (e.g. "
             "http://collector:4317); default: OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT, "
             "unset = tracing off (docs/tracing.md)")
    parser.add_argument(
        "--trace-sample-ratio", type=float, default=None, metavar="R",
        help="ratio of new traces sampled, parent-based (default 1.0, or "
             "OTEL_TRACES_SAMPLER/_ARG)")


def config_from_args(args) -> TraceConfig:
    return TraceConfig(endpoint=getattr(args, "otlp_endpoint", "") or "",
                       sample_ratio=getattr(args, "trace_sample_ratio", None))


def setup(config: TraceConfig, *, role: str, address: str = "", model: str = "",
          instance: str = "") -> bool:
    """Turn tracing on for this process when `config` (or the environment)
    names an endpoint; True when it is on. Called once per process.
    `instance`: this process among several serving `address` (e.g.
    "worker-1"), which makes its service.instance.id distinct."""
    global _tracer, _provider
    endpoint = config.resolved_endpoint()
    if not endpoint or _tracer is not None:
        return _tracer is not None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    attributes = {"pdserve.role": role, "pdserve.address": address, "pdserve.model": model}
    if instance:
        attributes["service.instance.id"] = f"{address}/{instance}" if address else instance
    if not os.environ.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = f"pdserve-{role}"
    sampler = None  # the SDK reads OTEL_TRACES_SAMPLER(_ARG)
    if config.sample_ratio is not None or not os.environ.get(SAMPLER_ENV):
        ratio = 1.0 if config.sample_ratio is None else config.sample_ratio
        sampler = ParentBased(TraceIdRatioBased(ratio))
    provider = TracerProvider(resource=Resource.create(attributes), sampler=sampler)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    _provider = provider
    _tracer = provider.get_tracer(INSTRUMENTATION)
    atexit.register(shutdown)
    log.info("tracing on: %s spans to %s over OTLP/gRPC", attributes.get("service.name",
             os.environ.get("OTEL_SERVICE_NAME")), endpoint)
    return True


def tracer():
    """The process's tracer; None when tracing is off (make no spans)."""
    return _tracer


def flush(timeout_ms: int = 5000) -> None:
    """Export what is buffered now (a draining pod, before it exits)."""
    if _provider is not None:
        _provider.force_flush(timeout_ms)


def _forget_after_fork() -> None:
    """In a forked child: the parent's provider is not this process's (its
    exporter's channel and batch thread stayed in the parent); tracing is off
    until this process sets up its own. Nothing is flushed or shut down here:
    that would act on the parent's objects."""
    global _tracer, _provider
    _tracer = _provider = None


os.register_at_fork(after_in_child=_forget_after_fork)


def shutdown() -> None:
    """Flush and stop the exporter; tracing is off afterwards."""
    global _tracer, _provider
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()
