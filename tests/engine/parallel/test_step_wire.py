"""Step descriptions (engine.parallel.step_wire): the wire round trip, and a
worker's rebuild of every step equal, tensor for tensor, to what rank 0's
`ModelRunner.prepare` built, over a real engine's steps: new requests,
chunked prefill with context, decode, preemption (tables replaced), finishes
and aborts, async placeholders, prefix-cache hits and prompt logprobs."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from engine.cuda_graphs import DecodeGraphs
from engine.model_runner import ModelRunner, PreparedStep, StepRow
from engine.parallel.step_wire import (
    HEADER_WORDS,
    MAGIC,
    ROW_WORDS,
    Kind,
    StepEncoder,
    StepMirror,
    TableOp,
    WireError,
    decode,
    receive,
    send,
    stop_message,
)
from engine.parallel.worker import prompt_plan
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(180)


def _step(rows: list[StepRow], request_ids: list[str], *, bucket: int | None = None
          ) -> PreparedStep:
    """A rank-0 step as the encoder reads it (rows and ids; no tensors needed)."""
    none = torch.empty(0, dtype=torch.long)
    return PreparedStep(input_ids=none, positions=none, context=None, graph_bucket=bucket,
                        sample_rows=none, sampling_requests=(), placeholder_rows=none,
                        placeholder_sources=none, rows=tuple(rows),
                        request_ids=tuple(request_ids))


def test_round_trip_and_incremental_tables():
    encoder, mirror = StepEncoder(), StepMirror()
    table_a, table_b = [7, 3], [5]
    first = decode(encoder.encode(_step(
        [StepRow(0, 3, False, table_a, [11, 12, 13]),
         StepRow(0, 2, True, table_b, [21, 22])], ["a", "b"]), broadcast_sampled=True))
    assert (first.kind, first.step, first.broadcast_sampled, first.graph_bucket) == (
        Kind.STEP, 0, True, None)
    assert first.num_sampled == 1 and first.forget == [] and first.prompt_rows == []
    # handle, start, num_new_tokens, samples, table op, table count
    assert first.rows == [0, 0, 3, 0, TableOp.RESET, 2, 1, 0, 2, 1, TableOp.RESET, 1]
    assert first.tokens == [11, 12, 13, 21, 22] and first.table_ids == [7, 3, 5]
    rows = mirror.apply(first)
    assert [(r.start, r.num_new_tokens, r.samples, list(r.block_ids), list(r.token_ids))
            for r in rows] == [(0, 3, False, [7, 3], [11, 12, 13]), (0, 2, True, [5], [21, 22])]

    # a's table grows in place (APPEND of the tail); b is a placeholder row
    # (source 4 of the previous step's tokens); b then finishes and a new
    # request reuses its handle in the next message.
    table_a.append(9)
    second = decode(encoder.encode(_step(
        [StepRow(3, 1, True, table_a, [14]), StepRow(2, 1, True, table_b, (), 4)], ["a", "b"],
        bucket=2), broadcast_sampled=False))
    assert second.step == 1 and second.graph_bucket == 2 and not second.broadcast_sampled
    assert second.rows == [0, 3, 1, 1, TableOp.APPEND, 1, 1, 2, 1, 1, TableOp.APPEND, 0]
    assert second.tokens == [14, -5] and second.table_ids == [9]
    rows = mirror.apply(second)
    assert list(rows[0].block_ids) == [7, 3, 9] and rows[1].placeholder_source == 4
    assert rows[1].token_ids == ()

    encoder.forget("b")
    encoder.forget("never-sent")  # no handle: nothing to say
    third = decode(encoder.encode(_step([StepRow(0, 2, True, [8, 1], [31, 32])], ["c"]),
                                  broadcast_sampled=False))
    assert third.forget == [1] and third.rows[0] == 1  # c takes b's handle
    rows = mirror.apply(third)
    assert list(rows[0].block_ids) == [8, 1] and set(mirror.tables) == {0, 1}
    assert encoder.num_known == 2

    # a's table replaced (preemption): a RESET with the whole new table
    table_a = [4]
    fourth = decode(encoder.encode(_step([StepRow(0, 2, True, table_a, [11, 12])], ["a"]),
                                   broadcast_sampled=False))
    assert fourth.rows[4:] == [TableOp.RESET, 1] and fourth.table_ids == [4]
    assert list(mirror.apply(fourth)[0].block_ids) == [4]

    stop = decode(stop_message(4))
    assert stop.kind is Kind.STOP and stop.num_rows == 0


def test_mirror_refuses_what_does_not_follow():
    encoder, table = StepEncoder(), [1]
    message = decode(encoder.encode(_step([StepRow(0, 2, True, table, [5, 6])], ["a"]),
                                    broadcast_sampled=False))
    with pytest.raises(WireError, match="step message 0 arrived, 1 was next"):
        mirror = StepMirror()
        mirror.apply(message)
        mirror.apply(message)
    appended = decode(encoder.encode(_step([StepRow(2, 1, True, table, [7])], ["a"]),
                                     broadcast_sampled=False))
    fresh = StepMirror()
    fresh.next_step = 1
    with pytest.raises(WireError, match="APPEND to unknown handle 0"):
        fresh.apply(appended)


def test_receive_over_a_socket_and_bad_messages():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        encoder = StepEncoder()
        message = encoder.encode(_step([StepRow(0, 2, True, [3], [1, 2])], ["a"]),
                                 broadcast_sampled=True)
        send(ours, message)
        send(ours, stop_message(1))
        assert receive(theirs).tokens == [1, 2]
        assert receive(theirs).kind is Kind.STOP
        ours.sendall(message[:20])  # cut inside the header
        ours.shutdown(socket.SHUT_WR)
        with pytest.raises(WireError, match="ended after 20 of"):
            receive(theirs)
        assert receive(theirs) is None  # end of stream between messages
    with pytest.raises(WireError, match="magic"):
        decode(bytes(HEADER_WORDS * 8))
    bad_version = bytearray(stop_message(0))
    bad_version[8] = 9
    with pytest.raises(WireError, match="version 9"):
        decode(bad_version)
    with pytest.raises(WireError, match="announces"):
        decode(stop_message(0) + bytes(8))
    assert int.from_bytes(stop_message(0)[:8], "little") == MAGIC


# ------------------------------------------------------------ rebuild on a worker


def _same_context(a, b) -> None:
    assert (a is None) == (b is None)
    if a is None:
        return
    assert a.num_decode == b.num_decode and a.prefill_chunks == b.prefill_chunks
    for name in ("slot_mapping", "decode_block_tables", "decode_context_lens"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert (a.prefill_context_slots is None) == (b.prefill_context_slots is None)
    if a.prefill_context_slots is not None:
        assert torch.equal(a.prefill_context_slots, b.prefill_context_slots)


class _Mirrored:
    """Wraps rank 0's `prepare`: every step is encoded, decoded, applied to a
    `StepMirror` and rebuilt by a second runner (the worker's), then the two
    steps' tensors are compared. Counts what the steps covered."""

    def __init__(self, engine, *, graphs: bool) -> None:
        self.engine = engine
        runner = engine.runner
        self.worker = ModelRunner(runner.model, runner.kv_caches, runner.block_size,
                                  max_num_seqs=engine.config.max_num_seqs,
                                  max_num_batched_tokens=engine.config.max_num_batched_tokens,
                                  max_model_len=engine.max_model_len)
        if graphs:  # bucket choice compared too (run eagerly, as on CPU)
            for r in (runner, self.worker):
                r.graphs = DecodeGraphs(r.model, r.inputs, r.decode_graph_context, (1, 2, 4),
                                        capture=False)
        self.encoder, self.mirror = StepEncoder(), StepMirror()
        self.seen = dict.fromkeys(("steps", "placeholders", "resets", "forgets", "context_chunks",
                                   "prompt_rows", "buckets"), 0)
        self._prepare, self._finish = runner.prepare, engine._finish
        runner.prepare, engine._finish = self.prepare, self.finish

    def finish(self, request, status) -> None:
        self._finish(request, status)
        self.encoder.forget(request.request_id)

    def prepare(self, scheduled, placeholder_sources=None) -> PreparedStep:
        step = self._prepare(scheduled, placeholder_sources)
        message = decode(self.encoder.encode(step, broadcast_sampled=True))
        rows = self.mirror.apply(message)
        rebuilt = self.worker.build(rows, prompt_logprobs=prompt_plan(message, self.worker.device))
        self._compare(step, rebuilt, message)
        return step

    def _compare(self, step: PreparedStep, rebuilt: PreparedStep, message) -> None:
        n = step.input_ids.numel()
        assert rebuilt.graph_bucket == step.graph_bucket == message.graph_bucket
        for name in ("input_ids", "positions", "sample_rows", "placeholder_rows",
                     "placeholder_sources"):
            assert torch.equal(getattr(step, name), getattr(rebuilt, name)), name
        ours, theirs = self.engine.runner.inputs, self.worker.inputs
        for field, other in zip(ours.fields(), theirs.fields(), strict=True):
            # every row a graph replay may read, padding included
            assert torch.equal(field.buffer, other.buffer), field.name
        _same_context(step.context, rebuilt.context)
        if step.prompt_logprobs is not None:
            assert torch.equal(step.prompt_logprobs.rows, rebuilt.prompt_logprobs.rows)
            self.seen["prompt_rows"] += 1
        else:
            assert rebuilt.prompt_logprobs is None
        assert message.num_sampled == step.sample_rows.numel() and n == len(message.tokens)
        self.seen["steps"] += 1
        self.seen["placeholders"] += step.placeholder_rows.numel()
        self.seen["resets"] += sum(message.rows[i + 4] == TableOp.RESET
                                   for i in range(0, len(message.rows), ROW_WORDS))
        self.seen["forgets"] += len(message.forget)
        self.seen["buckets"] += step.graph_bucket is not None
        if step.context is not None:
            self.seen["context_chunks"] += sum(c.context_start >= 0
                                               for c in step.context.prefill_chunks)


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 1100, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_worker_rebuilds_every_step_of_rank_0(make_engine, async_scheduling):
    """A tight pool (16 blocks of 16) preempts; a 32-token budget chunks the
    long prompts; a request sharing a 64-token prefix starts from cached
    blocks; one asks for prompt logprobs, one is aborted mid-decode."""
    engine = make_engine(block_size=16, num_blocks=16, max_num_batched_tokens=32,
                         max_num_seqs=6, async_scheduling=async_scheduling)
    mirrored = _Mirrored(engine, graphs=not async_scheduling)
    shared, *others = _prompts([64, 70, 5, 9, 40], seed=3)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine.add_request("long", shared + [1, 2, 3], greedy)
    for i, prompt in enumerate(others):
        engine.add_request(f"r{i}", prompt, greedy)
    engine.add_request("scored", others[2][:12],
                       SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2))
    step = 0
    while engine.has_unfinished_requests():
        engine.step()
        step += 1
        if step == 6:
            engine.add_request("hit", shared + [7, 8], greedy)
        if step == 9:
            engine.abort_request("r1")
    seen = mirrored.seen
    assert engine.scheduler.num_preemptions > 0 and engine.block_manager.prefix_cache.num_hits
    assert seen["resets"] > 7  # 7 requests, each one RESET at least; preempted ones again
    assert seen["context_chunks"] > 0 and seen["prompt_rows"] > 0 and seen["forgets"] > 0
    assert (seen["placeholders"] > 0) == async_scheduling
    assert (seen["buckets"] > 0) == (not async_scheduling)
    # every request forgotten on rank 0; the worker dropped all those sent
    assert mirrored.encoder.num_known == 0
    assert len(mirrored.mirror.tables) == 7 - seen["forgets"]


