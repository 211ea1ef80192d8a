"""Multi-stream TCP connector (the default transport)."""

from kv_transfer.tcp.receiver import TcpKVReceiver
from kv_transfer.tcp.sender import TcpKVSender

__all__ = ["TcpKVReceiver", "TcpKVSender"]
