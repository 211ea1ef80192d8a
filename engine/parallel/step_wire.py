"""Step descriptions: what rank 0 of a tensor-parallel pod sends the other
ranks for every step it launches, so they run the same forward.

Rank 0 (`StepEncoder`, engine loop thread) owns the requests; a worker
(`StepMirror`, its one thread) keeps only what rebuilding a step needs: a
block table per request handle. A request gets a small integer handle the
first time one of its rows is sent and keeps it until rank 0 `forget`s it
(finished or aborted); a freed handle is reused only in a message that
forgets it first. Per step, rank 0 sends each scheduled row (handle, start,
token count, samples flag), the step's input token ids, block-table deltas,
the handles to forget and the prompt-logprob rows; the worker turns that
into the same `StepRow`s rank 0's `ModelRunner.prepare` made, and
`ModelRunner.build` does the rest on both sides.

Block tables travel as deltas. A request's table is append-only until it
is replaced by a new list object (`BlockManager.detach` on preemption or
finish, `match_prefix`; engine/block_manager.py states the contract), so
the encoder keeps, per handle, the list object and how many of its ids were
sent: the same object sends its new tail (APPEND, often empty), another one
the whole table (RESET).

A placeholder row (async scheduling: its input is the token the previous
step samples) carries `-1 - source` as its token id, `source` being its row
in the previous step's sampled tokens; a worker has those tokens because
rank 0 broadcasts every sampled-token tensor whose step header says
BROADCAST_SAMPLED (`engine.parallel.worker`).

A worker knows each handle's request id (the names section names every
handle the first time it is sent) and, when rank 0's step streams KV to a
`LayerKVHook` (a prefill pod), the step's spans: so a worker's hook is
called with `LayerKVSpan`s equal to rank 0's (request id, start, end, and
the slot mapping, rebuilt from the handle's table). `control_seq` orders the
step after the control messages (engine/parallel/control.py): rank 0 writes
into each worker's copy how many it had sent that worker, and the worker's
forward waits until its control thread applied that many.

Wire format (version 2): one message per step, int64 words in native byte
order (both ends run on the same machine), no pickle, no Python objects.

    header  HEADER_WORDS words: MAGIC, VERSION, kind (STEP | STOP), step
            (0, 1, ...: a worker checks none is lost or reordered), flags
            (BROADCAST_SAMPLED), graph_bucket (-1: eager), num_rows,
            num_tokens, num_table_ids, num_forget, num_prompt_rows,
            num_sampled (rows that sample = the broadcast's length),
            control_seq (control messages sent to this worker before the
            step), num_name_words, num_spans
    body    forget      [num_forget]            handles to drop, applied first
            rows        [num_rows x ROW_WORDS]  handle, start, num_new_tokens,
                                                samples, table_op, table_count
            tokens      [num_tokens]            input ids in row order
            table_ids   [num_table_ids]         each row's table_count ids
            prompt_rows [num_prompt_rows]       rows scored for prompt logprobs
            names       [num_name_words]        per handle new in this step:
                                                handle, byte length, its request
                                                id's UTF-8 bytes zero-padded to
                                                whole words
            spans       [num_spans x SPAN_WORDS] handle, start, end: the
                                                step's LayerKVSpans in order

A STOP message has zero counts; end of stream (rank 0 gone) means the same.
"""

from __future__ import annotations

import enum
import heapq
import socket
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.host_copy import to_device
from engine.kv_hook import LayerKVSpan
from engine.model_runner import PreparedStep, StepRow, slots_for

MAGIC = 0x50445450_53544550  # "PDTPSTEP"
VERSION = 2
HEADER_WORDS = 15
CONTROL_SEQ_WORD = 12  # header index rank 0 rewrites per worker (TPLeader.send_step)
ROW_WORDS = 6
SPAN_WORDS = 3
BROADCAST_SAMPLED = 1  # flags bit: rank 0 broadcasts this step's sampled token ids
_WORD = 8


