"""KV transfer interfaces: the layout, the target, the outcome, the sender and receiver.

Life cycle of one transfer (request R, prefill pod P sends to decode pod D):

    D: receiver.expect(R, layout, deadline) -> TransferTarget   (landing buffer reserved,
                                                                  ticket issued)
       ... router carries the TransferTarget to P ...
    P: sender.begin(R, target, layout)                          BEGIN on every stream
    P: sender.send_layer(R, layer, kv, token_start)  x many     DATA frames, sliced across
                                                                  the streams
    D: listener.on_layer_ready(R, layer, view)       in layer order, once all bytes of a
                                                                  layer have landed
    P: sender.end(R, first_token_id) -> Future[TransferOutcome] END after the last DATA
    D: listener.on_complete(R, first_token_id)                  verdict goes back to P
    D: receiver.release(R)                                      landing buffer back to pool

Either side may stop early: `sender.abort` (P) or `receiver.cancel` (D); each
side then learns an explicit FAILED outcome with a reason, and D frees the
landing buffer once no receiver thread can still write into it. Nothing waits
without a deadline: D's collector fails transfers whose deadline passed and
frees buffers nobody released within the claim grace period.

Transfer layout (`KVLayout`, layout.py; docs/architecture.md): per layer
`[2, num_tokens, kv_heads, head_dim]` contiguous, K rows then V rows. A chunk
of tokens `[a, b)` of a layer is two byte ranges: K at `a * row_bytes`, V at
`(num_tokens + a) * row_bytes`. A head-ranged layout (a TP > 1 decode rank's
heads, possibly written by several prefill ranks: `begin(..., heads=,
attempt=, num_senders=)`) is head-major instead; layout.py has both byte maps.
The target (`TransferTarget`, target.py) lists one receiver per decode rank.
"""

from __future__ import annotations

import abc
import enum
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from kv_transfer.errors import InvalidTransition, root_reason
from kv_transfer.layout import (  # noqa: F401 - re-exported: the layout is part of the interface
    DTYPE_CODES,
    DTYPES,
    MAX_HEAD_DIM,
    MAX_KV_HEADS,
    MAX_LAYERS,
    MAX_TOKENS,
    KVLayout,
)
from kv_transfer.target import (  # noqa: F401 - re-exported: the target is part of the interface
    MAX_TICKET_BYTES,
    TRANSPORTS,
    RankTarget,
    TransferTarget,
    split_endpoint,
)


class Verdict(enum.Enum):
    COMPLETE = "complete"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class TransferOutcome:
    """How a transfer ended, as both sides see it. `reason` is empty iff COMPLETE."""

    verdict: Verdict
    reason: str = ""

    def __post_init__(self) -> None:
        if (self.verdict is Verdict.COMPLETE) != (self.reason == ""):
            raise ValueError("a COMPLETE outcome has no reason; a FAILED one must have one")

    @property
    def ok(self) -> bool:
        return self.verdict is Verdict.COMPLETE

    @staticmethod
    def complete() -> TransferOutcome:
        return TransferOutcome(Verdict.COMPLETE)

    @staticmethod
    def failed(reason: str) -> TransferOutcome:
        """Failed for `reason` (unwrapped to the first failure's own when it
        is a refusal of a frame that came after the transfer ended)."""
        return TransferOutcome(Verdict.FAILED, root_reason(reason))


class TransferState(enum.Enum):
    """One transfer's state, on either side.

    EXPECTED (receiver registered it) -> STARTED (BEGIN seen/sent) -> ENDING (END
    seen/sent, waiting for the last bytes or the verdict) -> COMPLETE; any
    non-terminal state -> FAILED. COMPLETE/FAILED -> RELEASED once the landing
    buffer (receiver) or the staged host copies (sender) are freed.

    Receiver only: STARTED/ENDING -> SENDER_LOST when the sending attempt went
    away before END (its stream broke, it sent ABORT, or a newer attempt's BEGIN
    superseded it); SENDER_LOST -> STARTED on the next attempt's BEGIN, or FAILED
    (deadline, cancel). The landing buffer and the ticket stay; progress restarts
    from layer 0.
    """

    EXPECTED = "expected"
    STARTED = "started"
    ENDING = "ending"
    SENDER_LOST = "sender_lost"
    COMPLETE = "complete"
    FAILED = "failed"
    RELEASED = "released"

    @property
    def terminal(self) -> bool:
        return self in (TransferState.COMPLETE, TransferState.FAILED, TransferState.RELEASED)

    def to(self, new: TransferState) -> TransferState:
        """Return `new` if the transition is allowed, else raise InvalidTransition."""
        if new not in _TRANSITIONS[self]:
            raise InvalidTransition(f"transfer state {self.name} -> {new.name} is not allowed")
        return new


