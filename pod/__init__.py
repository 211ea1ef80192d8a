"""What every pod (prefill, decode, colocated) shares: the gRPC server and its
drain, request validation, `GetLoad`, the exception -> status table, the KV
shape, the Redis heartbeat and the server settings. Imported by
`prefill_service` and `decode_service`, which never import each other; it
imports `engine`, `proto` and (for `KVShape`) `kv_transfer.base`, never a
service or the CLI. See docs/services.md, "Shared pod code"."""