class Kind(enum.IntEnum):
    STEP = 1
    STOP = 2


class TableOp(enum.IntEnum):
    APPEND = 0  # the row's table ids extend the handle's table (maybe by none)
    RESET = 1  # the row's table ids are the handle's whole table


_APPEND, _RESET = int(TableOp.APPEND), int(TableOp.RESET)  # plain ints in the row loop


class WireError(ValueError):
    """A message that is not a version-1 step description, or that does not
    fit what the worker knows (unknown handle, a step out of order)."""


@dataclass(frozen=True, slots=True)
class StepMessage:
    """One decoded message (lists of ints, one per body section)."""

    kind: Kind
    step: int
    broadcast_sampled: bool
    graph_bucket: int | None
    num_sampled: int
    forget: list[int]
    rows: list[int]  # num_rows * ROW_WORDS words
    tokens: list[int]
    table_ids: list[int]
    prompt_rows: list[int]
    control_seq: int = 0
    names: list[int] = field(default_factory=list)  # the names section's words
    spans: list[int] = field(default_factory=list)  # num_spans * SPAN_WORDS words

    @property
    def num_rows(self) -> int:
        return len(self.rows) // ROW_WORDS


def stop_message(step: int) -> bytes:
    """The message that ends a worker's loop."""
    return array("q", [MAGIC, VERSION, Kind.STOP, step, 0, -1] + [0] * 9).tobytes()


