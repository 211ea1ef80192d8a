"""Simulated pods: the real pod gRPC services, block pool, prefix cache and
KV cache events over a modelled forward pass and KV transfer, many pods per
process (`pdserve sim`; docs/simulator.md)."""
