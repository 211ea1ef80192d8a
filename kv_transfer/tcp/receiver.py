"""TCP receiver: a listening socket, one thread per authenticated sender connection.

A new connection waits in the lobby (kv_transfer/tcp/lobby.py: no thread,
no slot) until its first frame, a BEGIN whose ticket verifies, is in; then
it is promoted. Life of a promoted connection (one thread,
`_Connection.run`): handle that BEGIN, then wait (idle allowed) for
the first bytes of a frame, which starts its deadline; read the 104-byte header;
BEGIN/END/ABORT payloads are small and read into memory; a DATA payload is
read with `recv_into` straight into the landing buffer region the table
granted (`ReceiveTable.claim`), then its xxhash64 is checked and the region
committed. A refused frame is answered with a STATUS frame (once per request
per connection) and its payload skipped, so the connection stays in sync and
other transfers on it continue; an untrustworthy header closes the connection
and fails the transfers it carried.

Limits, each refusal counted by reason (kv_transfer/refusals.py):
* a frame must be complete within `io_timeout_s` of its first byte: the
  accept thread, waking at least every 0.2 s, shuts down the socket of a
  connection past its frame deadline (a peer trickling one byte every few
  seconds makes progress on every recv, so a per-recv timeout never fires);
* at most `max_connections` authenticated connections: more are closed as they
  are promoted; connections not yet authenticated are the lobby's to bound
  (`auth_timeout_s`, `max_pending`, `max_pending_per_peer`);
* nothing is allocated per connection up front beyond the 104-byte header
  buffer: a refused DATA payload is skipped through a scratch buffer that
  lives for that frame only (socket_io.skip).

KV TLS (tls.py; on when `config.security` has TLS files whose `kv_streams`
is set): the lobby runs each connection's handshake; a promoted connection's
socket is then a `TlsSocket`, and DATA payloads are still decrypted straight
into the landing buffer (`recv_into`).

Threads: the accept thread (the lobby's selector loop, also the frame
watchdog), one per authenticated connection, and the sweeper. The listener
is called from connection threads and the sweeper.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections import OrderedDict

from kv_transfer.base import (
    KVReceiveListener,
    TransferOutcome,
)
from kv_transfer.checksum import checksum, checksum_name, data_checksum
from kv_transfer.config import ReceiverConfig
from kv_transfer.connector_receiver import ConnectorReceiver
from kv_transfer.errors import Reason, TransferRefused, make_reason
from kv_transfer.receive_table import ReceiveTable
from kv_transfer.refusals import PortRefusal, RefusalCounts
from kv_transfer.tcp.frames import (
    FLAG_OK,
    FLAG_TRACE,
    MAX_CONTROL_BYTES,
    FrameHeader,
    FrameKind,
    HeaderError,
    begin_traceparent,
    control_frame,
    decode_begin,
    decode_end,
)
from kv_transfer.tcp.lobby import Lobby, LobbyLimits
from kv_transfer.tcp.socket_io import (
    KVSocket,
    PeerClosed,
    close_quietly,
    new_header_buffer,
    recv_bytes,
    recv_exact_into,
    recv_header,
    set_io_timeout,
    skip,
)
from kv_transfer.tcp.tls import kv_tls_files, server_context
from telemetry import kv_traces

log = logging.getLogger(__name__)
_TOLD_LIMIT = 1024  # request ids a connection remembers having refused
_ACCEPT_TICK_S = 0.2  # the accept loop's wake-up: stop flag and frame deadlines
_LIMIT_LOG_EVERY_S = 10.0  # "connection limit reached" at most this often


class _Connection:
    """One accepted sender connection; also the table's `Peer` for it."""

    def __init__(self, sock: KVSocket, table: ReceiveTable, stop: threading.Event,
                 refusals: RefusalCounts, frame_timeout_s: float) -> None:  # fmt: skip
        self.sock = sock
        self.table = table
        self.stop = stop
        self.refusals = refusals
        self.frame_timeout_s = frame_timeout_s
        self._send_lock = threading.Lock()
        self._told: OrderedDict[str, None] = OrderedDict()
        self.closed = False
        # monotonic deadline of the frame being read (None between frames): written by
        # this connection's thread, read by the accept thread's watchdog
        self.frame_deadline: float | None = None
        self.stalled = False

    def peer_name(self) -> str:
        """The sender's address, "host:port" ("" once the socket is gone)."""
        try:
            host, port = self.sock.getpeername()[:2]
        except OSError:
            return ""
        return f"{host}:{port}"

    def _frame_started(self) -> None:
        self.frame_deadline = time.monotonic() + self.frame_timeout_s

    def _frame_read(self) -> None:
        """All of the frame's bytes are in: what follows (table, listener) is our own
        time, never the peer's, so the watchdog stops counting here."""
        self.frame_deadline = None

    def cut_if_stalled(self, now: float) -> None:
        """Watchdog (accept thread): shut the socket down if the current frame is past
        its deadline (counted); the reader thread then fails and cleans up."""
        deadline = self.frame_deadline
        if deadline is None or now < deadline or not self._mark_stalled():
            return
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the reader; it closes the socket
        except OSError:
            pass

    def _mark_stalled(self) -> bool:
        """Count this connection's stall once, whoever sees it first: the watchdog, or
        the reader's recv making no progress within io_timeout_s mid-frame."""
        with self._send_lock:
            if self.stalled:
                return False
            self.stalled = True
        self.refusals.add(PortRefusal.STALLED)
        return True

    def notify(self, request_id: str, outcome: TransferOutcome) -> None:
        """Back channel (any thread): a STATUS frame with the verdict."""
        if outcome.ok:
            frame = control_frame(FrameKind.STATUS, request_id, b"", flags=FLAG_OK)
        else:
            self._remember(request_id)
            reason = outcome.reason.encode()[:MAX_CONTROL_BYTES]
            frame = control_frame(FrameKind.STATUS, request_id, reason)
        with self._send_lock:
            if self.closed:
                return
            try:
                # never block a receiver thread (or the sweeper) on a sender that does
                # not read its back channel: no room for a small frame means it is broken
                if not self._writable():
                    raise BlockingIOError("sender is not reading STATUS frames")
                self.sock.sendall(frame)
            except OSError:
                close_quietly(self.sock)  # the reader thread notices and cleans up

    def _writable(self) -> bool:
        # A socket an earlier failed STATUS closed (close_quietly, below) has no
        # descriptor left: not writable, where poll would raise ValueError in
        # whichever thread notifies next (seen: the reader thread, dropping the
        # transfer of a sender it lost).
        if self.sock.fileno() < 0:
            return False
        poller = select.poll()
        poller.register(self.sock, select.POLLOUT)
        return bool(poller.poll(0))

    def _remember(self, request_id: str) -> bool:
        """Record that the sender was told about `request_id`; False if it already was."""
        with self._send_lock:
            if request_id in self._told:
                return False
            self._told[request_id] = None
            if len(self._told) > _TOLD_LIMIT:
                self._told.popitem(last=False)
            return True

    def _refused(self, request_id: str, refused: TransferRefused) -> None:
        self.refusals.add(refused.code.value)
        if request_id not in self._told:
            self.notify(request_id, TransferOutcome.failed(refused.reason))

    def run(self, first: tuple[FrameHeader, bytes] | None = None) -> None:
        """Serve frames until the peer leaves; `first`: the BEGIN the lobby
        already read (and authenticated), handled before anything else."""
        header_buf = new_header_buffer()
        reason = make_reason(Reason.CONNECTION_LOST)
        try:
            if first is not None:
                self._control(*first)
            while not self.stop.is_set():
                self._handle(recv_header(self.sock, header_buf, self.stop, self._frame_started))
        except PeerClosed:
            pass
        except HeaderError as exc:
            self.refusals.add(exc.reason)
            reason = make_reason(Reason.BAD_FRAME, str(exc))
            log.warning("kv receiver closing connection: %s", exc)
        except (TimeoutError, BlockingIOError):  # a recv made no progress mid-frame
            self._mark_stalled()
        except OSError as exc:  # resets
            reason = make_reason(Reason.CONNECTION_LOST, str(exc))
        finally:
            if self.stalled:
                reason = self._stalled_reason()
                log.warning("kv receiver cut off a stalled sender: %s", reason)
            with self._send_lock:
                self.closed = True
            close_quietly(self.sock)
            self.table.peer_lost(self, reason)

    def _stalled_reason(self) -> str:
        return make_reason(Reason.CONNECTION_LOST, f"{PortRefusal.STALLED.value}: frame not "
                                                   f"complete within {self.frame_timeout_s:g} s")

    def _handle(self, header: FrameHeader) -> None:
        if header.kind is FrameKind.DATA:
            self._data(header)
            return
        if header.kind is FrameKind.STATUS:
            raise HeaderError(PortRefusal.BAD_KIND, "STATUS frames only travel receiver -> sender")
        payload = recv_bytes(self.sock, header.length)
        self._frame_read()
        self._control(header, payload)

    def _control(self, header: FrameHeader, payload: bytes) -> None:
        """A BEGIN, END or ABORT frame whose payload has been read."""
        rid = header.request_id
        try:
            if checksum(payload) != header.checksum:
                raise TransferRefused(Reason.BAD_CHECKSUM, f"{header.kind.name} payload")
            if header.kind is FrameKind.BEGIN:
                layout, ticket, attempt, part = decode_begin(payload, header.flags)
                self.table.begin(rid, ticket, layout, self, attempt, part)
                if header.flags & FLAG_TRACE:  # for the decode pod's spans (telemetry)
                    kv_traces.note(rid, begin_traceparent(payload, header.flags))
            elif header.kind is FrameKind.END:
                first_token_id, total_bytes = decode_end(payload)
                self.table.end(rid, self, first_token_id, total_bytes)
            else:
                self.table.abort(rid, self, payload.decode(errors="replace"))
        except TransferRefused as refused:
            self._refused(rid, refused)

    def _data(self, header: FrameHeader) -> None:
        try:
            claim = self.table.claim(
                header.request_id, self, header.layer, header.offset, header.length
            )
        except TransferRefused as refused:
            skip(self.sock, header.length)
            self._frame_read()
            self._refused(header.request_id, refused)
            return
        try:
            recv_exact_into(self.sock, claim.view)
        except BaseException as exc:
            if isinstance(exc, (TimeoutError, BlockingIOError)):
                self._mark_stalled()
            self.table.commit(claim, self._stalled_reason() if self.stalled else make_reason(
                Reason.CONNECTION_LOST, f"mid-payload: {exc}"))  # fmt: skip
            raise
        self._frame_read()
        got = data_checksum(claim.view, header.flags)
        ok = got == header.checksum
        if not ok:
            self.refusals.add(Reason.BAD_CHECKSUM.value)
            kv_traces.checksum_failure(  # the decode pod's span shows it (traced only)
                header.request_id, layer=header.layer, offset=header.offset,
                bytes=header.length, expected=f"{header.checksum:016x}", got=f"{got:016x}",
                algorithm=checksum_name(header.flags), transport="tcp", stream=self.peer_name())
        self.table.commit(claim, None if ok else make_reason(
            Reason.BAD_CHECKSUM, f"layer {header.layer} offset {header.offset}"))  # fmt: skip


