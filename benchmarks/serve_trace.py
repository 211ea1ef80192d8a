"""Mooncake-format request traces as `pdserve bench serve` workloads.

A trace is JSONL, one request a line:
`{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}`
where hash id i stands for the i-th block of `block_size` prompt tokens and
equal ids are equal blocks, so two requests whose lists start alike share
that many blocks of prompt (docs in ../shared/traces/README.md).

Replaying one:

    block     hash id h -> `block_size` token ids from Random("seed:h:block_size")
              over the vocabulary (special tokens left out): equal ids give
              equal blocks in every request, on every machine
    prompt    the blocks of `hash_ids` in order, cut to `input_length` tokens
              (the last block is partial; a trace line with no hash ids gets
              fresh tokens of its own)
    output    `output_length` tokens (ignore_eos)
    arrival   `timestamp` ms after the first request
    scaling   --length-scale s multiplies input lengths and the block size
              (so the share of prompt that is prefix stays the same),
              --output-scale the output lengths (default: s), and
              --time-scale t the arrival times (t > 1 spreads requests out);
              every scaled length is rounded and at least 1, and a prompt is
              never longer than its scaled blocks
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from benchmarks.serve_workload import BenchRequest, Session, Vocabulary


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One trace line, unscaled."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: Path, max_requests: int | None = None) -> list[TraceRequest]:
    """The first `max_requests` lines of a Mooncake trace (all if None).
    ValueError naming the file and line for a line that is not a request."""
    if max_requests is not None and max_requests < 1:
        raise ValueError(f"--max-requests must be >= 1, got {max_requests}")
    if not path.is_file():
        raise ValueError(f"--trace {path}: no such file")
    requests: list[TraceRequest] = []
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            if max_requests is not None and len(requests) == max_requests:
                break
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                request = TraceRequest(float(item["timestamp"]), int(item["input_length"]),
                                       int(item["output_length"]),
                                       tuple(int(h) for h in item.get("hash_ids", ())))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"--trace {path} line {number}: not a trace request "
                                 f"({type(exc).__name__}: {exc})") from None
            if request.input_length < 1 or request.output_length < 1 or \
                    request.timestamp_ms < 0:
                raise ValueError(f"--trace {path} line {number}: lengths must be >= 1 and "
                                 f"the timestamp >= 0")
            requests.append(request)
    if not requests:
        raise ValueError(f"--trace {path}: no requests in it")
    return requests


@dataclass(frozen=True, slots=True)
class TraceScaling:
    """How a trace is replayed: its block size and the scales (see the module)."""

    block_size: int = 512
    length_scale: float = 1.0
    output_scale: float | None = None  # None = length_scale
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"--trace-block-size must be >= 1, got {self.block_size}")
        for name in ("length_scale", "output_scale", "time_scale"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value}")

    @property
    def scaled_block_size(self) -> int:
        return max(1, round(self.block_size * self.length_scale))

    def input_length(self, request: TraceRequest) -> int:
        length = max(1, round(request.input_length * self.length_scale))
        if request.hash_ids:
            length = min(length, len(request.hash_ids) * self.scaled_block_size)
        return length

    def output_length(self, request: TraceRequest) -> int:
        scale = self.length_scale if self.output_scale is None else self.output_scale
        return max(1, round(request.output_length * scale))


class BlockTokens:
    """hash id -> its block of token ids, made once and kept."""

    def __init__(self, vocab: Vocabulary, block_size: int, seed: int) -> None:
        self._allowed = vocab.allowed()
        self._block_size = block_size
        self._seed = seed
        self._blocks: dict[int, list[int]] = {}

    def __call__(self, hash_id: int) -> list[int]:
        block = self._blocks.get(hash_id)
        if block is None:
            # a str seed is hashed with SHA-512: the same block on every machine
            rng = random.Random(f"{self._seed}:{hash_id}:{self._block_size}")
            block = self._blocks[hash_id] = rng.choices(self._allowed, k=self._block_size)
        return block


def trace_prompt(request: TraceRequest, scaling: TraceScaling, blocks: BlockTokens,
                 index: int, seed: int, allowed: list[int]) -> list[int]:
    """The scaled prompt of one trace line (`index` seeds a line without hash ids)."""
    length = scaling.input_length(request)
    if not request.hash_ids:
        return random.Random(f"{seed}:line:{index}").choices(allowed, k=length)
    prompt: list[int] = []
    for hash_id in request.hash_ids:
        if len(prompt) >= length:
            break
        prompt.extend(blocks(hash_id))
    return prompt[:length]


def trace_sessions(requests: list[TraceRequest], scaling: TraceScaling, vocab: Vocabulary,
                   seed: int = 0) -> list[Session]:
    """One single-turn session per trace line, arriving at its scaled time
    after the first line."""
    blocks = BlockTokens(vocab, scaling.scaled_block_size, seed)
    allowed = vocab.allowed()
    start_ms = min(r.timestamp_ms for r in requests)
    sessions = []
    for index, request in enumerate(requests):
        prompt = trace_prompt(request, scaling, blocks, index, seed, allowed)
        turn = BenchRequest(tuple(prompt), scaling.output_length(request))
        arrival = (request.timestamp_ms - start_ms) / 1e3 * scaling.time_scale
        sessions.append(Session(arrival, (turn,)))
    return sessions
