"""`pdserve bench transfer-split`: the TCP connector with sender and receiver in
separate processes, as prefill and decode pods are, against the same ceiling.

`pdserve bench transfer` runs both ends in one process (one GIL, one CPU
figure). This one starts a receiver process per path and sends from the
parent; CPU s/GB is summed over both processes. Paths, each `--rounds`
times, best wall time kept:

- **ceiling**: N plain connections, `sendall` / `recv_into` of the same bytes;
- **tcp**: the connector as shipped (XXH3-64 checksums);
- **tcp-xxh64**: `SenderConfig(checksum="xxh64")`;
- **tcp-no-checksum** (diagnostic, not a product mode): the connector with
  `data_checksum` replaced by a constant in both processes, to show what the
  checksums cost apart from framing.

The processes exchange only JSON over a pipe (targets, CPU seconds); the
receiver starts from multiprocessing's fork server with primitive arguments.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import socket
import threading
import time

HELP = "KV transfer with sender and receiver in separate processes (TCP vs raw sockets)."
PATHS = ("ceiling", "tcp", "tcp-xxh64", "tcp-no-checksum")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=2)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--streams", default="2,4", help="comma-separated stream counts")
    parser.add_argument("--rounds", type=int, default=4)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _set_checksum(function) -> object:
    """Replace the connector's DATA checksum in this process; returns the old one."""
    import kv_transfer.tcp.receiver as receiver
    import kv_transfer.tcp.stream as stream

    old = stream.data_checksum
    receiver.data_checksum = stream.data_checksum = function
    return old


def _constant(view, flags) -> int:
    return 0


def _receive_connector(conn, shape: list, requests: int, rounds: int, patch: bool) -> None:
    """Child: a TcpKVReceiver; per round, send the targets, wait for every verdict.
    `shape`: the KVLayout's fields (only primitives cross to the child)."""
    from kv_transfer.base import KVLayout, KVReceiveListener
    from kv_transfer.config import ReceiverConfig
    from kv_transfer.tcp import TcpKVReceiver

    if patch:
        _set_checksum(_constant)
    done = threading.Semaphore(0)

    class Listener(KVReceiveListener):
        def on_layer_ready(self, request_id, layer, kv_view):
            pass

        def on_complete(self, request_id, first_token_id):
            done.release()

        def on_failed(self, request_id, reason):
            print(f"  transfer {request_id} failed: {reason}", flush=True)
            done.release()

    layout = KVLayout(*shape)
    config = ReceiverConfig(capacity_bytes=layout.total_bytes * requests, prefault_landing=True)
    receiver = TcpKVReceiver(config, Listener())
    receiver.start()
    for r in range(rounds):
        ids = [f"r{r}-{i}" for i in range(requests)]
        targets = [receiver.expect(rid, layout, time.time() + 600) for rid in ids]
        start = _cpu()
        fields = [[list(t.endpoints), t.ticket.hex(), t.transport, t.generation, t.deadline]
                  for t in targets]  # fmt: skip
        conn.send_bytes(json.dumps(fields).encode())
        for _ in ids:
            done.acquire()
        conn.recv_bytes()  # the sender has every verdict: only now may this process move on
        for rid in ids:
            receiver.release(rid)
        conn.send_bytes(json.dumps(_cpu() - start).encode())
    receiver.close()


def _receive_raw(conn, total: int, num_streams: int, rounds: int) -> None:
    """Child: N accepted connections per round, each filling its range of one buffer."""
    dst = bytearray(total)
    dst[:] = bytes(total)  # resident, as the connector's prefaulted slab
    server = socket.create_server(("127.0.0.1", 0))
    for _ in range(rounds):
        start = _cpu()
        conn.send_bytes(json.dumps(server.getsockname()[1]).encode())
        socks = [server.accept()[0] for _ in range(num_streams)]

        def receive(sock: socket.socket) -> None:
            lo, hi = (int.from_bytes(sock.recv(8, socket.MSG_WAITALL), "little") for _ in "ab")
            view, got = memoryview(dst)[lo:hi], 0
            while got < len(view):
                got += sock.recv_into(view[got:])
            sock.sendall(b"k")  # the sender stops its clock on this
            sock.close()

        threads = [threading.Thread(target=receive, args=(s,)) for s in socks]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        conn.send_bytes(json.dumps(_cpu() - start).encode())
    server.close()


