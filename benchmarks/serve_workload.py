"""What `pdserve bench serve` sends: sessions of requests, and when.

A workload is a list of `Session`s. A session arrives at `arrival_s` (seconds
after the run starts) and sends its turns one after another, each turn once
the previous one has finished; single-turn workloads are sessions of one
turn. The client (benchmarks/serve_client.py) also caps the requests in
flight at the concurrency limit, so arrivals can wait for a slot.

Everything here is seeded and pure: the same flags give the same token ids,
lengths and arrival times on every machine, so two systems get identical
requests.

    random      prompts of seeded random token ids (special tokens left out),
                lengths uniform in [len * (1 - r), len * (1 + r)] (r = range ratio;
                outputs may have their own)
    multi-turn  turn k+1's prompt = turn k's prompt + a stand-in for turn k's
                answer (its max_tokens of seeded token ids) + new user tokens;
                every turn carries the session id (sent as OpenAI's `user`,
                which pdserve's router uses for sticky routing). The client
                holds token ids and no tokenizer, so it cannot send the
                server's real answer back; the stand-in has the answer's
                length, which keeps prompt growth and prefix sharing (the part
                a prefix cache sees) as in a real chat. With real answers
                (`--turn-answers real`) the client asks for each answer's
                token ids (`return_tokens_as_token_ids`) and sends the
                server's own answer in the stand-in's place, as a chat does.
    trace       Mooncake traces: benchmarks/serve_trace.py
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One completion request: the prompt's token ids and the output length
    (sent with ignore_eos, so the server generates exactly max_tokens)."""

    prompt: tuple[int, ...]
    max_tokens: int
    session_id: str | None = None
    # a multi-turn session's later turn: where in `prompt` the stand-in for
    # the previous turn's answer starts (its max_tokens long), which a client
    # with real answers replaces by the server's answer; -1: none
    answer_at: int = -1

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("a request needs at least one prompt token")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True, slots=True)
class Session:
    """Turns sent in order, the first at `arrival_s` seconds after the start."""

    arrival_s: float
    turns: tuple[BenchRequest, ...]

    def __post_init__(self) -> None:
        if self.arrival_s < 0:
            raise ValueError(f"arrival_s must be >= 0, got {self.arrival_s}")
        if not self.turns:
            raise ValueError("a session needs at least one turn")


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """The token ids prompts are drawn from: [0, size) minus `exclude`."""

    size: int
    exclude: frozenset[int] = frozenset()

    def allowed(self) -> list[int]:
        ids = [t for t in range(self.size) if t not in self.exclude]
        if not ids:
            raise ValueError(f"no token ids left in [0, {self.size}) after excluding "
                             f"{len(self.exclude)}")
        return ids

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> Vocabulary:
        """config.json's vocab_size, less tokenizer.json's special tokens."""
        config = model_dir / "config.json"
        if not config.is_file():
            raise ValueError(f"--vocab-from {model_dir}: no config.json there")
        size = json.loads(config.read_text())["vocab_size"]
        tokenizer = model_dir / "tokenizer.json"
        specials: frozenset[int] = frozenset()
        if tokenizer.is_file():
            added = json.loads(tokenizer.read_text()).get("added_tokens", [])
            specials = frozenset(t["id"] for t in added if t.get("special"))
        return cls(size, specials)


def poisson_arrivals(num: int, rate: float | None, seed: int) -> list[float]:
    """`num` arrival times (s): the first at 0, then exponential gaps of mean
    1/rate drawn from Random(seed); all 0 when rate is None (all at once)."""
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    if rate is None:
        return [0.0] * num
    if not rate > 0:
        raise ValueError(f"--request-rate must be > 0 requests/s, got {rate}")
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(num):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def random_lengths(num: int, length: int, range_ratio: float, rng: random.Random) -> list[int]:
    """`num` lengths uniform in [length * (1 - r), length * (1 + r)], at least 1."""
    if length < 1:
        raise ValueError(f"lengths must be >= 1, got {length}")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    low = max(1, round(length * (1 - range_ratio)))
    high = max(low, round(length * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(num)]


@dataclass(frozen=True, slots=True)
class RandomWorkload:
    """Random prompts: `num_sessions` sessions of `turns` turns each."""

    num_sessions: int
    input_len: int
    output_len: int
    range_ratio: float = 0.0
    output_range_ratio: float | None = None  # None = range_ratio
    turns: int = 1
    request_rate: float | None = None  # sessions/s, Poisson; None = all at once
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_sessions", "input_len", "output_len", "turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, "
                                 f"got {getattr(self, name)}")
        for name in ("range_ratio", "output_range_ratio"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1), got {value}")

    def sessions(self, vocab: Vocabulary) -> list[Session]:
        allowed = vocab.allowed()
        rng = random.Random(self.seed)
        total = self.num_sessions * self.turns
        inputs = random_lengths(total, self.input_len, self.range_ratio, rng)
        outputs = random_lengths(total, self.output_len, self.range_ratio
                                 if self.output_range_ratio is None
                                 else self.output_range_ratio, rng)
        arrivals = poisson_arrivals(self.num_sessions, self.request_rate, self.seed)
        sessions = []
        for s, arrival in enumerate(arrivals):
            session_id = f"bench-session-{self.seed}-{s}" if self.turns > 1 else None
            prompt: list[int] = []
            turns = []
            for t in range(self.turns):
                i = s * self.turns + t
                answer_at = len(prompt) if t else -1
                if t:  # the previous answer's stand-in, then the new user message
                    prompt = prompt + rng.choices(allowed, k=outputs[i - 1])
                prompt = prompt + rng.choices(allowed, k=inputs[i])
                turns.append(BenchRequest(tuple(prompt), outputs[i], session_id, answer_at))
            sessions.append(Session(arrival, tuple(turns)))
        return sessions
