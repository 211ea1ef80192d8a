"""The control channel of a tensor-parallel pod: messages between rank 0 and
each worker beside the step descriptions, for the services' per-rank work
(a decode rank's KV receiver, a prefill rank's KV sender).

One Unix socketpair per worker (`TPLeader.start` makes it only when the
engine config names a rank service), carrying messages both ways:

    u32 length (of what follows) | u16 kind | u32 JSON length |
    JSON object of primitives    | raw payload bytes (e.g. an int64 slot mapping)

Little-endian; no pickle. A kind is a small integer the service defines
(decode_service/rank_kv.py, prefill_service/...): the engine carries
messages, it never reads them.

Who calls what:

* rank 0 (`LeaderControl`, one per worker, inside `TPLeader`):
  `send` from any thread (a lock keeps each message whole and the count
  exact); a reader thread per worker hands every reply to the handler
  registered with `TPLeader.on_control`.
* a worker (`WorkerControl`): `send` from any thread (the rank service's
  replies); one reader thread calls `RankService.on_control` for each
  message in order and then counts it processed; the step loop calls
  `wait_processed(step.control_seq, ...)` before the step's forward, so
  every message rank 0 sent before that step (an EXPORT of a request the
  step computes) has been applied.

A rank service is named "module:function" (`EngineConfig.rank_service`);
the worker imports it by name (engine/ never imports a service package)
and calls `function(spec, rank_model, group, control)` after building its
rank; the `RankService` returned lives until the worker stops.
"""

from __future__ import annotations

import importlib
import json
import logging
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.kv_hook import LayerKVHook

log = logging.getLogger(__name__)

_LENGTH = struct.Struct("<I")
_HEAD = struct.Struct("<HI")  # kind, JSON length
MAX_MESSAGE_BYTES = 1 << 30
MAX_KIND = 0xFFFF


class ControlError(RuntimeError):
    """A malformed control message, or a worker whose rank service failed
    or fell behind: the pod cannot step any more."""


@dataclass(frozen=True, slots=True)
class ControlMessage:
    kind: int
    fields: dict[str, Any]
    payload: bytes = b""


def encode(kind: int, fields: dict[str, Any], payload: bytes = b"") -> bytes:
    """One message's bytes. ValueError for a kind outside u16 or fields that
    are not JSON primitives (json refuses any other object: no pickle)."""
    if not 0 <= kind <= MAX_KIND:
        raise ValueError(f"control kind must be in [0, {MAX_KIND}], got {kind}")
    if not isinstance(fields, dict):
        raise ValueError(f"control fields must be a dict, got {type(fields).__name__}")
    text = json.dumps(fields, allow_nan=False, separators=(",", ":")).encode()
    length = _HEAD.size + len(text) + len(payload)
    if length > MAX_MESSAGE_BYTES:
        raise ValueError(f"a control message is at most {MAX_MESSAGE_BYTES} bytes, got {length}")
    return b"".join((_LENGTH.pack(length), _HEAD.pack(kind, len(text)), text, bytes(payload)))


def receive(sock: socket.socket) -> ControlMessage | None:
    """The next message; None at end of stream (the other side is gone)."""
    head = _read_exactly(sock, _LENGTH.size, at_start=True)
    if head is None:
        return None
    (length,) = _LENGTH.unpack(head)
    if not _HEAD.size <= length <= MAX_MESSAGE_BYTES:
        raise ControlError(f"control message length {length} out of range")
    body = _read_exactly(sock, length, at_start=False)
    kind, text_length = _HEAD.unpack_from(body)
    end = _HEAD.size + text_length
    if end > length:
        raise ControlError(f"control message JSON length {text_length} exceeds its {length} bytes")
    fields = json.loads(bytes(body[_HEAD.size : end]))
    if not isinstance(fields, dict):
        raise ControlError("control message fields are not a JSON object")
    return ControlMessage(kind, fields, bytes(body[end:]))


def _read_exactly(sock: socket.socket, size: int, *, at_start: bool) -> bytearray | None:
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            if got == 0 and at_start:
                return None
            raise ControlError(f"the control stream ended after {got} of {size} bytes")
        got += n
    return buffer


