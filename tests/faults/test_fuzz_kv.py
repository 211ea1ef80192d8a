"""Hostile bytes on the decode pod's KV port (tests/faults/stack.py's TCP
decode pod, dialled directly): random bytes, forged frames (any kind, any
field, a forged ticket, for the request id of a reservation that is waiting
for its real KV), and a real transfer's recorded bytes replayed; and forged
KVTransfer.Push streams for the gRPC connector's pod.

Properties: the pod refuses them and keeps serving; a reservation that was
attacked while it waited still gets its real KV and decodes exactly what an
undisturbed run decodes; afterwards the pod holds no block, landing byte,
thread or socket beyond its baseline (the `faults` fixture).
The connector-level fuzz is tests/kv_transfer/tcp/test_tcp_failures.py.
"""

from __future__ import annotations

import random
import socket

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_transfer.base import KVLayout
from kv_transfer.checksum import FLAG_XXH3, checksum
from kv_transfer.tcp.frames import HEADER, MAGIC, FrameHeader, FrameKind, encode_begin, encode_end
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc
from tests.integration.flows import disaggregated_generate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

FUZZ = settings(max_examples=20, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])
GREEDY = pb.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = [random.Random(5).randrange(5, 1100) for _ in range(200)]
# the tiny model's transfer layout for PROMPT: 2 layers, 2 KV heads of 64, float32
LAYOUT = KVLayout(2, len(PROMPT), 2, 64, "float32")


