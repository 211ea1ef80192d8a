"""Size limits every gRPC channel and server of the project shares, and the
reconnect backoff of the router's channels to pods.

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

# (option, value) pairs for channels to pods: try to reconnect to a pod that went
# away at least once a second. gRPC's default backoff grows to 120 s, so a pod
# unreachable for ~10 s stayed unreachable on the router's channels for ~6 s
# more while the pod served: every request sent to it failed
# "Connection refused" (tests/faults/test_link_faults.py). A refused connect
# costs the router next to nothing, so the bound is cheap. Not set: gRPC's
# "min_reconnect_backoff_ms", which is the connect timeout (20 s) in C-core, and
# must stay long enough for a slow handshake.
GRPC_RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
