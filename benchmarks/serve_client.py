"""A load client for any OpenAI-compatible server: streamed `/v1/completions`.

The core of `pdserve bench serve` (benchmarks/serve.py, which sends
benchmarks/serve_workload.py's sessions through `run_sessions`) and of
`pdserve bench peer` (benchmarks/peer.py, `run_load` over plain prompts).
One request's life:

    arrival   its session's arrival time (`run_load`: at once, or at seeded
              Poisson times with `request_rate`), then each turn of a session
              after the previous one ended (`turn_overlap`: once the previous
              one's first token is in, so turns overlap in time and the next
              turn's prefix may still be computing: issue 42's case); at most
              `concurrency` in flight
    send      POST /v1/completions {prompt: [token ids], max_tokens,
              ignore_eos: true, temperature: 0, stream: true,
              stream_options: {include_usage: true}} (+ logprobs: 0, below;
              + user: the session id, for multi-turn sessions; + return_tokens_
              as_token_ids with `real_answers`, whose next turn carries the
              answer's ids in place of the workload's stand-in)
    stream    each `data:` chunk is timestamped on arrival; the first one
              carrying tokens gives TTFT, later ones the inter-token latencies
    end       `data: [DONE]`; the usage chunk's completion_tokens must equal
              the tokens counted, else the request counts as an error

Counting tokens. Servers do not send one chunk per token: pdserve's router
sends no chunk for a token whose text is empty (a special token, or bytes of
an unfinished UTF-8 character), vLLM sends those as empty chunks, and either
may put several tokens in one chunk when the client falls behind. With
`token_count="logprobs"` (the default) every request asks for `logprobs: 0`,
and each chunk's `logprobs.tokens` says exactly how many tokens it carries
(cost on both servers: one log-softmax over the vocabulary and one token
rendered per output token). `token_count="chunks"` (for servers without logprobs)
asks for none, takes the output tokens from the usage chunk, and records one
inter-chunk latency per chunk after the first, as `vllm bench serve` does:
where chunks are not one token each those are not per-token figures (the
record's `chunks` beside `output_tokens` shows it).

Inter-token latency with logprobs is per token: a chunk carrying k tokens
that arrives g seconds after the previous chunk contributes k latencies of
g/k; tokens that came with the first chunk contribute 0. So every request has
exactly `output_tokens - 1` ITL samples. TPOT is per request, (e2e - TTFT) /
(output_tokens - 1), in both modes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.serve_workload import BenchRequest, Session, poisson_arrivals

TOKEN_COUNTS = ("logprobs", "chunks")


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """How requests are sent: how many may be in flight, when they arrive.
    `max_tokens` and `request_rate` shape `run_load`'s plain prompts; the
    sessions `run_sessions` takes carry their own lengths and arrivals."""

    max_tokens: int
    concurrency: int = 1
    request_rate: float | None = None  # requests/s, Poisson; None = all at once
    seed: int = 0
    token_count: str = "logprobs"
    timeout_s: float = 600.0
    turn_overlap: bool = False  # send a session's next turn at the previous one's first token
    # a later turn carries the server's answer to the one before, not the stand-in
    # (BenchRequest.answer_at): asked as token ids, so sent as the server made them
    real_answers: bool = False
    think_s: float = 0.0  # a session's next turn waits this long after the previous one ended

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 requests/s (or None), "
                             f"got {self.request_rate}")
        if self.token_count not in TOKEN_COUNTS:
            raise ValueError(f"token_count must be one of {TOKEN_COUNTS}, "
                             f"got {self.token_count!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if not 0 <= self.think_s <= 3600:
            raise ValueError(f"think_s must be in [0, 3600] seconds, got {self.think_s}")
        if self.think_s and self.turn_overlap:
            raise ValueError("think_s needs each turn to end before the next (no turn_overlap)")
        if self.real_answers and (self.turn_overlap or self.token_count != "logprobs"):
            raise ValueError("real answers need each turn to end before the next "
                             "(no turn_overlap) and token_count 'logprobs' (the ids come "
                             "in the logprobs)")


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it; times in seconds."""

    prompt_len: int
    max_tokens: int = 0
    session_id: str | None = None
    turn: int = 0
    start_s: float = 0.0  # since the run started
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    output_tokens: int = 0
    chunks: int = 0
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens the server took from its prefix cache (usage)


def random_prompts(num: int, length: int, vocab_size: int, *, seed: int = 0,
                   exclude: frozenset[int] = frozenset()) -> list[list[int]]:
    """`num` prompts of `length` token ids drawn uniformly from
    [0, vocab_size) minus `exclude` (e.g. special tokens); the same seed
    gives the same prompts on every machine."""
    if num < 0 or length < 1:
        raise ValueError(f"need num >= 0 and length >= 1, got num={num}, length={length}")
    allowed = [t for t in range(vocab_size) if t not in exclude]
    if not allowed:
        raise ValueError(f"no token ids left in [0, {vocab_size}) after excluding {len(exclude)}")
    rng = random.Random(seed)
    return [rng.choices(allowed, k=length) for _ in range(num)]


