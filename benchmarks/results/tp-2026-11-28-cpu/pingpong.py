"""One-byte ping-pong between two processes: a Unix socket pair, then TCP
loopback with TCP_NODELAY (the floor under any collective between them)."""

import os
import socket
import time

N = 2000


def pingpong(a: socket.socket, b: socket.socket) -> float:
    if os.fork() == 0:
        for _ in range(N):
            b.recv(64)
            b.send(b"x")
        os._exit(0)
    start = time.perf_counter()
    for _ in range(N):
        a.send(b"x")
        a.recv(64)
    os.wait()
    return (time.perf_counter() - start) / N


def main() -> None:
    a, b = socket.socketpair()
    print(f"unix ping-pong {pingpong(a, b) * 1e6:.0f} us")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    for s in (client, accepted):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    print(f"tcp ping-pong {pingpong(accepted, client) * 1e6:.0f} us")


if __name__ == "__main__":
    main()
