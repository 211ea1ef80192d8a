"""`pdserve bench transfer`: KV transfer throughput over loopback, against baselines.

In one run, for each stream count N (default 1, 2, 4, 8):

- **ceiling**: N plain TCP connections, the same bytes split evenly, `sendall`
  of memoryviews on one side and `recv_into` a preallocated buffer on the
  other; no framing, no checksums: what loopback TCP gives on this machine;
- **tcp**: `TcpKVSender` -> `TcpKVReceiver`, K requests x L layers, every
  layer sent as the engine does (`send_layer` per layer), checksums on both
  sides (XXH3-64, the default), frames sliced across N streams;
- **tcp-xxh64**: the same with `SenderConfig(checksum="xxh64")`;
- **grpc**: `GrpcKVSender` -> `GrpcKVReceiver` with N concurrent Push calls
  (XXH3-64 checksums, the default);
- **grpc-tls** (only when named in --connectors, with --tls-dir): the gRPC
  connector with the pods' mutual TLS and a pod token (proto/tls.py), what
  `--kv-transport grpc` costs with `--tls-*` set (docs/deploy.md, Security);
- **tcp-tls** (only when named in --connectors, with --tls-dir): the TCP
  connector with KV TLS, the pods' mutual TLS on every stream
  (kv_transfer/tcp/tls.py), what the default TCP transport costs with
  `--tls-*` set; its cost is the row against **tcp** at the same N;
- **tcp-no-checksum** (only when named in --connectors; a diagnostic, not a
  product mode): the TCP connector with `data_checksum` replaced by a
  constant on both sides, to show what the checksums cost apart from framing;

and **grpc-plain**, one client-streaming `KVTransfer.Push` call sending the
same bytes as bare payload messages (same chunk size) to a servicer that only
counts them: the gRPC baseline (its "streams" column is the group it was
measured in; it always uses one call).

GB/s = bytes of all K requests / wall time from the first BEGIN to the last
verdict. CPU s/GB = CPU time of the process (sender and receiver threads both
live in it) per GB moved: steadier than GB/s on a shared machine. Per-layer
latency = time from a request's `begin` to that layer's `on_layer_ready` on
the receiver. Repeats interleave the paths; each row is the run with the best
wall time out of --repeats ("vs baseline": best against best); "median vs
baseline" compares the median wall times of the same repeats, which a single
lucky or unlucky run moves less. --min-chunk-mib sets the connector's
`min_chunk_bytes`.
"""

from __future__ import annotations

import argparse
import socket
import threading
import time

HELP = "KV transfer: TCP and gRPC connectors at 1/2/4/8 streams vs raw sockets and plain gRPC."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=2, help="K requests per measurement")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--streams", default="1,2,4,8", help="comma-separated stream counts")
    parser.add_argument("--connectors", default="tcp,tcp-xxh64,grpc",
                        help="comma-separated: tcp, tcp-xxh64 (XXH64 checksums), grpc, "
                             "grpc-tls and tcp-tls (need --tls-dir), tcp-no-checksum "
                             "(diagnostic)")
    parser.add_argument("--tls-dir", default=None, metavar="DIR",
                        help="for grpc-tls and tcp-tls: ca.crt, and tls.crt/tls.key valid "
                             "for the name pdserve-pod with server and client usage (as a "
                             "pod Secret)")
    parser.add_argument("--chunk-mib", type=float, default=4.0, help="max DATA payload (MiB)")
    parser.add_argument("--min-chunk-mib", type=float, default=2.0,
                        help="smallest DATA payload a layer is cut into (MiB; SenderConfig"
                             ".min_chunk_bytes, default 2)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)


def main(args: argparse.Namespace) -> int:
    import torch

    from kv_transfer.base import KVLayout

    layout = KVLayout(args.layers, args.tokens, args.kv_heads, args.head_dim, args.dtype)
    streams = [int(s) for s in args.streams.split(",")]
    connectors = [c for c in args.connectors.split(",") if c]
    chunk = int(args.chunk_mib * (1 << 20))
    min_chunk = int(args.min_chunk_mib * (1 << 20))
    gen = torch.Generator().manual_seed(0)
    kvs = [
        torch.randint(0, 256, (layout.total_bytes,), dtype=torch.uint8, generator=gen)
        .view(layout.torch_dtype).view(layout.num_layers, *layout.layer_shape)
        for _ in range(args.requests)
    ]  # fmt: skip
    total = layout.total_bytes * args.requests
    print(f"# {args.requests} requests x {layout}: {total / 2**20:.1f} MiB per measurement, "
          f"best of {args.repeats}, chunk {args.min_chunk_mib}-{args.chunk_mib} MiB")  # fmt: skip
    rows = []
    baselines = ["ceiling"] + (
        ["grpc-plain"] if any(c.startswith("grpc") for c in connectors) else [])
    for n in streams:
        # repeats interleave every path, baselines included, so that a burst of load
        # on the machine hits them all alike; each group has its own baselines
        runs: dict[str, list] = {path: [] for path in (*baselines, *connectors)}
        for _ in range(args.repeats):
            runs["ceiling"].append(_raw_ceiling(kvs, n))
            if "grpc-plain" in runs:
                runs["grpc-plain"].append(_plain_grpc(kvs, chunk))
            for connector in connectors:
                runs[connector].append(_connector(connector, kvs, layout, n, chunk, min_chunk,
                                                  args.tls_dir))
        best = {path: _best(results) for path, results in runs.items()}
        median = {path: _median_seconds(results) for path, results in runs.items()}
        for path in (*baselines, *connectors):
            base_path = "grpc-plain" if path.startswith("grpc") else "ceiling"
            if path in baselines:
                rows.append((path, n, total, best[path], None, None))
            else:
                rows.append((path, n, total, best[path], best[base_path],
                             median[base_path] / median[path]))  # fmt: skip
    _print(rows)
    return 0


class _Clock:
    """Wall and process CPU time of the measured section only (setup excluded)."""

    def __init__(self) -> None:
        self.wall = time.perf_counter()
        self.cpu = time.process_time()

    def stop(self, latencies: list[float] | None = None) -> tuple[float, float, list[float]]:
        return (time.perf_counter() - self.wall, time.process_time() - self.cpu,
                latencies or [])  # fmt: skip


def _best(runs: list[tuple[float, float, list[float]]]) -> tuple[float, float, list[float]]:
    return min(runs, key=lambda run: run[0])


def _median_seconds(runs: list[tuple[float, float, list[float]]]) -> float:
    ordered = sorted(run[0] for run in runs)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))]