class StepEncoder:
    """Rank 0's side: handles, what each worker's tables hold, and the
    handles to forget. Engine loop thread only."""

    def __init__(self) -> None:
        self._handles: dict[str, int] = {}
        self._free: list[int] = []  # a heap: the smallest free handle first
        self._next_handle = 0
        # handle -> (the request's block-id list object, how many ids were sent)
        self._tables: dict[int, tuple[list[int], int]] = {}
        self._forget: list[int] = []
        self.num_steps = 0

    @property
    def num_known(self) -> int:
        """Requests the workers currently hold a table for."""
        return len(self._handles)

    def forget(self, request_id: str) -> None:
        """The request finished or was aborted: the next message drops its
        handle (no-op for a request never sent)."""
        handle = self._handles.pop(request_id, None)
        if handle is not None:
            del self._tables[handle]
            self._forget.append(handle)

    def encode(self, step: PreparedStep, *, broadcast_sampled: bool) -> bytes:
        """The message of `step` (built by `ModelRunner.prepare`). The row
        loop is the per-step cost rank 0 pays, hence written out flat."""
        forget, self._forget = self._forget, []
        for handle in forget:  # reusable from this message on: dropped first
            heapq.heappush(self._free, handle)
        handles, tables = self._handles, self._tables
        words: list[int] = []
        tokens: list[int] = []
        table_ids: list[int] = []
        names: list[int] = []
        num_sampled = 0
        for request_id, row in zip(step.request_ids, step.rows, strict=True):
            handle = handles.get(request_id)
            if handle is None:
                handle = self._new_handle(request_id)
                names += _name_words(handle, request_id)
            table, held = row.block_ids, tables.get(handle)
            if held is not None and held[0] is table:  # append-only: send the new tail
                op, count = _APPEND, len(table) - held[1]
                assert count >= 0, "a block table shrank in place"
                if count:
                    table_ids += table[held[1]:]
                    tables[handle] = (table, len(table))
            else:  # new, or replaced (block_manager.py's contract)
                op, count = _RESET, len(table)
                table_ids += table
                tables[handle] = (table, count)
            words += (handle, row.start, row.num_new_tokens, row.samples, op, count)
            if row.placeholder_source >= 0:
                tokens.append(-1 - row.placeholder_source)
            else:
                tokens += row.token_ids
            num_sampled += row.samples
        prompt_rows = _prompt_rows(step)
        spans: list[int] = []
        for span in () if step.context is None else step.context.spans:
            spans += (handles[span.request_id], span.start, span.end)
        bucket = -1 if step.graph_bucket is None else step.graph_bucket
        message = array("q", (MAGIC, VERSION, Kind.STEP.value, self.num_steps,
                              BROADCAST_SAMPLED if broadcast_sampled else 0, bucket,
                              len(step.rows), len(tokens), len(table_ids), len(forget),
                              len(prompt_rows), num_sampled, 0, len(names),
                              len(spans) // SPAN_WORDS))
        self.num_steps += 1
        for section in (forget, words, tokens, table_ids, prompt_rows, names, spans):
            message.fromlist(section)
        return message.tobytes()

    def _new_handle(self, request_id: str) -> int:
        if self._free:
            handle = heapq.heappop(self._free)
        else:
            handle, self._next_handle = self._next_handle, self._next_handle + 1
        self._handles[request_id] = handle
        return handle


def _name_words(handle: int, request_id: str) -> list[int]:
    """A names-section entry: handle, byte length, the UTF-8 bytes in words."""
    raw = request_id.encode()
    padded = raw + bytes(-len(raw) % _WORD)
    return [handle, len(raw), *memoryview(padded).cast("q").tolist()]


def _prompt_rows(step: PreparedStep) -> list[int]:
    """The plan's hidden-state rows on the host, from its spans (the plan's
    own `rows` live on the device; reading them back would wait for it)."""
    plan = step.prompt_logprobs
    if plan is None:
        return []
    offsets: dict[str, tuple[int, int]] = {}
    row = 0
    for request_id, r in zip(step.request_ids, step.rows, strict=True):
        offsets[request_id] = (row, r.start)
        row += r.num_new_tokens
    rows: list[int] = []
    for span in plan.spans:
        base, start = offsets[span.request.request_id]
        first = base + span.first_token - 1 - start  # row of prompt position first_token - 1
        rows.extend(range(first, first + len(span.token_ids)))
    return rows


def decode(buffer: bytes | bytearray | memoryview) -> StepMessage:
    """A message from its bytes; WireError when it is not one."""
    view = memoryview(buffer).cast("B")
    if len(view) < HEADER_WORDS * _WORD or len(view) % _WORD:
        raise WireError(f"a step message is whole int64 words, at least {HEADER_WORDS}; "
                        f"got {len(view)} bytes")
    words = view.cast("q").tolist()
    header, body = words[:HEADER_WORDS], words[HEADER_WORDS:]
    if len(body) != body_words(header):
        raise WireError(f"the header announces {body_words(header)} body words, "
                        f"{len(body)} came")
    (_, _, kind, step, flags, bucket, num_rows, num_tokens, num_table_ids, num_forget,
     num_prompt_rows, num_sampled, control_seq, num_name_words, num_spans) = header
    ends = _ends(num_forget, num_rows * ROW_WORDS, num_tokens, num_table_ids, num_prompt_rows,
                 num_name_words, num_spans * SPAN_WORDS)
    return StepMessage(
        kind=Kind(kind), step=step, broadcast_sampled=bool(flags & BROADCAST_SAMPLED),
        graph_bucket=None if bucket < 0 else bucket, num_sampled=num_sampled,
        forget=body[: ends[0]], rows=body[ends[0] : ends[1]], tokens=body[ends[1] : ends[2]],
        table_ids=body[ends[2] : ends[3]], prompt_rows=body[ends[3] : ends[4]],
        control_seq=control_seq, names=body[ends[4] : ends[5]], spans=body[ends[5] : ends[6]])


def body_words(header: Sequence[int]) -> int:
    """Body length in words announced by a header; WireError for a header
    that is not this version's."""
    if header[0] != MAGIC:
        raise WireError(f"not a step message (magic {header[0]:#x})")
    if header[1] != VERSION:
        raise WireError(f"step message version {header[1]}, this worker reads {VERSION}")
    if header[2] not in (Kind.STEP, Kind.STOP):
        raise WireError(f"unknown step message kind {header[2]}")
    counts = [*header[6:11], *header[13:15]]
    if min(counts) < 0:
        raise WireError(f"negative section length in {counts}")
    num_rows, num_tokens, num_table_ids, num_forget, num_prompt_rows, num_names, num_spans = counts
    return (num_forget + num_rows * ROW_WORDS + num_tokens + num_table_ids + num_prompt_rows
            + num_names + num_spans * SPAN_WORDS)


def _ends(*lengths: int) -> list[int]:
    ends, total = [], 0
    for n in lengths:
        total += n
        ends.append(total)
    return ends


def send(sock: socket.socket, message: bytes) -> None:
    """Write one message (blocks while the worker's socket buffer is full)."""
    sock.sendall(message)


def receive(sock: socket.socket) -> StepMessage | None:
    """Read one message; None at end of stream (rank 0 is gone)."""
    head = _read_exactly(sock, HEADER_WORDS * _WORD)
    if head is None:
        return None
    body = _read_exactly(sock, body_words(memoryview(head).cast("q").tolist()) * _WORD)
    if body is None:
        raise WireError("the stream ended inside a step message")
    return decode(head + body)


def _read_exactly(sock: socket.socket, size: int) -> bytearray | None:
    """`size` bytes, or None at end of stream before the first byte."""
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            if got == 0:
                return None
            raise WireError(f"the stream ended after {got} of {size} bytes")
        got += n
    return buffer


class StepMirror:
    """A worker's side: each handle's block table and request id, and the
    rows (and spans) of each step rebuilt from a message. The worker's loop
    thread only."""

    def __init__(self) -> None:
        self.tables: dict[int, list[int]] = {}
        self.names: dict[int, str] = {}
        self.next_step = 0

    def apply(self, message: StepMessage) -> list[StepRow]:
        """Update the tables from a STEP message; its rows, in message order
        (rank 0's batch order). WireError when it does not follow the last."""
        if message.step != self.next_step:
            raise WireError(f"step message {message.step} arrived, {self.next_step} was next")
        self.next_step += 1
        for handle in message.forget:
            if self.tables.pop(handle, None) is None:
                raise WireError(f"forget of unknown handle {handle}")
            self.names.pop(handle, None)
        names, i = message.names, 0
        while i < len(names):
            handle, size = names[i], names[i + 1]
            end = i + 2 + -(-size // _WORD)
            self.names[handle] = array("q", names[i + 2 : end]).tobytes()[:size].decode()
            i = end
        rows: list[StepRow] = []
        words, tokens, table_ids = message.rows, message.tokens, message.table_ids
        next_token = next_id = 0
        for i in range(0, len(words), ROW_WORDS):
            handle, start, num_new, samples, op, count = words[i : i + ROW_WORDS]
            new_ids = table_ids[next_id : next_id + count]
            next_id += count
            if op == TableOp.RESET:
                table = self.tables[handle] = new_ids
            elif (table := self.tables.get(handle)) is None:
                raise WireError(f"APPEND to unknown handle {handle}")
            else:
                table.extend(new_ids)
            ids = tokens[next_token : next_token + num_new]
            next_token += num_new
            if num_new == 1 and ids[0] < 0:
                rows.append(StepRow(start, 1, bool(samples), table, (), -1 - ids[0]))
            else:
                rows.append(StepRow(start, num_new, bool(samples), table, ids))
        return rows

    def spans(self, message: StepMessage, block_size: int,
              device: torch.device) -> tuple[LayerKVSpan, ...]:
        """The step's `LayerKVSpan`s as rank 0 made them (after `apply`):
        the slot mappings from the handles' tables."""
        words = message.spans
        spans = []
        for i in range(0, len(words), SPAN_WORDS):
            handle, start, end = words[i : i + SPAN_WORDS]
            slots = to_device(slots_for(self.tables[handle], block_size, start, end), device)
            spans.append(LayerKVSpan(self.names[handle], start, end, slots))
        return tuple(spans)
