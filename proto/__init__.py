"""The contract between the project's processes: `pdserve.proto` and its
generated modules, plus the plain-Python pieces every side shares (pod roles,
host:port syntax, message limits, the Redis registry record, the exception to
status-code mapping, and the request contract: the request id's limit and the
sampling limits, each with its one check). Nothing here imports the rest of
the project, so the router, the pods, kv_transfer and the CLI may all import
it."""
