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

Transfer layout (docs/architecture.md): per layer `[2, num_tokens, kv_heads,
head_dim]` contiguous, K rows then V rows. A chunk of tokens `[a, b)` of a
layer is two byte ranges: K at `a * row_bytes`, V at `(num_tokens + a) * row_bytes`.
"""

from __future__ import annotations

import abc
import enum
import math
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from kv_transfer.errors import InvalidTransition, root_reason
from proto.address import split_host_port

# dtype name -> (torch dtype, bytes per element); the names are the wire names
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "float32": (torch.float32, 4),
    "bfloat16": (torch.bfloat16, 2),
    "float16": (torch.float16, 2),
}
DTYPE_CODES: dict[str, int] = {"float32": 1, "bfloat16": 2, "float16": 3}

MAX_LAYERS = 1024
MAX_TOKENS = 1 << 22
MAX_KV_HEADS = 1024
MAX_HEAD_DIM = 4096
MAX_TICKET_BYTES = 512
TRANSPORTS = ("tcp", "grpc")


def _check_int(name: str, value: int, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one request's KV in transfer layout: all layers, context tokens
    `[token_offset, token_offset + num_tokens)`.

    `token_offset` > 0 is a cache-miss-only transfer: the decode pod already
    holds the first `token_offset` context tokens (whole blocks of its prefix
    cache), so row 0 of each layer is context token `token_offset`. Both ends
    must agree on it (BEGIN carries it; a mismatch is `layout_mismatch`)."""

    num_layers: int
    num_tokens: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    token_offset: int = 0

    def __post_init__(self) -> None:
        _check_int("num_layers", self.num_layers, 1, MAX_LAYERS)
        _check_int("num_tokens", self.num_tokens, 1, MAX_TOKENS)
        _check_int("token_offset", self.token_offset, 0, MAX_TOKENS)
        _check_int("num_kv_heads", self.num_kv_heads, 1, MAX_KV_HEADS)
        _check_int("head_dim", self.head_dim, 1, MAX_HEAD_DIM)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][0]

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's K (or V) for one layer: kv_heads * head_dim * itemsize."""
        return self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def rows_per_layer(self) -> int:
        """K rows then V rows: 2 * num_tokens."""
        return 2 * self.num_tokens

    @property
    def bytes_per_layer(self) -> int:
        return self.rows_per_layer * self.row_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_layers * self.bytes_per_layer

    @property
    def layer_shape(self) -> tuple[int, int, int, int]:
        return (2, self.num_tokens, self.num_kv_heads, self.head_dim)

    def check_chunk(self, layer: int, kv: torch.Tensor, token_start: int) -> None:
        """Raise ValueError unless `kv` is `layer`'s KV for tokens from `token_start` on."""
        _check_int("layer", layer, 0, self.num_layers - 1)
        if kv.dim() != 4 or kv.shape[0] != 2 or tuple(kv.shape[2:]) != (
            self.num_kv_heads,
            self.head_dim,
        ):
            raise ValueError(
                f"kv must have shape [2, n, {self.num_kv_heads}, {self.head_dim}], "
                f"got {list(kv.shape)}"
            )
        if kv.dtype != self.torch_dtype:
            raise ValueError(f"kv dtype must be {self.torch_dtype}, got {kv.dtype}")
        n = kv.shape[1]
        _check_int("token_start", token_start, 0, self.num_tokens - 1)
        if n < 1 or token_start + n > self.num_tokens:
            raise ValueError(
                f"tokens [{token_start}, {token_start + n}) are outside [0, {self.num_tokens})"
            )


@dataclass(frozen=True, slots=True)
class TransferTarget:
    """Where and how a prefill pod sends one request's KV; issued by `KVReceiver.expect`.

    `deadline` is unix seconds: after it the receiver fails the transfer and
    frees its landing buffer, whatever state it is in (a receiver given a
    transfer timeout may fail a started attempt earlier, `KVReceiver.expect`).
    """

    endpoints: tuple[str, ...]
    ticket: bytes
    transport: str
    generation: int
    deadline: float

    def __post_init__(self) -> None:
        if not isinstance(self.endpoints, tuple) or not self.endpoints:
            raise ValueError(f"endpoints must be a non-empty tuple, got {self.endpoints!r}")
        for endpoint in self.endpoints:
            split_endpoint(endpoint)
        if not isinstance(self.ticket, bytes) or not 0 < len(self.ticket) <= MAX_TICKET_BYTES:
            raise ValueError(f"ticket must be 1..{MAX_TICKET_BYTES} bytes")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        _check_int("generation", self.generation, 0, (1 << 63) - 1)
        if not isinstance(self.deadline, (int, float)) or not math.isfinite(self.deadline):
            raise ValueError(f"deadline must be finite unix seconds, got {self.deadline!r}")


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """'host:port' -> (host, port) for a socket (an IPv6 literal loses its
    brackets); raises ValueError naming the bad endpoint."""
    host, port = split_host_port(endpoint, "endpoint")
    return host.strip("[]"), port


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
    (made contiguous if it is not) and must not be modified by the caller
    afterwards; the engine hands in a freshly extracted tensor. A CUDA tensor
    is copied D2H into pinned memory on the sender's own CUDA stream, ordered
    after the caller's current stream with an event; the caller's stream is
    never blocked. The caller may drop the CUDA tensor at once (`record_stream`
    keeps its memory from being reused before the copy ran) but must not write
    into it in place. The host copy is freed once sent.
    """

    @abc.abstractmethod
    def begin(self, request_id: str, target: TransferTarget, layout: KVLayout) -> None:
        """Start a transfer; raises ValueError for a duplicate id or a target of another
        transport. Connection problems surface in the outcome, not here."""

    @abc.abstractmethod
    def send_layer(self, request_id: str, layer: int, kv: torch.Tensor, token_start: int) -> None:
        """Queue tokens [token_start, token_start + kv.shape[1]) of `layer` (kv [2, n, H, D]).

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
        view of the landing buffer, valid until `release(request_id)`. Delivered in
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
    # sender connections open now (TCP; 0 for gRPC, whose server owns them)
    open_connections: int = 0


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
