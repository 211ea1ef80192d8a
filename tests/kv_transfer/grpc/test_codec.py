"""kv_transfer.grpc.codec against the generated protobuf classes (the reference)."""

from __future__ import annotations

import random
import time

import grpc
import pytest

from kv_transfer.base import KVLayout
from kv_transfer.config import ReceiverConfig
from kv_transfer.grpc import GrpcKVReceiver
from kv_transfer.grpc.codec import Malformed, WireFrame, decode_frame, encode_data_frame
from proto import pdserve_pb2
from tests.kv_transfer.grpc.test_grpc import begin_frame
from tests.kv_transfer.helpers import RecordingListener, wait_until

pytestmark = pytest.mark.timeout(60)
FIELDS = [f.name for f in pdserve_pb2.KVFrame.DESCRIPTOR.fields]


def _random_message(rng: random.Random) -> pdserve_pb2.KVFrame:
    """Every field set (or left at zero) at random, extremes included."""
    def num(bits: int) -> int:
        return rng.choice([0, 1, 127, 128, (1 << bits) - 1, rng.getrandbits(bits)])

    def text() -> str:
        return "".join(rng.choice("ab\u00e9\u4e2d\U0001f600") for _ in range(rng.randrange(6)))

    return pdserve_pb2.KVFrame(
        version=num(32), kind=rng.randrange(6), request_id=text(), layer=num(32),
        offset=num(64), payload=rng.randbytes(rng.choice([0, 1, 300, 70000])),
        checksum=num(64), ticket=rng.randbytes(rng.randrange(40)), num_layers=num(32),
        num_tokens=num(32), num_kv_heads=num(32), head_dim=num(32), dtype=text(),
        first_token_id=rng.choice([0, -1, -(1 << 31), (1 << 31) - 1, rng.randrange(1 << 20)]),
        total_bytes=num(64), reason=text(), flags=num(32), token_offset=num(32),
        head_start=num(32), model_kv_heads=num(32), sub_start=num(32), sub_end=num(32),
        num_senders=num(32),
    )  # fmt: skip


def _as_plain(frame) -> dict:
    out = {}
    for name in FIELDS:
        value = getattr(frame, name)
        out[name] = bytes(value) if isinstance(value, (bytes, memoryview)) else value
    return out


def test_decode_equals_protobuf_for_random_messages():
    rng = random.Random(1)
    for _ in range(300):
        message = _random_message(rng)
        decoded = decode_frame(message.SerializeToString())
        assert isinstance(decoded, WireFrame)
        assert _as_plain(decoded) == _as_plain(message)


def test_encoded_data_frames_parse_with_protobuf():
    rng = random.Random(2)
    for _ in range(200):
        payload = memoryview(rng.randbytes(rng.choice([0, 5, 4096, 100_000])))
        fields = dict(version=rng.choice([0, 1, 7]), kind=rng.randrange(6),
                      request_id=rng.choice(["", "req-1", "\u00e9t\u00e9"]),
                      layer=rng.randrange(1 << 32), offset=rng.randrange(1 << 64),
                      checksum=rng.randrange(1 << 64), flags=rng.choice([0, 2]))  # fmt: skip
        data = encode_data_frame(payload=payload, **fields)
        parsed = pdserve_pb2.KVFrame.FromString(data)
        assert _as_plain(parsed) == _as_plain(pdserve_pb2.KVFrame(payload=bytes(payload), **fields))
        assert _as_plain(decode_frame(data)) == _as_plain(parsed)


def test_payload_is_a_view_of_the_message_not_a_copy():
    data = pdserve_pb2.KVFrame(kind=2, payload=b"x" * 1000).SerializeToString()
    frame = decode_frame(data)
    assert isinstance(frame.payload, memoryview) and frame.payload.obj is data