# ------------------------------------------------------------ cost


def measure_encode_send(batch: int, steps: int = 2000, blocks: int = 8) -> float:
    """Mean microseconds to encode one pure-decode step of `batch` rows (each
    a table of `blocks` ids, one id appended every 16 steps) and send it over
    a Unix socket a reader thread drains (raw reads: a worker decodes in its
    own process, not under this one's GIL)."""
    ours, theirs = socket.socketpair()

    def drain() -> None:
        buffer = bytearray(1 << 16)
        while theirs.recv_into(buffer):
            pass

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]
    ids = [f"request-{i}" for i in range(batch)]
    encoder = StepEncoder()
    total = 0.0
    for s in range(steps):
        if s % 16 == 0:
            for t in tables:
                t.append(t[-1] + 1)
        step = _step([StepRow(100 + s, 1, True, t, (s,)) for t in tables], ids)
        start = time.perf_counter()
        send(ours, encoder.encode(step, broadcast_sampled=True))
        total += time.perf_counter() - start
    ours.close()
    reader.join(10)
    theirs.close()
    return total / steps * 1e6


def test_encode_and_send_cost_is_printed(capsys):
    """Not a timing assertion: the figures the docs quote."""
    costs = {batch: measure_encode_send(batch) for batch in (8, 64)}
    with capsys.disabled():
        print("\nstep description encode+send:",
              ", ".join(f"batch {b}: {us:.1f} us" for b, us in costs.items()))
    assert all(us > 0 for us in costs.values())