class TcpKVReceiver(ConnectorReceiver):
    """Decode pod's TCP endpoint. `expect`/`release`/`cancel`/`stats` from any thread."""

    def __init__(self, config: ReceiverConfig, listener: KVReceiveListener) -> None:
        super().__init__(config, listener, transport="tcp")
        self._stop = threading.Event()
        self._server: socket.socket | None = None
        self._connections: set[_Connection] = set()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._limit_logged_at = -_LIMIT_LOG_EVERY_S
        self._lobby: Lobby | None = None

    def open_connections(self) -> int:
        with self._lock:
            return len(self._connections)

    def pending_connections(self) -> int:
        """Connections not yet authenticated (the lobby's; read without a lock)."""
        return 0 if self._lobby is None else len(self._lobby)

    def start(self) -> None:
        files = kv_tls_files(self.config.security)
        tls = None if files is None else server_context(files)  # ValueError: bad files
        server = socket.create_server((self.config.host, self.config.port), backlog=128)
        self._server = server
        host = self.config.advertise_host or self.config.host
        self._endpoints = (f"{host}:{server.getsockname()[1]}",)
        c = self.config
        self._lobby = Lobby(server, self.table,
                            LobbyLimits(c.auth_timeout_s, c.io_timeout_s, c.max_pending,
                                        c.max_pending_per_peer),
                            self.refusals, self._promote, self._stop,
                            on_tick=self._cut_stalled, tick_s=_ACCEPT_TICK_S, tls=tls)
        if files is not None:
            log.info("KV port %s: %s (KV TLS; --no-kv-tls turns it off)", self._endpoints[0],
                     "mutual TLS" if files.mutual else "TLS")
        accept = threading.Thread(target=self._lobby.run, name="kv-tcp-accept", daemon=True)
        accept.start()
        self._threads.append(accept)
        self.sweeper.start()

    def _promote(self, sock: KVSocket, begin: FrameHeader, payload: bytes) -> None:
        """Accept thread: a connection the lobby authenticated gets its thread
        and a slot, or is closed when every slot is taken."""
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        set_io_timeout(sock, self.config.io_timeout_s)
        conn = _Connection(sock, self.table, self._stop, self.refusals,
                           self.config.io_timeout_s)  # fmt: skip
        thread = threading.Thread(target=self._serve, args=(conn, (begin, payload)),
                                  daemon=True, name="kv-tcp-conn")  # fmt: skip
        with self._lock:
            if self._stop.is_set():
                close_quietly(sock)
                return
            full = len(self._connections) >= self.config.max_connections
            if not full:
                self._connections.add(conn)
                self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        if full:
            self._refuse_over_limit(sock)
            return
        thread.start()

    def _cut_stalled(self) -> None:
        now = time.monotonic()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            conn.cut_if_stalled(now)

    def _refuse_over_limit(self, sock: KVSocket) -> None:
        self.refusals.add(PortRefusal.CONNECTION_LIMIT)  # counted before the peer sees EOF
        close_quietly(sock)
        now = time.monotonic()
        if now - self._limit_logged_at >= _LIMIT_LOG_EVERY_S:
            self._limit_logged_at = now
            log.warning("kv receiver at its limit of %d connections: refusing new ones "
                        "(counted in pdserve_kv_port_refusals_total)",
                        self.config.max_connections)

    def _serve(self, conn: _Connection, first: tuple[FrameHeader, bytes]) -> None:
        try:
            conn.run(first)
        finally:
            with self._lock:
                self._connections.discard(conn)

    def close(self) -> None:
        self._stop.set()
        self.sweeper.stop()
        if self._server is not None:
            self._server.close()
        with self._lock:
            connections = list(self._connections)
            threads = list(self._threads)
        for conn in connections:
            close_quietly(conn.sock)
        for thread in threads:
            thread.join(timeout=5)
        self.table.close()