def test_unknown_fields_are_skipped():
    base = pdserve_pb2.KVFrame(kind=2, request_id="r", payload=b"abc", checksum=9)
    unknown = bytes([99 << 3 & 0x7F | 0x80, 99 >> 4, 5,  # field 99 varint 5
                     100 << 3 & 0x7F | 0x80 | 1, 100 >> 4, *b"12345678",  # fixed64
                     101 << 3 & 0x7F | 0x80 | 5, 101 >> 4, *b"1234",  # fixed32
                     102 << 3 & 0x7F | 0x80 | 2, 102 >> 4, 3, *b"xyz"])  # fmt: skip
    data = base.SerializeToString() + unknown
    assert _as_plain(pdserve_pb2.KVFrame.FromString(data)) == _as_plain(base)
    assert _as_plain(decode_frame(data)) == _as_plain(base)


@pytest.mark.parametrize("data, why", [
    (bytes([2 << 3 | 2, 1, 0]), "field 2 has wire type 2"),       # kind as bytes
    (bytes([6 << 3 | 0, 1]), "field 6 has wire type 0"),          # payload as varint
    (bytes([3 << 3 | 2, 2, 0xFF, 0xFE]), "not UTF-8"),           # request_id
    (bytes([6 << 3 | 2, 10, 1, 2]), "past the end"),              # short payload
    (bytes([1 << 3, 0x80]), "truncated"),                         # varint cut short
    (bytes([1 << 3]) + b"\xff" * 10 + b"\x01", "overlong"),       # 11-byte varint
    (bytes([99 << 3 & 0x7F | 0x80 | 3, 99 >> 4]), "wire type 3"),  # group start
    (bytes([99 << 3 & 0x7F | 0x80 | 1, 99 >> 4, 1, 2]), "past the end"),  # fixed64 cut
])  # fmt: skip
def test_malformed_bytes_are_named(data, why):
    decoded = decode_frame(data)
    assert isinstance(decoded, Malformed) and why in decoded.why


def test_random_and_truncated_bytes_never_raise():
    rng = random.Random(3)
    valid = _random_message(rng).SerializeToString()
    for cut in range(len(valid)):
        assert isinstance(decode_frame(valid[:cut]), (WireFrame, Malformed))
    for _ in range(3000):
        data = rng.randbytes(rng.randrange(64))
        if rng.random() < 0.5:
            data = bytearray(valid[: rng.randrange(len(valid) + 1)])
            for _ in range(rng.randint(1, 4)):
                if data:
                    data[rng.randrange(len(data))] = rng.randrange(256)
            data = bytes(data)
        decoded = decode_frame(data)
        assert isinstance(decoded, (WireFrame, Malformed))
        try:
            reference = pdserve_pb2.KVFrame.FromString(data)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError; we may be stricter
            continue
        if isinstance(decoded, WireFrame):  # where both accept, both agree
            assert _as_plain(decoded) == _as_plain(reference)


def test_a_malformed_message_fails_its_stream_and_the_receiver_keeps_serving():
    listener = RecordingListener()
    receiver = GrpcKVReceiver(ReceiverConfig(capacity_bytes=1 << 20), listener)
    receiver.start()
    try:
        layout = KVLayout(2, 4, 1, 4, "float32")
        target = receiver.expect("m", layout, time.time() + 30)
        channel = grpc.insecure_channel(receiver.endpoints[0])
        push = channel.stream_unary("/pdserve.v1.KVTransfer/Push", request_serializer=None,
                                    response_deserializer=pdserve_pb2.PushResult.FromString)
        begin = begin_frame("m", layout, target.ticket).SerializeToString()
        result = push(iter([begin, bytes([6 << 3 | 0, 1])]), timeout=30)
        assert (result.ok, result.reason) == (
            False, "bad_frame: field 6 has wire type 0, expected 2")  # fmt: skip
        assert listener.wait_event("m", "restart")[1].startswith("sender_lost: bad_frame")
        first = push(iter([bytes([1 << 3, 0x80])]), timeout=30)  # garbage before BEGIN
        assert (first.ok, first.reason) == (False, "bad_frame: truncated or overlong varint")
        assert receiver.cancel("m", "test over")
        assert wait_until(lambda: receiver.stats().bytes_in_use == 0, timeout=10)
        channel.close()
    finally:
        receiver.close()