def test_names_and_spans_reach_the_worker():
    """Request ids of new handles (any UTF-8 length; a reused handle gets its
    new request's id) and the step's layer-KV spans, slot mappings rebuilt
    from the worker's tables."""
    from types import SimpleNamespace

    from engine.kv_hook import LayerKVSpan

    encoder, mirror = StepEncoder(), StepMirror()
    ids = ["a", "ré-12345", "x" * 8, "日本語のリクエスト"]
    tables = [[3], [4, 9], [5], [6, 7]]
    step = _step([StepRow(0, 2, False, t, [1, 2]) for t in tables], ids)
    span = LayerKVSpan(ids[1], 16, 18, torch.tensor([9 * 16, 9 * 16 + 1]))
    step = PreparedStep(**{f: getattr(step, f) for f in PreparedStep.__slots__
                           if f != "context"}, context=SimpleNamespace(spans=(span,)))
    message = decode(encoder.encode(step, broadcast_sampled=False))
    mirror.apply(message)
    assert mirror.names == dict(enumerate(ids))
    (rebuilt,) = mirror.spans(message, 16, torch.device("cpu"))
    assert (rebuilt.request_id, rebuilt.start, rebuilt.end) == (ids[1], 16, 18)
    assert rebuilt.slot_mapping.tolist() == [144, 145]
    encoder.forget(ids[0])
    again = decode(encoder.encode(_step([StepRow(0, 1, True, [8], [5])], ["new"]),
                                  broadcast_sampled=False))
    assert again.names[:2] == [0, 3]  # handle 0 reused, 3 bytes
    mirror.apply(again)
    assert mirror.names[0] == "new" and mirror.spans(again, 16, torch.device("cpu")) == ()
    # rank 0 writes each worker's control_seq into its copy (TPLeader.send_step)
    assert again.control_seq == 0