class _End:
    """One side of a worker's control socket: whole messages out, counted."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._lock = threading.Lock()
        self._sent = 0

    @property
    def sent(self) -> int:
        """Messages written so far (each whole on the socket when counted)."""
        return self._sent

    def send(self, kind: int, fields: dict[str, Any], payload: bytes = b"") -> int:
        """Write one message; returns its sequence number (1, 2, ...).
        OSError when the other side is gone."""
        message = encode(kind, fields, payload)
        with self._lock:
            self.sock.sendall(message)
            self._sent += 1
            return self._sent

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


ControlHandler = Callable[[int, int, dict[str, Any], bytes], object]


class LeaderControl(_End):
    """Rank 0's end of one worker's control socket (`TPLeader` owns them)."""

    def start_reader(self, rank: int, deliver: ControlHandler) -> threading.Thread:
        """A thread passing each message from the worker to
        `deliver(rank, kind, fields, payload)` until end of stream (a dead
        worker is the watchdog's to report)."""

        def read() -> None:
            try:
                while (message := receive(self.sock)) is not None:
                    deliver(rank, message.kind, message.fields, message.payload)
            except (OSError, ControlError) as exc:
                log.debug("control reader of rank %d stops: %s", rank, exc)

        thread = threading.Thread(target=read, name=f"tp-rank{rank}-control", daemon=True)
        thread.start()
        return thread


class ControlHub:
    """Rank 0's control sockets, one per worker (rank r at index r - 1), and
    the handler their replies go to; `TPLeader` owns it."""

    def __init__(self, controls: list[LeaderControl]) -> None:
        self._controls = controls
        self._lock = threading.Lock()
        self._handler: ControlHandler | None = None
        self._early: list[tuple[int, int, dict[str, Any], bytes]] = []  # before a handler

    @property
    def size(self) -> int:
        return len(self._controls)

    @property
    def sent(self) -> tuple[int, ...]:
        return tuple(control.sent for control in self._controls)

    def start_readers(self) -> list[threading.Thread]:
        return [control.start_reader(rank, self._deliver)
                for rank, control in enumerate(self._controls, start=1)]

    def send(self, rank: int, kind: int, fields: dict[str, Any], payload: bytes = b"") -> int:
        if not 1 <= rank <= len(self._controls):
            raise ValueError(f"control message to rank {rank}: the pod's control channels "
                             f"are ranks 1..{len(self._controls)}")
        return self._controls[rank - 1].send(kind, fields, payload)

    def on_control(self, handler: ControlHandler) -> None:
        """Register the handler; messages that came before it are handed
        over now, in order (a worker's READY may precede its service's
        rank 0 side)."""
        with self._lock:
            self._handler = handler
            early, self._early = self._early, []
        for message in early:
            handler(*message)

    def _deliver(self, rank: int, kind: int, fields: dict[str, Any], payload: bytes) -> None:
        with self._lock:
            handler = self._handler
            if handler is None:
                self._early.append((rank, kind, fields, payload))
                return
        try:
            handler(rank, kind, fields, payload)
        except Exception:  # noqa: BLE001 - a handler's bug must not end the reader
            log.exception("control message %d from rank %d failed", kind, rank)

    def close(self) -> None:
        for control in self._controls:
            control.close()


class RankService(Protocol):
    """What a worker's rank service gives back (see the module docstring)."""

    layer_kv_hook: LayerKVHook | None  # the rank's runner calls it (None: no KV streaming)

    def on_control(self, kind: int, fields: dict[str, Any], payload: bytes) -> None:
        """The worker's control thread, one message at a time, in order."""

    def close(self) -> None:
        """The worker stops (its step loop ended)."""


@dataclass(slots=True)
class _Progress:
    processed: int = 0
    failure: str | None = None
    ended: bool = False
    changed: threading.Condition = field(default_factory=threading.Condition)


class WorkerControl(_End):
    """A worker's end: replies out (`send`), messages in on one thread."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock)
        self._progress = _Progress()

    def start(self, service: RankService,
              on_failure: Callable[[str], object] | None = None) -> threading.Thread:
        """Dispatch messages to `service` on a new thread, counting each
        once `on_control` returned. A service that raises fails the next
        `wait_processed` and calls `on_failure(reason)` (the worker exits
        then: an idle pod must go down too, not leave rank 0 waiting for a
        reply that never comes)."""
        thread = threading.Thread(target=self._read, args=(service, on_failure),
                                  name="tp-control", daemon=True)
        thread.start()
        return thread

    def _read(self, service: RankService, on_failure: Callable[[str], object] | None) -> None:
        progress = self._progress
        try:
            while (message := receive(self.sock)) is not None:
                service.on_control(message.kind, message.fields, message.payload)
                with progress.changed:
                    progress.processed += 1
                    progress.changed.notify_all()
        except Exception as exc:  # noqa: BLE001 - reported to the step loop, which exits
            log.exception("control message failed")
            with progress.changed:
                progress.failure = f"{type(exc).__name__}: {exc}"
                progress.changed.notify_all()
            if on_failure is not None:
                on_failure(progress.failure)
            return
        with progress.changed:
            progress.ended = True
            progress.changed.notify_all()

    @property
    def processed(self) -> int:
        return self._progress.processed

    def wait_processed(self, seq: int, timeout: float) -> None:
        """Block until `seq` messages were processed. ControlError when the
        service failed, the stream ended first, or `timeout` passed (a stalled
        service takes the pod down like a stalled collective)."""
        progress = self._progress
        with progress.changed:
            done = progress.changed.wait_for(
                lambda: progress.processed >= seq or progress.failure is not None
                or progress.ended, timeout)
            if progress.processed >= seq:
                return
            if progress.failure is not None:
                raise ControlError(f"the rank service failed: {progress.failure}")
            if progress.ended:
                raise ControlError(f"the control stream ended after {progress.processed} of "
                                   f"{seq} messages")
            assert not done
            raise ControlError(f"control message {seq} not processed within {timeout:g}s "
                               f"({progress.processed} were)")


def load_rank_service(name: str) -> Callable[..., RankService]:
    """The function a "module:function" name denotes (imported here, by name)."""
    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function)


def check_rank_service_name(name: str) -> None:
    """ValueError unless `name` is "" or "dotted.module:function"."""
    if not name:
        return
    module, sep, function = name.partition(":")
    parts = module.split(".")
    if not sep or not function.isidentifier() or not all(p.isidentifier() for p in parts):
        raise ValueError(f"rank_service must be 'package.module:function', got {name!r}")