def _print(rows) -> None:
    print("| path | streams | GB/s | vs baseline | median vs baseline | CPU s/GB "
          "| layer p50 ms | layer p99 ms |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for path, n, total, (seconds, cpu, latencies), base, median_ratio in rows:
        gbps = total / seconds / 1e9
        ratio = median = "-"
        if base is not None:
            name = "grpc-plain" if path.startswith("grpc") else "ceiling"
            ratio = f"{base[0] / seconds:.0%} of {name}"
            median = f"{median_ratio:.0%}"
        lat = "- | -"
        if latencies:
            lat = f"{_pct(latencies, 50) * 1e3:.1f} | {_pct(latencies, 99) * 1e3:.1f}"
        streams = "1 call" if path == "grpc-plain" else n
        print(f"| {path} | {streams} | {gbps:.2f} | {ratio} | {median} "
              f"| {cpu / (total / 1e9):.2f} | {lat} |")  # fmt: skip


def _raw_ceiling(kvs, num_streams: int) -> tuple[float, float, list[float]]:
    """Plain sockets: N connections, sendall/recv_into of the same bytes, no framing."""
    from kv_transfer.device import byte_view

    src = [byte_view(kv.view(-1)) for kv in kvs]
    total = sum(len(v) for v in src)
    dst = bytearray(total)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    # stream i carries bytes [i*total/N, (i+1)*total/N) of the concatenation
    bounds = [total * i // num_streams for i in range(num_streams + 1)]

    def receive(conn: socket.socket, lo: int, hi: int) -> None:
        view = memoryview(dst)[lo:hi]
        got = 0
        while got < len(view):
            got += conn.recv_into(view[got:])
        conn.close()

    def send(lo: int, hi: int) -> None:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(lo.to_bytes(8, "little"))
        offset = 0
        for view in src:
            a, b = max(lo - offset, 0), min(hi - offset, len(view))
            if a < b:
                sock.sendall(view[a:b])
            offset += len(view)
        sock.close()

    def accept_all(threads: list) -> None:
        for _ in range(num_streams):
            conn, _ = server.accept()
            lo = int.from_bytes(_recv_exact(conn, 8), "little")
            hi = bounds[bounds.index(lo) + 1]
            thread = threading.Thread(target=receive, args=(conn, lo, hi))
            thread.start()
            threads.append(thread)

    receivers: list[threading.Thread] = []
    clock = _Clock()
    acceptor = threading.Thread(target=accept_all, args=(receivers,))
    acceptor.start()
    senders = [threading.Thread(target=send, args=(bounds[i], bounds[i + 1]))
               for i in range(num_streams)]  # fmt: skip
    for thread in senders:
        thread.start()
    for thread in senders:
        thread.join()
    acceptor.join()
    for thread in receivers:
        thread.join()
    measured = clock.stop()
    server.close()
    return measured


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        buf += conn.recv(n - len(buf))
    return buf


def _pod_security(tls_dir: str | None, name: str):
    """(server, client) `PodSecurity` of grpc-tls and tcp-tls: mutual TLS + a
    pod token (which only gRPC sends)."""
    from proto.tls import PodSecurity, TlsFiles

    if tls_dir is None:
        raise ValueError(f"the {name} connector needs --tls-dir")
    files = TlsFiles(f"{tls_dir}/tls.crt", f"{tls_dir}/tls.key", f"{tls_dir}/ca.crt",
                     server_name="pdserve-pod")
    return PodSecurity(tls=files, token="bench"), PodSecurity(tls=files, token="bench")


def _connector(name: str, kvs, layout, num_streams: int, chunk: int,
               min_chunk: int = 2 << 20, tls_dir: str | None = None,
               ) -> tuple[float, float, list[float]]:  # fmt: skip
    """K requests through a real connector; (seconds, per-layer BEGIN->ready latencies)."""
    from kv_transfer.base import KVReceiveListener
    from kv_transfer.config import ReceiverConfig, SenderConfig
    from proto.tls import PodSecurity

    server_security, client_security = (
        _pod_security(tls_dir, name) if name.endswith("-tls") else (PodSecurity(), PodSecurity()))

    if name.startswith("tcp"):
        from kv_transfer.tcp import TcpKVReceiver as Receiver
        from kv_transfer.tcp import TcpKVSender as Sender
    else:
        from kv_transfer.grpc import GrpcKVReceiver as Receiver
        from kv_transfer.grpc import GrpcKVSender as Sender

    ready: dict[tuple[str, int], float] = {}

    class Timing(KVReceiveListener):
        def on_layer_ready(self, request_id, layer, kv_view):
            ready[(request_id, layer)] = time.perf_counter()

        def on_complete(self, request_id, first_token_id):
            pass

        def on_failed(self, request_id, reason):
            print(f"  transfer {request_id} failed: {reason}")

    capacity = layout.total_bytes * len(kvs)
    # prefaulted: a pod's long-lived landing slab is resident after its first requests
    receiver = Receiver(ReceiverConfig(capacity_bytes=capacity, prefault_landing=True,
                                       security=server_security), Timing())
    receiver.start()
    checksum = "xxh64" if name == "tcp-xxh64" else "xxh3"
    config = SenderConfig(num_streams=num_streams, max_chunk_bytes=chunk,
                          min_chunk_bytes=min(min_chunk, chunk), checksum=checksum,
                          security=client_security)  # fmt: skip
    sender = Sender(config)
    if name == "tcp-no-checksum":
        from benchmarks.transfer_split import _constant, _set_checksum

        original = _set_checksum(_constant)
    try:
        ids = [f"bench-{i}" for i in range(len(kvs))]
        targets = [receiver.expect(rid, layout, time.time() + 600) for rid in ids]
        begun: dict[str, float] = {}
        futures = []
        clock = _Clock()
        for rid, target, kv in zip(ids, targets, kvs, strict=True):
            begun[rid] = time.perf_counter()
            sender.begin(rid, target, layout)
            for layer in range(layout.num_layers):
                sender.send_layer(rid, layer, kv[layer], 0)
            futures.append(sender.end(rid, 1))
        outcomes = [f.result(600) for f in futures]
        measured = clock.stop()
        assert all(o.ok for o in outcomes), outcomes
        for rid in ids:
            receiver.release(rid)
        latencies = [ready[(rid, layer)] - begun[rid]
                     for rid in ids for layer in range(layout.num_layers)]  # fmt: skip
        return measured[0], measured[1], latencies
    finally:
        sender.close()
        receiver.close()
        if name == "tcp-no-checksum":
            _set_checksum(original)


def _plain_grpc(kvs, chunk: int) -> tuple[float, float, list[float]]:
    """One client-streaming Push call of bare payload messages to a counting servicer."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from kv_transfer.device import byte_view
    from kv_transfer.grpc import SERVER_OPTIONS
    from proto import pdserve_pb2, pdserve_pb2_grpc

    class Counting(pdserve_pb2_grpc.KVTransferServicer):
        def Push(self, request_iterator, context):  # noqa: N802
            received = sum(len(frame.payload) for frame in request_iterator)
            return pdserve_pb2.PushResult(ok=received > 0)

    server = grpc.server(ThreadPoolExecutor(4), options=SERVER_OPTIONS)
    pdserve_pb2_grpc.add_KVTransferServicer_to_server(Counting(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}",
                                    options=[("grpc.max_send_message_length", 1 << 30)])
    stub = pdserve_pb2_grpc.KVTransferStub(channel)

    def frames():
        for kv in kvs:
            view = byte_view(kv.view(-1))
            for at in range(0, len(view), chunk):
                yield pdserve_pb2.KVFrame(payload=bytes(view[at : at + chunk]))

    clock = _Clock()
    result = stub.Push(frames(), timeout=600)
    measured = clock.stop()
    assert result.ok
    channel.close()
    server.stop(0).wait()
    return measured
