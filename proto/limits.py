"""Size limits every gRPC channel and server of the project shares.

`MAX_MESSAGE_BYTES` bounds one gRPC message (not a stream, not a transfer) on
the pods' servers and on the router's server and pod channels. gRPC's 4 MiB
default is too small for long prompts' token lists and their logprobs, and a
pod server may host the KV gRPC connector (`GrpcKVReceiver.add_to_server`),
whose DATA messages carry up to 64 MiB of KV plus their header: 64 MiB would
be just too small there, so every party uses 256 MiB (docs/services.md,
"Message size"). Plain constants, no project imports.
"""

MAX_MESSAGE_BYTES = 256 * 1024 * 1024

# (option, value) pairs for `grpc.aio.server(options=...)` and channels.
GRPC_MESSAGE_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)
