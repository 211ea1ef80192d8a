"""The TCP connector's frame format (version 1): a fixed header, then the payload.

Header, little-endian, 104 bytes (`HEADER.size`):

    offset size field
    0      4    magic  b"PDKV"
    4      2    version (1)
    6      1    kind   (FrameKind)
    7      1    flags  (STATUS: bit 0 = ok; DATA: bit 1 = checksum is XXH3-64;
                        BEGIN: bit 2 = the payload ends with a token offset,
                        bit 3 = ... and then with a head range,
                        bit 4 = ... and then with a W3C traceparent)
    8      2    request id length in bytes (1..64)
    10     2    reserved, 0
    12     4    layer
    16     8    byte offset within the layer (DATA)
    24     8    payload length
    32     8    xxhash64 (seed 0) of the payload (XXH3-64 if DATA flag bit 1)
    40     64   request id, UTF-8, zero-padded (fixed size keeps the header fixed)

Payloads:
    BEGIN   layers u32, tokens u32, kv heads u32, head dim u32, dtype code u8,
            ticket length u16, ticket bytes, attempt id (the rest, 0..16 bytes:
            the sender's random id of this sending attempt; every stream of one
            attempt carries the same id, a retry from another pod a new one);
            with BEGIN flag bit 2 (FLAG_TOKEN_OFFSET) the last 4 bytes are instead
            the layout's token offset u32 (cache-miss-only transfer: row 0 is that
            context token; without the flag it is 0, as in every earlier sender);
            with BEGIN flag bit 3 (FLAG_HEAD_RANGE, a head-ranged layout) the
            last 20 bytes (after the token offset, if any) are head_start u32,
            model_kv_heads u32, sub_start u32, sub_end u32, num_senders u32: the
            layout holds heads [head_start, head_start + kv heads) of the
            model's model_kv_heads, head-major; this sender writes the
            layout-local heads [sub_start, sub_end), one of num_senders senders
            of this attempt (kv_transfer/layout.py);
            with BEGIN flag bit 4 (FLAG_TRACE) the last 55 bytes (after all of
            the above) are the sender's W3C traceparent, ASCII
            ("00-<trace id>-<span id>-<flags>": docs/tracing.md), so the decode
            pod's receive span joins the request's trace. Without the flag the
            BEGIN is byte for byte what earlier senders send; a receiver that
            does not trace drops the tail.
    DATA    raw bytes of the layer's transfer layout at [offset, offset + length)
    END     first token i32, total byte count u64
    ABORT   reason, UTF-8
    STATUS  reason, UTF-8 (empty when ok). Receiver -> sender only: the back
            channel. Sent on the connection that carried END (verdict), or on
            every connection that carried BEGIN when the transfer fails.

Frames are self-delimiting, so a refused frame (unknown request, failed
transfer) is skipped by reading past its payload and the connection stays in
sync. A header that cannot be trusted (magic, version, length over the limit)
closes the connection instead.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from kv_transfer.base import DTYPE_CODES, MAX_TICKET_BYTES, KVLayout
from kv_transfer.checksum import checksum
from kv_transfer.errors import Reason, TransferRefused
from kv_transfer.layout import SenderPart
from kv_transfer.refusals import PortRefusal
from kv_transfer.wire import (
    FLAG_HEAD_RANGE,
    FLAG_TRACE,
    MAX_ATTEMPT_BYTES,
    MAX_DATA_BYTES,
    VERSION,
)
from proto.request_id import MAX_REQUEST_ID_BYTES
from telemetry.context import TRACEPARENT_BYTES, parse_traceparent

MAGIC = b"PDKV"
HEADER = struct.Struct(f"<4sHBBHHIQQQ{MAX_REQUEST_ID_BYTES}s")
MAX_CONTROL_BYTES = 4096  # BEGIN, END, ABORT, STATUS payloads
FLAG_OK = 1  # STATUS only; DATA's checksum flag is checksum.FLAG_XXH3
# BEGIN only: a u32 token offset ends the payload. Set only when the offset is
# not 0, so a whole-context BEGIN is byte for byte what version-1 senders send.
FLAG_TOKEN_OFFSET = 4

_BEGIN = struct.Struct("<IIIIBH")
_END = struct.Struct("<iQ")
_TOKEN_OFFSET = struct.Struct("<I")
_HEAD_RANGE = struct.Struct("<IIIII")
_DTYPE_NAMES = {code: name for name, code in DTYPE_CODES.items()}


class FrameKind(enum.IntEnum):
    BEGIN = 1
    DATA = 2
    END = 3
    ABORT = 4
    STATUS = 5


@dataclass(frozen=True, slots=True)
class FrameHeader:
    kind: FrameKind
    request_id: str
    layer: int = 0
    offset: int = 0
    length: int = 0
    checksum: int = 0
    flags: int = 0

    def pack(self) -> bytes:
        rid = self.request_id.encode()
        return HEADER.pack(
            MAGIC, VERSION, self.kind, self.flags, len(rid), 0,
            self.layer, self.offset, self.length, self.checksum, rid,
        )  # fmt: skip


class HeaderError(Exception):
    """The header cannot be trusted; the connection must be closed (no resync possible).
    `reason` is the refusal counted on /metrics (kv_transfer/refusals.py)."""

    def __init__(self, reason: PortRefusal, detail: str) -> None:
        self.reason = reason
        super().__init__(detail)


def decode_header(raw: bytes | memoryview) -> FrameHeader:
    """Parse and bound-check a header; raises HeaderError."""
    magic, version, kind, flags, rid_len, _, layer, offset, length, checksum, rid = (
        HEADER.unpack(raw)
    )
    if magic != MAGIC:
        raise HeaderError(PortRefusal.BAD_MAGIC, f"bad magic {magic!r}")
    if version != VERSION:
        raise HeaderError(PortRefusal.BAD_VERSION,
                          f"frame version {version}, this receiver speaks {VERSION}")
    try:
        kind = FrameKind(kind)
    except ValueError:
        raise HeaderError(PortRefusal.BAD_KIND, f"unknown frame kind {kind}") from None
    limit = MAX_DATA_BYTES if kind is FrameKind.DATA else MAX_CONTROL_BYTES
    if length > limit:
        raise HeaderError(PortRefusal.OVERSIZED_LENGTH,
                          f"{kind.name} payload of {length} bytes exceeds {limit}")
    if not 0 < rid_len <= MAX_REQUEST_ID_BYTES:
        raise HeaderError(PortRefusal.BAD_REQUEST_ID,
                          f"request id length {rid_len} outside 1..{MAX_REQUEST_ID_BYTES}")
    try:
        request_id = bytes(rid[:rid_len]).decode()
    except UnicodeDecodeError:
        raise HeaderError(PortRefusal.BAD_REQUEST_ID, "request id is not UTF-8") from None
    return FrameHeader(kind, request_id, layer, offset, length, checksum, flags)


def control_frame(kind: FrameKind, request_id: str, payload: bytes, flags: int = 0) -> bytes:
    """Header + payload of a small frame, checksummed."""
    header = FrameHeader(kind, request_id, length=len(payload), checksum=checksum(payload),
                         flags=flags)  # fmt: skip
    return header.pack() + payload


def begin_flags(layout: KVLayout, traceparent: str = "") -> int:
    """The header flags of `layout`'s BEGIN frame (see `encode_begin`)."""
    return ((FLAG_TOKEN_OFFSET if layout.token_offset else 0)
            | (FLAG_HEAD_RANGE if layout.head_ranged else 0)
            | (FLAG_TRACE if traceparent else 0))  # fmt: skip


