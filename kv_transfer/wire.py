"""What both connectors' wire formats share: the protocol version and limits.

The TCP frame format itself is `kv_transfer/tcp/frames.py`; gRPC carries the
same frames as `KVFrame` messages (`kv_transfer/grpc/codec.py`). Checksums are
`kv_transfer/checksum.py`.
"""

from __future__ import annotations

VERSION = 1  # TCP header version, KVFrame.version; a receiver refuses any other
MAX_DATA_BYTES = 64 << 20  # one DATA frame's payload; senders slice below this
# BEGIN's attempt id: the sender's random id of one sending attempt (every stream
# of the attempt carries the same id, a retry from another pod a new one)
MAX_ATTEMPT_BYTES = 16
# BEGIN flag: the layout is head-ranged (KVLayout.head_ranged) and BEGIN carries its
# head fields and this sender's part (SenderPart). Never set for a whole-model
# layout, so a TP=1 BEGIN is byte for byte what earlier senders send.
FLAG_HEAD_RANGE = 8
# BEGIN flag: BEGIN carries the request's W3C traceparent (TCP: the payload's
# last 55 bytes; gRPC: KVFrame field 24), so the decode pod's spans join its
# trace (docs/tracing.md). Set only for a traced request.
FLAG_TRACE = 16
