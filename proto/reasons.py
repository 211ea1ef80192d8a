"""Reason text one process reads in another's error details: part of the
contract, so named once here. Plain Python, no project imports (see
proto/__init__.py: this package is the contract every other package may import).
"""

from __future__ import annotations

# Why a decode pod fails a split whose head's sender went away (a split
# cannot restart: its tail may have read the layers a new sender would
# overwrite). Starts with kv_transfer's `Reason.SENDER_LOST`, so the pod's
# transfer-failure metric counts it under that code. The router keeps such a
# decode pod a candidate for the request's next attempt: the head failed,
# not the pod (router/flow/pd_path.py).
SPLIT_HEAD_LOST = "sender_lost: mid-split"
