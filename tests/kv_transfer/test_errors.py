"""The reason a decode pod fails a split's lost head with (proto/reasons.py)
is one of kv_transfer's reason codes, so the pod's failure metric counts it
under that code, not as "other"."""

from __future__ import annotations

from kv_transfer.errors import Reason, reason_code
from proto.reasons import SPLIT_HEAD_LOST


def test_a_split_head_lost_is_counted_as_sender_lost():
    assert reason_code(f"{SPLIT_HEAD_LOST} (connection_lost: mid-payload)") == Reason.SENDER_LOST
