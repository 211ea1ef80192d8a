"""`KVFrame` on the wire without protobuf's payload copies.

Protobuf's Python messages copy a `bytes` field when it is set, when the
message is serialized, when it is parsed and again on every read of the
field: four copies of each multi-MiB DATA payload across one gRPC hop. The
connector instead hands gRPC bytes it encoded itself (one copy: the payload
joined behind its fields) and parses what gRPC hands back into a `WireFrame`
whose payload is a memoryview of gRPC's own buffer (no copy; the servicer's
copy into the landing buffer is the only one on the receiving side).

The bytes are the standard protobuf encoding of `pdserve.v1.KVFrame`
(proto/pdserve.proto), so a peer using the generated classes interoperates
both ways. Parsing is stricter than protobuf's: a known field with the wrong
wire type, a truncated or overlong varint, a length past the end, a group or
non-UTF-8 text makes the whole message `MALFORMED`, which the servicer
refuses as `bad_frame` (protobuf would have aborted the call instead).
Unknown fields of the four plain wire types are skipped, as protobuf does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5
_U32, _U64 = (1 << 32) - 1, (1 << 64) - 1

# field number -> (attribute, wire type, kind): kind u32/u64/i32 for varints,
# "text" and "bytes" for length-delimited fields (proto/pdserve.proto KVFrame)
_FIELDS = {
    1: ("version", _VARINT, "u32"),
    2: ("kind", _VARINT, "i32"),
    3: ("request_id", _LEN, "text"),
    4: ("layer", _VARINT, "u32"),
    5: ("offset", _VARINT, "u64"),
    6: ("payload", _LEN, "bytes"),
    7: ("checksum", _VARINT, "u64"),
    8: ("ticket", _LEN, "bytes"),
    9: ("num_layers", _VARINT, "u32"),
    10: ("num_tokens", _VARINT, "u32"),
    11: ("num_kv_heads", _VARINT, "u32"),
    12: ("head_dim", _VARINT, "u32"),
    13: ("dtype", _LEN, "text"),
    14: ("first_token_id", _VARINT, "i32"),
    15: ("total_bytes", _VARINT, "u64"),
    16: ("reason", _LEN, "text"),
    17: ("flags", _VARINT, "u32"),
    18: ("token_offset", _VARINT, "u32"),
    19: ("head_start", _VARINT, "u32"),
    20: ("model_kv_heads", _VARINT, "u32"),
    21: ("sub_start", _VARINT, "u32"),
    22: ("sub_end", _VARINT, "u32"),
    23: ("num_senders", _VARINT, "u32"),
    # BEGIN with flags bit 4 (FLAG_TRACE) only: the request's W3C traceparent
    # (docs/tracing.md; `string traceparent = 24` in proto/pdserve.proto),
    # appended by `trace_field`
    24: ("traceparent", _LEN, "text"),
}
TRACEPARENT_FIELD = 24


@dataclass(slots=True)
class WireFrame:
    """A parsed KVFrame; the same attribute names as the generated class, but
    `payload` and `ticket` are memoryviews into the received message."""

    version: int = 0
    kind: int = 0
    request_id: str = ""
    layer: int = 0
    offset: int = 0
    payload: memoryview = field(default_factory=lambda: memoryview(b""))
    checksum: int = 0
    ticket: memoryview = field(default_factory=lambda: memoryview(b""))
    num_layers: int = 0
    num_tokens: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    dtype: str = ""
    first_token_id: int = 0
    total_bytes: int = 0
    reason: str = ""
    flags: int = 0
    token_offset: int = 0
    head_start: int = 0
    model_kv_heads: int = 0
    sub_start: int = 0
    sub_end: int = 0
    num_senders: int = 0
    traceparent: str = ""


class Malformed:
    """What `decode_frame` returns for bytes that are not a KVFrame."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


class _Truncated(Exception):
    pass


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """(value, next position); at most 10 bytes, as protobuf allows."""
    value = shift = 0
    for i in range(at, min(at + 10, len(data))):
        byte = data[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            if value > _U64:
                raise _Truncated("varint over 64 bits")
            return value, i + 1
        shift += 7
    raise _Truncated("truncated or overlong varint")


def decode_frame(data: bytes) -> WireFrame | Malformed:
    """gRPC's request deserializer for `Push`: never raises."""
    frame = WireFrame()
    view = memoryview(data)
    at, end = 0, len(data)
    try:
        while at < end:
            tag, at = _varint(data, at)
            number, wire = tag >> 3, tag & 7
            known = _FIELDS.get(number)
            if known is not None and known[1] != wire:
                return Malformed(f"field {number} has wire type {wire}, expected {known[1]}")
            if wire == _VARINT:
                value, at = _varint(data, at)
            elif wire == _LEN:
                length, at = _varint(data, at)
                if at + length > end:
                    return Malformed(f"field {number}: {length} bytes past the end")
                value, at = view[at : at + length], at + length
            elif wire in (_FIXED64, _FIXED32):
                at += 8 if wire == _FIXED64 else 4
                if at > end:
                    return Malformed(f"field {number}: fixed-width value past the end")
                continue  # never a known field (checked above)
            else:
                return Malformed(f"field {number}: unsupported wire type {wire}")
            if known is None:
                continue  # unknown field: skipped, as protobuf does
            name, _, kind = known
            if kind == "u32":
                value &= _U32
            elif kind == "i32":  # int32 and enums: two's complement, low 32 bits
                value &= _U32
                value = value - (1 << 32) if value >> 31 else value
            elif kind == "text":
                value = bytes(value).decode("utf-8")
            setattr(frame, name, value)
    except _Truncated as exc:
        return Malformed(str(exc))
    except UnicodeDecodeError:
        return Malformed("a text field is not UTF-8")
    return frame


def _put_varint(out: bytearray, value: int) -> None:
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def encode_data_frame(version: int, kind: int, request_id: str, layer: int, offset: int,
                      checksum: int, payload: memoryview, flags: int = 0) -> bytes:  # fmt: skip
    """A DATA KVFrame's encoding: the fields, then the payload joined behind them
    (its one copy). Zero-valued fields are omitted, as protobuf does."""
    head = bytearray()
    fields = ((1, version), (2, kind), (4, layer), (5, offset), (7, checksum), (17, flags))
    for number, value in fields:
        if value:
            _put_varint(head, number << 3)
            _put_varint(head, value)
    rid = request_id.encode()
    if rid:
        _put_varint(head, 3 << 3 | _LEN)
        _put_varint(head, len(rid))
        head += rid
    if len(payload):
        _put_varint(head, 6 << 3 | _LEN)
        _put_varint(head, len(payload))
    return b"".join((head, payload))


def trace_field(traceparent: str) -> bytes:
    """Field 24 (the traceparent) of a KVFrame, to append to a serialized BEGIN
    (protobuf concatenates fields; a parser that does not know 24 skips it)."""
    value = traceparent.encode("ascii")
    out = bytearray()
    _put_varint(out, TRACEPARENT_FIELD << 3 | _LEN)
    _put_varint(out, len(value))
    return bytes(out) + value
