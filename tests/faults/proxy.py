"""A fault-injecting TCP proxy for the fault tests (and anyone else who needs one).

    proxy = FaultProxy(("127.0.0.2", port), ("127.0.0.1", port)).start()
    proxy.set_fault(Fault(drop_after_bytes=100_000))   # applies to new connections
    ...
    proxy.close()

It sits between two parts on loopback: between a prefill pod and a decode
pod's KV port (the decode pod advertises another loopback address,
`--advertise-host 127.0.0.2`, and the proxy listens there on the same port),
or between the router and a pod's gRPC port (the router is given the
proxy's address in `--prefill`/`--decode`).

Each accepted connection gets its own upstream connection and two pump
threads, one per direction ("up": client -> upstream, "down": back). The
fault in force when a connection is accepted applies to it for its whole
life; `Fault` faults act on the bytes of `Fault.direction`, counted per
connection from its first byte:

- latency_s: every chunk waits this long before it is forwarded (both ways);
- bytes_per_s: both directions are paced to this rate;
- drop_after_bytes: after this many bytes both sockets are reset (RST):
  a peer that died mid-stream;
- truncate_after_bytes: after this many bytes the proxy stops forwarding
  and half-closes (FIN) towards the receiver, then discards what follows:
  a stream cut at an arbitrary byte, cleanly;
- corrupt_at_byte: the byte at this offset is inverted (every other byte
  passes): corruption no TCP checksum caught;
- black_hole: the connection is accepted and everything it sends is read
  and discarded; nothing is forwarded and nothing comes back, ever.

`connections_accepted`, `active_connections()`, `bytes_forwarded` and
`triggered` (drops, truncations, corruptions done) are what the tests
assert on; with `record_limit`, `recordings` keeps the first bytes each
connection sent upstream (to replay them); `reset_all()` resets every live connection (a
partition of whatever is connected now); `refuse()` makes the address
refuse connections until `start()` listens there again (a pod that is
gone, then back); `heal()` ends the fault.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from dataclasses import dataclass

_CHUNK = 64 * 1024
_DIRECTIONS = ("up", "down")


@dataclass(frozen=True, slots=True)
class Fault:
    """What the proxy does to the connections it accepts (default: nothing)."""

    latency_s: float = 0.0
    bytes_per_s: float | None = None
    drop_after_bytes: int | None = None
    truncate_after_bytes: int | None = None
    corrupt_at_byte: int | None = None
    black_hole: bool = False
    direction: str = "up"  # which bytes the drop/truncate/corrupt offsets count

    def __post_init__(self) -> None:
        if self.direction not in _DIRECTIONS:
            raise ValueError(f"direction must be one of {_DIRECTIONS}, got {self.direction!r}")
        if self.latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {self.latency_s}")
        if self.bytes_per_s is not None and self.bytes_per_s <= 0:
            raise ValueError(f"bytes_per_s must be > 0, got {self.bytes_per_s}")
        for name in ("drop_after_bytes", "truncate_after_bytes", "corrupt_at_byte"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), not FIN: the peer sees a connection reset.
    shutdown(SHUT_RD) first wakes a pump thread blocked in recv on it."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RD)
    except OSError:
        pass
    sock.close()


class _Link:
    """One proxied connection: the client's socket, the upstream socket, two pumps."""

    def __init__(self, proxy: FaultProxy, client: socket.socket, fault: Fault) -> None:
        self.proxy, self.client, self.fault = proxy, client, fault
        self.upstream: socket.socket | None = None
        self.recording = bytearray()
        self._closed = threading.Event()
        self._lock = threading.Lock()

    def run(self) -> None:
        if self.fault.black_hole:
            self._discard(self.client)
            self.close()
            return
        try:
            self.upstream = socket.create_connection(self.proxy.upstream, timeout=5)
        except OSError:
            self.close(reset=True)
            return
        for sock in (self.client, self.upstream):
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        down = threading.Thread(target=self._pump, args=(self.upstream, self.client, "down"),
                                daemon=True, name="fault-proxy-down")
        down.start()
        self._pump(self.client, self.upstream, "up")
        down.join()
        self.close()

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        fault = self.fault
        faulty = fault.direction == direction
        offset, started = 0, time.monotonic()
        # paced: small chunks, each sent once the rate allows its last byte
        chunk = max(1, min(_CHUNK, int(fault.bytes_per_s / 20))) if fault.bytes_per_s else _CHUNK
        try:
            while True:
                data = src.recv(chunk)
                if not data:
                    dst.shutdown(socket.SHUT_WR)  # pass the clean end on
                    return
                if fault.latency_s:
                    time.sleep(fault.latency_s)
                if fault.bytes_per_s:
                    ahead = (offset + len(data)) / fault.bytes_per_s - (time.monotonic() - started)
                    if ahead > 0:
                        time.sleep(ahead)
                if faulty:
                    data, verdict = self._apply(data, offset)
                    if verdict == "drop":
                        dst.sendall(data)
                        self.close(reset=True)
                        return
                    if verdict == "truncate":
                        dst.sendall(data)
                        dst.shutdown(socket.SHUT_WR)
                        self._discard(src)
                        return
                if direction == "up" and len(self.recording) < self.proxy.record_limit:
                    self.recording += data[:self.proxy.record_limit - len(self.recording)]
                dst.sendall(data)
                offset += len(data)
                self.proxy.count(direction, len(data))
        except OSError:
            self.close(reset=True)

    def _apply(self, data: bytes, offset: int) -> tuple[bytes, str]:
        """The chunk at stream `offset` after the fault: (bytes to send, verdict)."""
        fault, end = self.fault, offset + len(data)
        if fault.corrupt_at_byte is not None and offset <= fault.corrupt_at_byte < end:
            self.proxy.count_trigger()
            i = fault.corrupt_at_byte - offset
            data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:]
        if fault.drop_after_bytes is not None and end > fault.drop_after_bytes:
            self.proxy.count_trigger()
            return data[:max(0, fault.drop_after_bytes - offset)], "drop"
        if fault.truncate_after_bytes is not None and end > fault.truncate_after_bytes:
            self.proxy.count_trigger()
            return data[:max(0, fault.truncate_after_bytes - offset)], "truncate"
        return data, "forward"

    def _discard(self, sock: socket.socket) -> None:
        try:
            while not self._closed.is_set() and sock.recv(_CHUNK):
                pass
        except OSError:
            pass

    def close(self, reset: bool = False) -> None:
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
        for sock in (self.client, self.upstream):
            if sock is None:
                continue
            if reset:
                _reset(sock)
            else:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()
        self.proxy.forget(self)