def _send_raw(conn, src: memoryview, num_streams: int) -> None:
    port = json.loads(conn.recv_bytes())
    bounds = [len(src) * i // num_streams for i in range(num_streams + 1)]

    def send(i: int) -> None:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(bounds[i].to_bytes(8, "little") + bounds[i + 1].to_bytes(8, "little"))
        sock.sendall(src[bounds[i] : bounds[i + 1]])
        sock.recv(1)
        sock.close()

    threads = [threading.Thread(target=send, args=(i,)) for i in range(num_streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _send_connector(conn, sender, kvs, layout, round_index: int) -> None:
    from kv_transfer.base import TransferTarget

    targets = [TransferTarget(tuple(e), bytes.fromhex(t), tr, g, d)
               for e, t, tr, g, d in json.loads(conn.recv_bytes())]  # fmt: skip
    futures = []
    for i, (target, kv) in enumerate(zip(targets, kvs, strict=True)):
        rid = f"r{round_index}-{i}"
        sender.begin(rid, target, layout)
        for layer in range(layout.num_layers):
            sender.send_layer(rid, layer, kv[layer], 0)
        futures.append(sender.end(rid, 1))
    outcomes = [f.result(600) for f in futures]
    assert all(o.ok for o in outcomes), outcomes


def _measure(path: str, num_streams: int, kvs, layout, rounds: int) -> tuple[float, float]:
    """(best wall seconds, CPU seconds of both processes in that round)."""
    from kv_transfer.config import SenderConfig
    from kv_transfer.device import byte_view
    from kv_transfer.tcp import TcpKVSender

    # forkserver, not fork: this process may already run gRPC and torch threads,
    # which a forked child inherits in whatever state they were (and can hang on)
    ctx = multiprocessing.get_context("forkserver")
    parent, child = ctx.Pipe()
    sender = original = None
    if path == "ceiling":
        src = memoryview(b"".join(bytes(byte_view(kv.view(-1))) for kv in kvs))
        proc = ctx.Process(target=_receive_raw, args=(child, len(src), num_streams, rounds))
    else:
        if path == "tcp-no-checksum":
            original = _set_checksum(_constant)
        checksum = "xxh64" if path == "tcp-xxh64" else "xxh3"
        sender = TcpKVSender(SenderConfig(num_streams=num_streams, checksum=checksum))
        shape = [layout.num_layers, layout.num_tokens, layout.num_kv_heads, layout.head_dim,
                 layout.dtype]  # fmt: skip
        proc = ctx.Process(target=_receive_connector, args=(
            child, shape, len(kvs), rounds, path == "tcp-no-checksum"))  # fmt: skip
    proc.start()
    best = (float("inf"), 0.0)
    try:
        for r in range(rounds):
            start_cpu, start = _cpu(), time.perf_counter()
            if sender is None:
                _send_raw(parent, src, num_streams)
            else:
                _send_connector(parent, sender, kvs, layout, r)
            wall = time.perf_counter() - start
            cpu = _cpu() - start_cpu
            if sender is not None:
                parent.send_bytes(b"verdicts in")
            cpu += json.loads(parent.recv_bytes())
            best = min(best, (wall, cpu))
    finally:
        if sender is not None:
            sender.close()
        if original is not None:
            _set_checksum(original)
        proc.join(60)
    return best


def main(args: argparse.Namespace) -> int:
    import torch

    from kv_transfer.base import KVLayout

    layout = KVLayout(args.layers, args.tokens, 8, 128, "bfloat16")
    gen = torch.Generator().manual_seed(0)
    kvs = [torch.randint(0, 256, (layout.total_bytes,), dtype=torch.uint8, generator=gen)
           .view(layout.torch_dtype).view(layout.num_layers, *layout.layer_shape)
           for _ in range(args.requests)]  # fmt: skip
    gb = layout.total_bytes * args.requests / 1e9
    print(f"# {args.requests} requests x {layout}, sender and receiver in separate processes, "
          f"best of {args.rounds}")  # fmt: skip
    print("| path | streams | GB/s | vs ceiling | CPU s/GB (both processes) |")
    print("|---|---:|---:|---:|---:|")
    for n in (int(s) for s in args.streams.split(",")):
        ceiling = None
        for path in PATHS:
            wall, cpu = _measure(path, n, kvs, layout, args.rounds)
            ceiling = ceiling or wall
            ratio = "-" if path == "ceiling" else f"{ceiling / wall:.0%}"
            print(f"| {path} | {n} | {gb / wall:.2f} | {ratio} | {cpu / gb:.2f} |", flush=True)
    return 0