_TRANSITIONS: dict[TransferState, frozenset[TransferState]] = {
    TransferState.EXPECTED: frozenset({TransferState.STARTED, TransferState.FAILED}),
    TransferState.STARTED: frozenset(
        {TransferState.ENDING, TransferState.SENDER_LOST, TransferState.FAILED}
    ),
    TransferState.ENDING: frozenset(
        {TransferState.COMPLETE, TransferState.SENDER_LOST, TransferState.FAILED}
    ),
    TransferState.SENDER_LOST: frozenset({TransferState.STARTED, TransferState.FAILED}),
    TransferState.COMPLETE: frozenset({TransferState.RELEASED}),
    TransferState.FAILED: frozenset({TransferState.RELEASED}),
    TransferState.RELEASED: frozenset(),
}


class KVSender(abc.ABC):
    """Prefill side: pushes requests' KV to decode pods. One per pod, thread-safe.

    Methods are called from the engine loop thread (begin, send_layer, end) and
    from service threads (abort, close). None of them blocks on the network:
    they enqueue work for the sender's own I/O threads.

    Memory: `send_layer` takes ownership of `kv`. A CPU tensor is used in place
    (made contiguous if it is not, e.g. head-major for a head-ranged layout)
    and must not be modified by the caller afterwards; the engine hands in a
    freshly extracted tensor. A CUDA tensor is copied D2H into pinned memory on
    the sender's own CUDA stream, ordered after the caller's current stream
    with an event; the caller's stream is never blocked. The caller may drop
    the CUDA tensor at once (`record_stream` keeps its memory from being reused
    before the copy ran) but must not write into it in place. The host copy is freed once sent.
    """

    @abc.abstractmethod
    def begin(self, request_id: str, target: TransferTarget, layout: KVLayout, *,
              heads: tuple[int, int] | None = None, attempt: bytes | None = None,
              num_senders: int = 1) -> None:  # fmt: skip
        """Start a transfer; raises ValueError for a duplicate id, a target of another
        transport, or heads/senders a whole-model layout cannot have. Connection
        problems surface in the outcome, not here.

        Several senders (one per prefill rank) may fill one head-ranged `layout`
        (a decode rank's heads): each begins with its own `heads` (layout-local
        [start, end), None = all), the same `attempt` id (bytes, up to 16; None =
        a fresh random one, for a single sender) and `num_senders` = how many
        of them write this layout; the receiver completes the transfer once
        every sender's END and every byte are in."""

    @abc.abstractmethod
    def send_layer(self, request_id: str, layer: int, kv: torch.Tensor, token_start: int) -> None:
        """Queue tokens [token_start, token_start + kv.shape[1]) of `layer` (kv [2, n, H, D],
        H = this sender's heads: `begin`'s `heads`, all of the layout's by default).

        Raises ValueError on a shape/dtype/range mismatch or an unknown request.
        A transfer that already failed silently drops the data (its outcome says why).
        """

    @abc.abstractmethod
    def end(self, request_id: str, first_token_id: int) -> Future[TransferOutcome]:
        """Queue END after every queued DATA frame; the future resolves with the
        receiver's verdict (or FAILED on abort, connection loss or deadline)."""

    @abc.abstractmethod
    def abort(self, request_id: str, reason: str) -> None:
        """Stop sending, tell the receiver (ABORT), fail the outcome. Unknown ids are ignored."""

    @abc.abstractmethod
    def close(self) -> None:
        """Fail every open transfer with reason `closed`, close connections, join threads."""


