import pytest

from kv_transfer.base import KVLayout
from kv_transfer.checksum import checksum
from kv_transfer.errors import Reason, TransferRefused
from kv_transfer.layout import SenderPart
from kv_transfer.tcp.frames import (
    FLAG_TOKEN_OFFSET,
    HEADER,
    MAX_CONTROL_BYTES,
    FrameHeader,
    FrameKind,
    HeaderError,
    begin_flags,
    control_frame,
    decode_begin,
    decode_end,
    decode_header,
    encode_begin,
    encode_end,
)
from kv_transfer.wire import FLAG_HEAD_RANGE


def test_header_roundtrip():
    header = FrameHeader(FrameKind.DATA, "réq-1", 5, 4096, 8192, 0xDEADBEEFCAFEF00D)
    raw = header.pack()
    assert len(raw) == HEADER.size == 104
    assert raw[:4] == b"PDKV"
    assert decode_header(raw) == header


@pytest.mark.parametrize(
    "patch, message",
    [
        ((0, b"XXXX"), "magic"),
        ((4, b"\x02\x00"), "version"),
        ((6, b"\x09"), "kind"),
        ((8, b"\x00\x00"), "request id length"),
        ((8, b"\x41\x00"), "request id length"),
        ((24, (MAX_CONTROL_BYTES + 1).to_bytes(8, "little")), "exceeds"),
    ],
)
def test_bad_headers(patch, message):
    raw = bytearray(FrameHeader(FrameKind.END, "r", length=12).pack())
    at, value = patch
    raw[at : at + len(value)] = value
    with pytest.raises(HeaderError, match=message):
        decode_header(bytes(raw))


def test_begin_and_end_payloads():
    layout = KVLayout(3, 17, 2, 64, "float16")
    assert decode_begin(encode_begin(layout, b"ticket", b"")) == (layout, b"ticket", b"",
                                                             SenderPart(0, 2, 1))
    assert decode_end(encode_end(-1, 123456789012)) == (-1, 123456789012)
    bad = bytearray(encode_begin(layout, b"ticket", b""))
    bad[16] = 9  # dtype code
    with pytest.raises(TransferRefused) as info:
        decode_begin(bytes(bad))
    assert info.value.code is Reason.BAD_FRAME
    with pytest.raises(TransferRefused):
        decode_begin(encode_begin(layout, b"ticket", b"")[:-1])
    with pytest.raises(TransferRefused):
        decode_end(b"\x00" * 11)


def test_begin_with_a_token_offset_carries_it_behind_the_attempt_id():
    whole = KVLayout(3, 17, 2, 64, "float16")
    tail = KVLayout(3, 17, 2, 64, "float16", token_offset=48)
    # a whole-context BEGIN is what version-1 senders send: no flag, no trailer
    assert begin_flags(whole) == 0
    assert encode_begin(whole, b"ticket", b"attempt1") == encode_begin(
        KVLayout(3, 17, 2, 64, "float16"), b"ticket", b"attempt1")
    assert begin_flags(tail) == FLAG_TOKEN_OFFSET
    payload = encode_begin(tail, b"ticket", b"attempt1")
    assert payload[-4:] == (48).to_bytes(4, "little")
    assert decode_begin(payload, FLAG_TOKEN_OFFSET) == (tail, b"ticket", b"attempt1",
                                                        SenderPart(0, 2, 1))
    # read without the flag, the trailer is part of the attempt id and the offset 0:
    # the receiver then refuses the layout (layout_mismatch), never misplaces rows
    layout, _, attempt, _ = decode_begin(payload)
    assert layout == whole and attempt == b"attempt1" + (48).to_bytes(4, "little")
    with pytest.raises(TransferRefused, match="too short for its token offset"):
        decode_begin(payload[:10], FLAG_TOKEN_OFFSET)


def test_control_frame_checksum():
    frame = control_frame(FrameKind.ABORT, "r", b"gone")
    header = decode_header(frame[: HEADER.size])
    assert header.length == 4 and header.checksum == checksum(b"gone")
    assert frame[HEADER.size :] == b"gone"



def test_begin_of_a_head_ranged_layout_carries_its_heads_and_part():
    layout = KVLayout(3, 17, 2, 64, "float16", token_offset=48, head_start=4, model_kv_heads=8)
    assert begin_flags(layout) == FLAG_TOKEN_OFFSET | FLAG_HEAD_RANGE == 12
    part = SenderPart(1, 2, 2)
    payload = encode_begin(layout, b"ticket", b"attempt1", part)
    assert payload[-20:] == b"".join(v.to_bytes(4, "little") for v in (4, 8, 1, 2, 2))
    assert payload[-24:-20] == (48).to_bytes(4, "little")
    assert decode_begin(payload, begin_flags(layout)) == (layout, b"ticket", b"attempt1", part)
    # without a part: the sender writes every head alone
    whole = encode_begin(layout, b"t", b"a")
    assert decode_begin(whole, begin_flags(layout))[3] == SenderPart(0, 2, 1)
    with pytest.raises(ValueError, match="not a part"):
        encode_begin(layout, b"t", b"a", SenderPart(1, 3, 2))
    with pytest.raises(ValueError, match="not a part"):  # a whole-model layout has no parts
        encode_begin(KVLayout(3, 17, 2, 64, "float16"), b"t", b"a", SenderPart(0, 1, 2))
    with pytest.raises(TransferRefused, match="too short for its head range"):
        decode_begin(payload[:24], FLAG_HEAD_RANGE)
    bad = bytearray(payload)
    bad[-8:-4] = (0).to_bytes(4, "little")  # sub_end 0: an empty part
    with pytest.raises(TransferRefused, match="sub_end"):
        decode_begin(bytes(bad), begin_flags(layout))
    bad = bytearray(payload)
    bad[-16:-12] = (0).to_bytes(4, "little")  # model_kv_heads 0 with a head range
    with pytest.raises(TransferRefused) as info:
        decode_begin(bytes(bad), begin_flags(layout))
    assert info.value.code is Reason.BAD_FRAME