TOKEN_ID_PREFIX = "token_id:"  # how return_tokens_as_token_ids shows a token


def _answer_ids(choice: dict[str, Any]) -> list[int]:
    """A chunk's token ids from logprobs shown as `token_id:<id>`."""
    tokens = (choice.get("logprobs") or {}).get("tokens") or ()
    if not all(t.startswith(TOKEN_ID_PREFIX) for t in tokens):
        raise RuntimeError("real answers need return_tokens_as_token_ids, but the server "
                           f"sent logprobs tokens like {tokens[0]!r}")
    return [int(t[len(TOKEN_ID_PREFIX):]) for t in tokens]


def _chunk_tokens(choice: dict[str, Any], token_count: str) -> int:
    """Tokens in one chunk: counted by its logprobs, or 1 per chunk."""
    if token_count == "chunks":
        return 1
    logprobs = choice.get("logprobs") or {}
    return len(logprobs.get("tokens") or ())


async def _one_request(session, url: str, model: str, request: BenchRequest, spec: LoadSpec,
                       record: RequestRecord, run_start: float,
                       first_token: asyncio.Event | None = None,
                       answer: list[int] | None = None) -> None:
    """`answer`: where the output's token ids go (`spec.real_answers`)."""
    body: dict[str, Any] = {
        "model": model, "prompt": list(request.prompt), "max_tokens": request.max_tokens,
        "ignore_eos": True, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True},
    }
    if spec.token_count == "logprobs":
        body["logprobs"] = 0
    if answer is not None:
        body["return_tokens_as_token_ids"] = True
    if request.session_id is not None:
        body["user"] = request.session_id
    start = time.perf_counter()
    record.start_s = start - run_start
    last = start
    usage_tokens = None
    done = False
    async with session.post(url, json=body) as response:
        if response.status != 200:
            text = (await response.text())[:300]
            raise RuntimeError(f"HTTP {response.status}: {text}")
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            now = time.perf_counter()
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"error event: {json.dumps(event['error'])[:300]}")
            if event.get("usage"):
                usage_tokens = event["usage"].get("completion_tokens")
                details = event["usage"].get("prompt_tokens_details") or {}
                record.cached_tokens = int(details.get("cached_tokens") or 0)
            if not event.get("choices"):
                continue
            tokens = _chunk_tokens(event["choices"][0], spec.token_count)
            if tokens == 0:
                continue
            if answer is not None:
                answer.extend(_answer_ids(event["choices"][0]))
            record.chunks += 1
            if record.output_tokens == 0:
                record.ttft_s = now - start
                if first_token is not None:
                    first_token.set()
                record.itl_s.extend([0.0] * (tokens - 1))
            elif spec.token_count == "chunks":
                record.itl_s.append(now - last)
            else:
                record.itl_s.extend([(now - last) / tokens] * tokens)
            record.output_tokens += tokens
            last = now
    record.e2e_s = time.perf_counter() - start
    if not done:
        raise RuntimeError("the stream ended without data: [DONE]")
    if spec.token_count == "chunks":
        record.output_tokens = record.chunks if usage_tokens is None else usage_tokens
    elif usage_tokens != record.output_tokens:
        raise RuntimeError(f"counted {record.output_tokens} tokens in {record.chunks} chunks "
                           f"but usage says {usage_tokens} (a server that returns no "
                           "logprobs needs token_count='chunks')")