def _send(port: int, data: bytes) -> None:
    """Send `data` to the KV port and read until the pod closes or goes quiet:
    a refusal may close the connection before everything is sent."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(0.5)
            while sock.recv(65536):
                pass
        except OSError:  # reset, or quiet past the timeout: both are answers
            pass


kinds = st.sampled_from(list(FrameKind)) | st.integers(0, 255)
layouts = st.builds(KVLayout, st.integers(1, 4), st.integers(1, 300), st.integers(1, 4),
                    st.sampled_from([32, 64]), st.sampled_from(["float32", "bfloat16"]))
payloads = (st.binary(max_size=300)
            | st.builds(encode_begin, layouts | st.just(LAYOUT), st.binary(min_size=1, max_size=80),
                        st.binary(max_size=16))
            | st.builds(encode_end, st.integers(-(2**31), 2**31 - 1), st.integers(0, 2**64 - 1)))


@st.composite
def forged_frames(draw, request_id: str) -> bytes:
    """A frame with a well-formed header (mostly) and anything inside."""
    payload = draw(payloads)
    kind = draw(kinds)
    length = draw(st.just(len(payload)) | st.integers(0, 2**64 - 1))
    digest = draw(st.just(checksum(payload)) | st.integers(0, 2**64 - 1))
    rid = draw(st.just(request_id) | st.text(min_size=1, max_size=16))
    header = FrameHeader(FrameKind.DATA, rid, draw(st.integers(0, 2**32 - 1)),
                         draw(st.integers(0, 2**64 - 1)), length, digest,
                         draw(st.integers(0, 255))).pack()
    kind_byte = bytes([kind if isinstance(kind, int) else int(kind)])
    header = header[:6] + kind_byte + header[7:]
    if draw(st.booleans()):  # now and then a broken magic or version
        header = draw(st.sampled_from([b"XXXX", MAGIC])) + header[4:]
    return header + payload


def test_random_bytes_on_the_kv_port_are_refused(faults):
    @FUZZ
    @given(data=st.binary(min_size=1, max_size=2 * HEADER.size + 200))
    def check(data: bytes) -> None:
        _send(faults.decode.kv_port, data)

    check()


def test_forged_frames_for_a_waiting_reservation_do_not_disturb_it(faults):
    with grpc.insecure_channel(faults.decode.address) as dc, \
            grpc.insecure_channel(faults.prefill.address) as pc:
        decode, prefill = pdserve_pb2_grpc.DecodeStub(dc), pdserve_pb2_grpc.PrefillStub(pc)
        expected = disaggregated_generate(prefill, decode, "forge-ref", PROMPT, GREEDY).token_ids
        counter = iter(range(10**6))

        @FUZZ
        @given(data=st.data())
        def check(data) -> None:
            request_id = f"forge-{next(counter)}"
            frames = data.draw(st.lists(forged_frames(request_id), min_size=1, max_size=4))
            got = disaggregated_generate(
                prefill, decode, request_id, PROMPT, GREEDY,
                before_prefill=lambda: _send(faults.decode.kv_port, b"".join(frames)))
            assert got.token_ids == expected

        check()


def test_a_recorded_transfer_replayed_is_refused(faults):
    faults.kv.record_limit = 4 << 20
    faults.kv.recordings.clear()
    faults.kv.reset_all()  # the prefill pod's next transfer opens recorded connections
    with grpc.insecure_channel(faults.decode.address) as dc, \
            grpc.insecure_channel(faults.prefill.address) as pc:
        decode, prefill = pdserve_pb2_grpc.DecodeStub(dc), pdserve_pb2_grpc.PrefillStub(pc)
        expected = disaggregated_generate(prefill, decode, "replay-0", PROMPT, GREEDY).token_ids
        faults.kv.record_limit = 0
        recorded = [bytes(r) for r in faults.kv.recordings if r]
        assert sum(map(len, recorded)) > LAYOUT.num_layers * 2 * len(PROMPT) * 2 * 64 * 4

        @FUZZ
        @given(which=st.integers(0, len(recorded) - 1), start=st.integers(0, 10**6),
               cut=st.integers(0, 10**7), during=st.booleans())
        def check(which: int, start: int, cut: int, during: bool) -> None:
            """A replayed slice of a recorded stream (from its start or not),
            after the transfer, or while another request waits for its own KV."""
            stream = recorded[which]
            piece = stream[:cut] if start % 2 else stream[start % len(stream):][:cut]
            if during:
                got = disaggregated_generate(prefill, decode, f"replay-{start}-{cut}", PROMPT,
                                             GREEDY, before_prefill=lambda: _send(
                                                 faults.decode.kv_port, piece))
                assert got.token_ids == expected
            else:
                _send(faults.decode.kv_port, piece)

        check()


def test_forged_grpc_kv_frames_for_a_waiting_reservation_do_not_disturb_it(faults):
    """The gRPC connector's KVTransfer.Push: streams of frames with random
    fields, aimed at the request id of a reservation waiting for its KV."""
    from tests.faults.proto_strategies import messages

    frames = messages(pb.KVFrame)
    with grpc.insecure_channel(faults.grpc_decode.address) as dc, \
            grpc.insecure_channel(faults.prefill.address) as pc:
        decode, prefill = pdserve_pb2_grpc.DecodeStub(dc), pdserve_pb2_grpc.PrefillStub(pc)
        expected = disaggregated_generate(prefill, decode, "gforge-ref", PROMPT, GREEDY).token_ids
        counter = iter(range(10**6))

        @FUZZ
        @given(data=st.data())
        def check(data) -> None:
            request_id = f"gforge-{next(counter)}"
            forged = data.draw(st.lists(frames, min_size=1, max_size=4))
            for frame in forged:  # now and then plausible enough to reach the ticket check
                if data.draw(st.booleans()):
                    frame.request_id = request_id
                if data.draw(st.booleans()):
                    frame.version, frame.flags = 1, frame.flags & ~FLAG_XXH3
                    frame.checksum = checksum(frame.payload)

            def push() -> None:
                with grpc.insecure_channel(f"127.0.0.1:{faults.grpc_decode.kv_port}") as kc:
                    try:
                        pdserve_pb2_grpc.KVTransferStub(kc).Push(iter(forged), timeout=5)
                    except grpc.RpcError as exc:  # a refusal is an answer
                        assert exc.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                              grpc.StatusCode.PERMISSION_DENIED,
                                              grpc.StatusCode.ABORTED,
                                              grpc.StatusCode.FAILED_PRECONDITION,
                                              grpc.StatusCode.UNAUTHENTICATED), exc

            got = disaggregated_generate(prefill, decode, request_id, PROMPT, GREEDY,
                                         before_prefill=push)
            assert got.token_ids == expected

        check()