def encode_begin(layout: KVLayout, ticket: bytes, attempt: bytes,
                 part: SenderPart | None = None, traceparent: str = "") -> bytes:  # fmt: skip
    """BEGIN's payload; send it with `begin_flags(layout, traceparent)`. `part`
    (None = every head, one sender) travels only for a head-ranged layout;
    `traceparent` ("" = none) only when given, and must be a valid one."""
    if traceparent and parse_traceparent(traceparent) is None:
        raise ValueError(f"traceparent {traceparent!r} is not a W3C version-00 traceparent")
    if len(attempt) > MAX_ATTEMPT_BYTES:
        raise ValueError(f"attempt id is {len(attempt)} bytes, the limit is {MAX_ATTEMPT_BYTES}")
    part = part or SenderPart.whole(layout)
    if not part.fits(layout):
        raise ValueError(f"{part} is not a part of {layout.describe()}")
    head_range = b""
    if layout.head_ranged:
        head_range = _HEAD_RANGE.pack(layout.head_start, layout.model_kv_heads, part.sub_start,
                                      part.sub_end, part.num_senders)  # fmt: skip
    return (
        _BEGIN.pack(
            layout.num_layers, layout.num_tokens, layout.num_kv_heads, layout.head_dim,
            DTYPE_CODES[layout.dtype], len(ticket),
        )
        + ticket
        + attempt
        + (_TOKEN_OFFSET.pack(layout.token_offset) if layout.token_offset else b"")
        + head_range
        + traceparent.encode("ascii")
    )  # fmt: skip