async def _run(base_url: str, model: str, sessions: list[Session], spec: LoadSpec,
               on_done: Callable[[RequestRecord], None] | None,
               ) -> tuple[list[RequestRecord], float]:
    import aiohttp

    url = base_url.rstrip("/") + "/v1/completions"
    records = [[RequestRecord(prompt_len=len(turn.prompt), max_tokens=turn.max_tokens,
                              session_id=turn.session_id, turn=t)
                for t, turn in enumerate(s.turns)] for s in sessions]
    limit = asyncio.Semaphore(spec.concurrency)
    timeout = aiohttp.ClientTimeout(total=spec.timeout_s)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as client:
        run_start = time.perf_counter()

        async def one(turn, record: RequestRecord, first_token: asyncio.Event,
                      answer: list[int] | None) -> None:
            async with limit:
                try:
                    await _one_request(client, url, model, turn, spec, record, run_start,
                                       first_token, answer)
                except (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError) as exc:
                    record.error = f"{type(exc).__name__}: {exc}"
            first_token.set()  # ended (or failed) without a first token: the next may go
            if on_done is not None:
                on_done(record)

        async def send(session: Session, session_records: list[RequestRecord]) -> None:
            await asyncio.sleep(max(0.0, run_start + session.arrival_s - time.perf_counter()))
            failed = False
            sent: list[asyncio.Task] = []
            previous: tuple[tuple[int, ...], list[int], int] | None = None  # real answers
            for turn, record in zip(session.turns, session_records, strict=True):
                if failed:  # later turns extend this one: they would not be the same chat
                    record.error = "not sent: an earlier turn of its session failed"
                    if on_done is not None:
                        on_done(record)
                else:
                    first_token = asyncio.Event()
                    answer = [] if spec.real_answers else None
                    if previous is not None and turn.answer_at >= 0:
                        turn = _with_answer(turn, *previous)
                    task = asyncio.ensure_future(one(turn, record, first_token, answer))
                    if answer is not None:
                        previous = (turn.prompt, answer, turn.max_tokens)
                    sent.append(task)
                    await (first_token.wait() if spec.turn_overlap else task)
                    if spec.think_s:
                        await asyncio.sleep(spec.think_s)  # the user reads, then types
                    # failed before the next turn was due: the chat stops there
                    failed = record.error is not None
            for task in sent:
                await task

        await asyncio.gather(*(send(s, r) for s, r in zip(sessions, records, strict=True)))
        duration = time.perf_counter() - run_start
    return [record for session_records in records for record in session_records], duration


def _with_answer(turn: BenchRequest, prompt: tuple[int, ...], answer: list[int],
                 stand_in: int) -> BenchRequest:
    """`turn` with the previous turn's prompt as sent and its real answer in
    place of the prompt and `stand_in`-token answer it was made with
    (BenchRequest.answer_at)."""
    if len(prompt) != turn.answer_at:
        raise RuntimeError(f"the previous turn's prompt has {len(prompt)} tokens, but this "
                           f"turn's answer stand-in starts at {turn.answer_at}")
    rest = turn.prompt[turn.answer_at + stand_in:]
    return dataclasses.replace(turn, prompt=prompt + tuple(answer) + rest)


def run_sessions(base_url: str, model: str, sessions: list[Session], spec: LoadSpec,
                 on_done: Callable[[RequestRecord], None] | None = None) -> dict:
    """Send every session to `base_url` (each at its arrival time, turns in
    order, at most `spec.concurrency` requests in flight); the summary (see
    `summarize`) with each request's record under "requests", in session and
    turn order. A turn after a failed one is not sent and counts as an error.
    `on_done(record)` runs on the event loop after each request (a progress bar)."""
    if not sessions:
        raise ValueError("run_sessions needs at least one session")
    records, duration = asyncio.run(_run(base_url, model, sessions, spec, on_done))
    return {**summarize(records, duration), "requests": [asdict(r) for r in records]}


def run_load(base_url: str, model: str, prompts: list[list[int]], spec: LoadSpec) -> dict:
    """Send every prompt (in order) to `base_url` under `spec`; the summary
    (see `summarize`) with each request's record under "requests"."""
    if not prompts:
        raise ValueError("run_load needs at least one prompt")
    arrivals = poisson_arrivals(len(prompts), spec.request_rate, spec.seed)
    sessions = [Session(at, (BenchRequest(tuple(prompt), spec.max_tokens),))
                for at, prompt in zip(arrivals, prompts, strict=True)]
    return run_sessions(base_url, model, sessions, spec)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _stats_ms(values: list[float]) -> dict[str, float | None]:
    """Mean and percentiles in ms; None where there are no samples (strict JSON has no NaN)."""
    keys = ("mean", "p50", "p90", "p99")
    if not values:
        return dict.fromkeys(keys)
    mean = sum(values) / len(values)
    return {"mean": mean * 1e3, **{f"p{q}": percentile(values, q) * 1e3 for q in (50, 90, 99)}}


def summarize(records: list[RequestRecord], duration_s: float) -> dict:
    """Throughput and latency statistics over the requests that completed."""
    ok = [r for r in records if r.error is None]
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.prompt_len for r in ok)
    return {
        "num_requests": len(records),
        "completed": len(ok),
        "errors": len(records) - len(ok),
        "error_messages": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration_s,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "input_throughput": input_tokens / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "ttft_ms": _stats_ms([r.ttft_s for r in ok]),
        "tpot_ms": _stats_ms([(r.e2e_s - r.ttft_s) / (r.output_tokens - 1)
                              for r in ok if r.output_tokens > 1]),
        "itl_ms": _stats_ms([gap for r in ok for gap in r.itl_s]),
        "e2e_ms": _stats_ms([r.e2e_s for r in ok]),
    }
