"""KV transfer between prefill and decode pods: interfaces, TCP and gRPC connectors.

Public API (see docs/kv_transfer.md):

    from kv_transfer import KVLayout, TransferTarget, TransferOutcome, KVReceiveListener
    from kv_transfer import SenderConfig, ReceiverConfig, BufferPoolExhausted
    from kv_transfer.tcp import TcpKVSender, TcpKVReceiver      # default transport
    from kv_transfer.grpc import GrpcKVSender, GrpcKVReceiver   # gRPC transport
"""

from kv_transfer.base import (
    KVLayout,
    KVReceiveListener,
    KVReceiver,
    KVSender,
    ReceiverStats,
    TransferOutcome,
    TransferState,
    TransferTarget,
    Verdict,
)
from kv_transfer.config import ReceiverConfig, SenderConfig
from kv_transfer.errors import BufferPoolExhausted, Reason, TransferError, reason_code

__all__ = [
    "BufferPoolExhausted",
    "KVLayout",
    "KVReceiveListener",
    "KVReceiver",
    "KVSender",
    "Reason",
    "ReceiverConfig",
    "ReceiverStats",
    "SenderConfig",
    "TransferError",
    "TransferOutcome",
    "TransferState",
    "TransferTarget",
    "Verdict",
    "reason_code",
]