def _take_tail(payload: bytes, tail: struct.Struct, what: str) -> tuple[bytes, tuple]:
    """Split the fixed-size `tail` off the end of a BEGIN payload."""
    if len(payload) < _BEGIN.size + tail.size:
        raise TransferRefused(Reason.BAD_FRAME, f"BEGIN payload too short for its {what}")
    return payload[: len(payload) - tail.size], tail.unpack_from(payload, len(payload) - tail.size)


def begin_traceparent(payload: bytes, flags: int) -> str:
    """The traceparent a BEGIN carries (FLAG_TRACE); "" when none or not a valid one."""
    if not flags & FLAG_TRACE or len(payload) < _BEGIN.size + TRACEPARENT_BYTES:
        return ""
    try:
        value = bytes(payload[len(payload) - TRACEPARENT_BYTES:]).decode("ascii")
    except UnicodeDecodeError:
        return ""
    return value if parse_traceparent(value) is not None else ""


def decode_begin(payload: bytes,
                 flags: int = 0) -> tuple[KVLayout, bytes, bytes, SenderPart]:  # fmt: skip
    """BEGIN payload (and its header's flags) -> (layout, ticket, attempt, this
    sender's part); raises TransferRefused(bad_frame). A traceparent
    (FLAG_TRACE) is skipped here: `begin_traceparent` reads it."""
    if flags & FLAG_TRACE:
        payload = payload[: len(payload) - TRACEPARENT_BYTES]
    token_offset = head_start = model_kv_heads = 0
    sub: tuple[int, int, int] | None = None
    if flags & FLAG_HEAD_RANGE:
        payload, (head_start, model_kv_heads, *rest) = _take_tail(payload, _HEAD_RANGE,
                                                                  "head range")  # fmt: skip
        sub = tuple(rest)
    if flags & FLAG_TOKEN_OFFSET:
        payload, (token_offset,) = _take_tail(payload, _TOKEN_OFFSET, "token offset")
    if len(payload) < _BEGIN.size:
        raise TransferRefused(Reason.BAD_FRAME, "BEGIN payload too short")
    layers, tokens, heads, head_dim, dtype_code, ticket_len = _BEGIN.unpack_from(payload)
    attempt_len = len(payload) - _BEGIN.size - ticket_len
    if ticket_len > MAX_TICKET_BYTES or not 0 <= attempt_len <= MAX_ATTEMPT_BYTES:
        raise TransferRefused(Reason.BAD_FRAME, "BEGIN ticket length does not match payload")
    if dtype_code not in _DTYPE_NAMES:
        raise TransferRefused(Reason.BAD_FRAME, f"unknown dtype code {dtype_code}")
    try:
        layout = KVLayout(layers, tokens, heads, head_dim, _DTYPE_NAMES[dtype_code],
                          token_offset, head_start, model_kv_heads)  # fmt: skip
        part = SenderPart(*sub) if sub is not None else SenderPart.whole(layout)
    except ValueError as exc:
        raise TransferRefused(Reason.BAD_FRAME, str(exc)) from None
    if sub is not None and not layout.head_ranged:
        raise TransferRefused(Reason.BAD_FRAME, "BEGIN head range with model_kv_heads 0")
    end = _BEGIN.size + ticket_len
    return layout, bytes(payload[_BEGIN.size : end]), bytes(payload[end:]), part


def encode_end(first_token_id: int, total_bytes: int) -> bytes:
    return _END.pack(first_token_id, total_bytes)


def decode_end(payload: bytes) -> tuple[int, int]:
    if len(payload) != _END.size:
        raise TransferRefused(Reason.BAD_FRAME, f"END payload is {len(payload)} bytes")
    return _END.unpack(payload)