class FaultProxy:
    """Listens on `listen` (host, port; port 0 = any) and forwards to `upstream`.
    Thread-safe; `set_fault` from any thread."""

    def __init__(self, listen: tuple[str, int], upstream: tuple[str, int],
                 record_limit: int = 0) -> None:
        self.listen, self.upstream = listen, upstream
        # the first `record_limit` bytes each connection sent upstream, for replays
        self.record_limit = record_limit
        self.recordings: list[bytearray] = []
        self.connections_accepted = 0
        self.triggered = 0  # drops, truncations and corruptions done
        self.bytes_forwarded = {"up": 0, "down": 0}
        self._fault = Fault()
        self._fault_left: int | None = None  # connections the fault still applies to
        self._links: set[_Link] = set()
        self._lock = threading.Lock()
        self._server: socket.socket | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        assert self._server is not None, "start() first"
        host, port = self.listen
        return f"{host}:{port}"

    def start(self) -> FaultProxy:
        """Listen (again, after `refuse`: on the same address)."""
        self._server = socket.create_server(self.listen, backlog=128)
        self.listen = self._server.getsockname()[:2]  # port 0 -> the port it got
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name="fault-proxy-accept")
        self._thread.start()
        return self

    def set_fault(self, fault: Fault, connections: int | None = None) -> None:
        """The fault for connections accepted from now on: all of them, or only
        the next `connections`, after which the proxy forwards faithfully again."""
        with self._lock:
            self._fault, self._fault_left = fault, connections

    def refuse(self) -> None:
        """Stop listening and reset every connection: dialling the proxy's
        address is refused (a pod that is gone) until `start()` again."""
        self._stop_listening()
        self.reset_all()

    def heal(self) -> None:
        """No fault from now on; the connections a fault applied to are reset
        (faithful ones stay up)."""
        with self._lock:
            self._fault, self._fault_left = Fault(), None
            faulty = [link for link in self._links if link.fault != Fault()]
        for link in faulty:
            link.close(reset=True)

    def active_connections(self) -> int:
        with self._lock:
            return len(self._links)

    def reset_all(self) -> None:
        with self._lock:
            links = list(self._links)
        for link in links:
            link.close(reset=True)

    def count(self, direction: str, num_bytes: int) -> None:
        with self._lock:
            self.bytes_forwarded[direction] += num_bytes

    def count_trigger(self) -> None:
        with self._lock:
            self.triggered += 1

    def forget(self, link: _Link) -> None:
        with self._lock:
            self._links.discard(link)

    def _accept_loop(self) -> None:
        assert self._server is not None
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:  # closed
                return
            with self._lock:
                link = _Link(self, client, self._fault)
                if self.record_limit:
                    self.recordings.append(link.recording)
                if self._fault_left is not None:
                    self._fault_left -= 1
                    if self._fault_left <= 0:
                        self._fault, self._fault_left = Fault(), None
                self._links.add(link)
                self.connections_accepted += 1
            threading.Thread(target=link.run, daemon=True, name="fault-proxy-link").start()

    def _stop_listening(self) -> None:
        if self._server is not None:
            try:
                self._server.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._server.close()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def close(self) -> None:
        self._stop_listening()
        self.reset_all()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
