"""Each fault on the gRPC KV connector's link (prefill pod -> `grpc_decode`'s
KVTransfer port, through `stack.grpc_kv`), the request driven as the router
drives it (tests/integration/flows.py), since that pod is outside the router.

Expected: latency changes nothing but time; a lost or cut stream, corrupted
KV and a black hole each end the prefill call with ABORTED and the reason,
before the transfer's deadline; both pods end at baseline (the fixture).
The router's handling of such an ABORTED (moving the request) is shown on
the TCP link, tests/faults/test_kv_faults.py.
"""

from __future__ import annotations

import itertools
import random
import re
import time

import grpc
import pytest

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc
from tests.faults.conftest import RESERVATION_TIMEOUT_S
from tests.faults.proxy import Fault
from tests.integration.flows import disaggregated_generate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

PROMPT = [random.Random(3).randrange(5, 1100) for _ in range(600)]  # ~1.2 MiB of KV
GREEDY = pb.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
VERDICT_GRACE_S = 2.0  # kv_transfer.config.SenderConfig.verdict_grace_s
_ids = itertools.count()


def _run(faults, fault: Fault | None = None):
    """(tokens, None) or (None, RpcError), and the seconds it took."""
    if fault is not None:
        faults.grpc_kv.set_fault(fault)
        faults.grpc_kv.reset_all()  # the prefill pod's channel reconnects through it
    started = time.monotonic()
    with grpc.insecure_channel(faults.grpc_decode.address) as dc, \
            grpc.insecure_channel(faults.prefill.address) as pc:
        try:
            got = disaggregated_generate(
                pdserve_pb2_grpc.PrefillStub(pc), pdserve_pb2_grpc.DecodeStub(dc),
                f"grpc-kv-{next(_ids)}", PROMPT, GREEDY)
            return got.token_ids, None, time.monotonic() - started
        except grpc.RpcError as exc:
            return None, exc, time.monotonic() - started


@pytest.mark.parametrize("fault", [Fault(latency_s=0.01), Fault(bytes_per_s=4e6)],
                         ids=["latency", "bandwidth"])
def test_a_slow_grpc_kv_link_keeps_the_output_exact(faults, fault):
    expected, error, _ = _run(faults)
    assert error is None, error
    got, error, _ = _run(faults, fault)
    assert error is None, error.details()
    assert got == expected


# Whichever of the 2 streams notices first names itself; or the receiver,
# having dropped the attempt when it lost one stream, says so on the other
# first (the STATUS can beat the sender's own notice of the loss).
_LOST = (r"(connection_lost: stream [01]: StatusCode\.UNAVAILABLE"
         r"|superseded: attempt of 'grpc-kv-\d+' was dropped)")


@pytest.mark.parametrize(("fault", "reason"), [
    (Fault(drop_after_bytes=50_000), _LOST),
    (Fault(truncate_after_bytes=50_000), _LOST),
    # every connection is corrupted at its byte 30,000; which layer's chunk that
    # falls in depends on which of the 2 streams carried which layer first
    (Fault(corrupt_at_byte=30_000), r"bad_checksum: layer [01] offset 0"),
], ids=["drop", "truncate", "corrupt-kv"])
def test_a_broken_grpc_kv_stream_aborts_the_prefill_with_the_reason(faults, fault, reason):
    triggered = faults.grpc_kv.triggered  # the proxy's count runs over the whole package
    _, error, seconds = _run(faults, fault)
    assert error is not None and error.code() == grpc.StatusCode.ABORTED
    assert re.fullmatch(r"KV transfer of grpc-kv-\d+ to 127\.0\.0\.2:\d+ failed: " + reason,
                        error.details()), error.details()
    assert faults.grpc_kv.triggered > triggered
    assert seconds < RESERVATION_TIMEOUT_S


def test_a_black_holed_grpc_kv_link_aborts_at_the_deadline(faults):
    _, error, seconds = _run(faults, Fault(black_hole=True))
    assert error is not None and error.code() == grpc.StatusCode.ABORTED
    # either the streams' own gRPC deadline or the sender's sweep (the same
    # deadline plus its grace for a verdict) ends it first: both name the deadline
    assert re.search(r"(connection_lost: stream [01]: StatusCode\.DEADLINE_EXCEEDED"
                     r"|deadline: no verdict before the deadline)$",
                     error.details()), error.details()
    # the target's deadline (the reservation's) plus the sender's grace for a verdict
    assert seconds < RESERVATION_TIMEOUT_S + VERDICT_GRACE_S + 2
