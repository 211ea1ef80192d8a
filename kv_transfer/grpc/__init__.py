"""gRPC connector: `KVTransfer.Push` client streams carrying KVFrame messages."""

from kv_transfer.grpc.receiver import GrpcKVReceiver, serve
from kv_transfer.grpc.sender import GrpcKVSender
from kv_transfer.grpc.servicer import SERVER_OPTIONS, KVTransferServicer

__all__ = ["SERVER_OPTIONS", "GrpcKVReceiver", "GrpcKVSender", "KVTransferServicer", "serve"]