class KVReceiveListener(abc.ABC):
    """What the decode pod's injector implements. Called from receiver I/O
    threads (and the collector thread for on_failed); implementations must be
    quick and must not call back into the receiver for the same request from
    `on_layer_ready` except `cancel`."""

    @abc.abstractmethod
    def on_layer_ready(self, request_id: str, layer: int, kv_view: torch.Tensor) -> None:
        """All bytes of `layer` landed and were verified. `kv_view` [2, T, H, D] is a
        view of the landing buffer, valid until `release(request_id)`; for a
        head-ranged layout (and a whole-model one filled in its head-major
        form) it is a permuted, non-contiguous view of head-major bytes. Delivered in
        layer order: layer l only after layers 0..l-1."""

    @abc.abstractmethod
    def on_complete(self, request_id: str, first_token_id: int) -> None:
        """Every layer was delivered and END was accepted."""

    @abc.abstractmethod
    def on_failed(self, request_id: str, reason: str) -> None:
        """The transfer failed; views handed out before must no longer be read once the
        consumer calls `release` (or the claim grace period passes)."""

    def on_restart(self, request_id: str, reason: str) -> None:  # noqa: B027 - optional hook
        """The sending attempt went away before END (`reason` starts with
        `sender_lost`); layers will be delivered again from layer 0 by the next
        attempt, into the same landing buffer. Called in order with the other
        hooks for this request; once it returns, the consumer must no longer read
        views handed out before (the next attempt overwrites them). Consumers that
        only read views after `on_complete` keep no progress and need nothing."""


@dataclass(frozen=True, slots=True)
class ReceiverStats:
    """Snapshot for metrics (`pdserve_kv_landing_bytes_in_use`, failures by reason)."""

    bytes_in_use: int
    capacity_bytes: int
    active_transfers: int
    completed: int
    bytes_received: int
    failures: dict[str, int]
    unclaimed_freed: int
    # attempts that went away before END (the transfer waited for another BEGIN)
    senders_lost: int = 0
    # frames refused because their stream belongs to a superseded attempt
    stale_frames: int = 0
    # frames and connections the port refused, by reason (kv_transfer/refusals.py)
    refusals: dict[str, int] = field(default_factory=dict)
    # sender connections open now (TCP; 0 for gRPC, whose server owns them):
    # authenticated ones, and ones waiting to authenticate (kv_transfer/tcp/lobby.py)
    open_connections: int = 0
    pending_connections: int = 0


class KVReceiver(abc.ABC):
    """Decode side: accepts KV pushed by prefill pods into landing buffers.

    `expect`, `release`, `cancel` and `stats` are called from the decode
    service's threads/loop (never blocking on the network); the listener is
    called from the receiver's threads. Landing buffers belong to the receiver's
    pool: the consumer borrows views from `on_layer_ready` until `release`.
    """

    @abc.abstractmethod
    def start(self) -> None:
        """Open the listening endpoint(s) and start the I/O and collector threads."""

    @abc.abstractmethod
    def close(self) -> None:
        """Fail open transfers with reason `closed`, stop threads, free buffers."""

    @property
    @abc.abstractmethod
    def endpoints(self) -> tuple[str, ...]:
        """'host:port' addresses senders connect to (valid after start())."""

    @abc.abstractmethod
    def expect(self, request_id: str, layout: KVLayout, deadline: float,
               transfer_timeout_s: float | None = None) -> TransferTarget:
        """Reserve a landing buffer and issue a ticket valid until `deadline`.

        Without `transfer_timeout_s` the transfer fails once `deadline` passes,
        whatever its state. With it, the deadline is per phase: while no sender
        is sending (before the first BEGIN, or after a sender was lost) the
        transfer waits until `deadline`; each sending attempt must finish
        within `transfer_timeout_s` of its BEGIN (and by `deadline`). So a
        prefill that is merely queued does not use up the transfer's time.

        The ticket expires at `deadline`: receivers sharing the ticket secret and
        generation (the ranks of one decode pod) issue the same bytes for the
        same request and deadline, and each accepts the others' tickets.

        Raises `BufferPoolExhausted` when the pool cannot hold `layout.total_bytes`
        now (back-pressure: nothing is queued), ValueError for a duplicate id or a
        deadline in the past."""

    @abc.abstractmethod
    def release(self, request_id: str) -> bool:
        """The consumer is done with the landing buffer. Returns False if unknown."""

    @abc.abstractmethod
    def cancel(self, request_id: str, reason: str) -> bool:
        """Decode-side abort: fail the transfer, tell the sender, free the buffer once no
        writer can touch it. Returns False if the id is unknown or already finished."""

    @abc.abstractmethod
    def stats(self) -> ReceiverStats:
        """Counters and gauges for metrics."""
