"""Random and hostile gRPC messages to every service the pods and the router
serve (tests/faults/stack.py's pods, called directly, no proxy): random bytes
as the request, well-formed messages with random field values, and messages
made only of fields the service does not declare (tests/faults/proto_strategies.py).

Properties: every call ends with a status in `EXPECTED` (a refusal, a
deadline, or OK), never UNKNOWN or INTERNAL (an unhandled exception) or a
dead server; afterwards the pods are back at baseline and serve exactly
(the `faults` fixture). Calls carry a short deadline: a random request may
legitimately wait (a reservation waiting for its KV) or run (a long
generation, a `CacheEvents.Subscribe` stream that never ends by itself), and
the client giving up is part of what is fuzzed.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proto import pdserve_pb2 as pb
from tests.faults.proto_strategies import messages, unknown_fields

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

FUZZ = settings(max_examples=25, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])
CALL_TIMEOUT_S = 1.0
C = grpc.StatusCode
EXPECTED = {C.OK, C.INVALID_ARGUMENT, C.RESOURCE_EXHAUSTED, C.NOT_FOUND, C.ABORTED,
            C.DEADLINE_EXCEEDED, C.FAILED_PRECONDITION, C.OUT_OF_RANGE, C.UNIMPLEMENTED,
            C.UNAVAILABLE, C.CANCELLED, C.UNAUTHENTICATED, C.PERMISSION_DENIED}
# grpc.aio's own answer to a unary request that does not parse, given before
# any servicer code runs (the project's servicers map a streamed one that does
# not parse to INVALID_ARGUMENT, proto/status.py)
UNPARSABLE = (C.UNKNOWN, "Unexpected <class 'google.protobuf.message.DecodeError'>: "
                         "Error parsing message with type ")

# (pod, method, request class, kind): kind is how the method is called
METHODS = [
    ("prefill", "/pdserve.v1.Prefill/Prefill", pb.PrefillRequest, "unary_stream"),
    ("prefill", "/pdserve.v1.Prefill/Abort", pb.AbortRequest, "unary_unary"),
    ("prefill", "/pdserve.v1.Prefill/GetLoad", pb.LoadRequest, "unary_unary"),
    ("prefill", "/pdserve.v1.CacheEvents/Subscribe", pb.CacheEventsRequest, "unary_stream"),
    ("decode", "/pdserve.v1.Decode/Generate", pb.DecodeGenerateRequest, "unary_stream"),
    ("decode", "/pdserve.v1.Decode/Session", pb.SessionCommand, "stream_stream"),
    ("decode", "/pdserve.v1.Decode/Abort", pb.AbortRequest, "unary_unary"),
    ("decode", "/pdserve.v1.Decode/GetLoad", pb.LoadRequest, "unary_unary"),
    ("decode", "/pdserve.v1.CacheEvents/Subscribe", pb.CacheEventsRequest, "unary_stream"),
    ("grpc_decode", "/pdserve.v1.KVTransfer/Push", pb.KVFrame, "stream_unary"),
    ("decode", "/grpc.health.v1.Health/Check", health_pb2.HealthCheckRequest, "unary_unary"),
    ("router", "/pdserve.v1.Router/Generate", pb.GenerateRequest, "unary_stream"),
    ("router", "/pdserve.v1.Router/ListModels", pb.ListModelsRequest, "unary_unary"),
]
IDS = [f"{pod}:{method.rsplit('.', 1)[1]}" for pod, method, _, _ in METHODS]


def _address(faults, pod: str) -> str:
    if pod == "router":
        return faults.router.grpc_address
    return getattr(faults, pod).address


def _call(channel: grpc.Channel, method: str, kind: str, payloads: list[bytes]) -> grpc.StatusCode:
    """Send serialized `payloads` (one for unary requests) and read the answer
    to its end; returns the final status."""
    callable_ = getattr(channel, kind)(method, request_serializer=None,
                                       response_deserializer=None)
    request = iter(payloads) if kind.startswith("stream") else payloads[0]
    try:
        reply = callable_(request, timeout=CALL_TIMEOUT_S)
        if kind.endswith("stream"):
            for _ in reply:
                pass
    except grpc.RpcError as exc:
        if exc.code() == UNPARSABLE[0] and exc.details().startswith(UNPARSABLE[1]):
            return C.INVALID_ARGUMENT
        assert exc.code() in EXPECTED, (method, exc.code(), exc.details())
        return exc.code()
    return C.OK


@pytest.mark.parametrize(("pod", "method", "request_class", "kind"), METHODS,
                         ids=IDS)
def test_random_field_values(faults, pod, method, request_class, kind):
    with grpc.insecure_channel(_address(faults, pod)) as channel:
        @FUZZ
        @given(requests=st.lists(messages(request_class), min_size=1, max_size=3))
        def check(requests) -> None:
            _call(channel, method, kind, [r.SerializeToString() for r in requests])

        check()


@pytest.mark.parametrize(("pod", "method", "request_class", "kind"), METHODS,
                         ids=IDS)
def test_random_bytes_as_the_request(faults, pod, method, request_class, kind):
    with grpc.insecure_channel(_address(faults, pod)) as channel:
        @FUZZ
        @given(payloads=st.lists(st.binary(max_size=200), min_size=1, max_size=3))
        def check(payloads) -> None:
            _call(channel, method, kind, payloads)

        check()


@pytest.mark.parametrize("pod", ["prefill", "decode"])
def test_subscribe_with_only_unknown_fields_gets_the_snapshot(faults, pod):
    """`CacheEventsRequest` declares no field, so any well-formed message is a
    subscription (a newer router's request, as this pod parses it): the pod
    opens the stream with its snapshot, then holds it until the caller's deadline
    (each example waits for it: fewer of them)."""
    with grpc.insecure_channel(_address(faults, pod)) as channel:
        subscribe = channel.unary_stream("/pdserve.v1.CacheEvents/Subscribe",
                                         request_serializer=None,
                                         response_deserializer=pb.CacheEventBatch.FromString)

        @settings(FUZZ, max_examples=4)
        @given(payload=unknown_fields(pb.CacheEventsRequest))
        def check(payload: bytes) -> None:
            batches = []
            with pytest.raises(grpc.RpcError) as ended:
                for batch in subscribe(payload, timeout=CALL_TIMEOUT_S):
                    batches.append(batch)
            assert ended.value.code() == C.DEADLINE_EXCEEDED, ended.value.details()
            # the snapshot first; nothing else happens on an idle pod
            assert len(batches) == 1, batches
            snapshot = batches[0]
            assert (snapshot.snapshot, snapshot.role, snapshot.block_size, snapshot.address,
                    list(snapshot.evicted)) == (True, pod, 16, "", [])
            assert snapshot.generation > 0

        check()
